"""A request's images: read under the server's declared limits, then made the model's inputs by its
processor.

Where an image may come from: a ``data:`` URL (base64) always; a ``file://`` URL only inside
``--allowed-local-media-path``; an ``http(s)://`` URL only with ``--allow-remote-media``, fetched
by rank 0 within ``--media-timeout`` and never beyond ``--max-image-bytes``. Every image is at most
``--max-image-bytes`` and ``--max-image-pixels`` (checked from its header, before it is decoded),
and a request brings at most ``--max-images-per-request``. Each violation is a
:class:`~server.http.errors.MediaError` (400) naming its option; the server keeps serving.

:class:`ImagePrompts` holds the model's processor (:func:`load_processor`): a prompt's text, with the
chat template's image placeholders, and its images become the prompt's token ids (each image's
placeholder expanded to its tokens) and one :class:`~server.engine.plan.ImageInput` per image,
which the engine encodes (``server.engine.multimodal``). A prompt whose placeholders do not match
its images (a placeholder typed as text, an image without one) is a 400 too. An image carries its
geometry where the family's encoder takes one (:data:`IMAGE_GEOMETRY`: Qwen-VL's patch grid, whose
pixel values are the processor's patch rows for it; LLaVA-NeXT's original size, whose pixel values
are its tiles; Pixtral's resized size, whose pixel values are cropped to it).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import os
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from server.http.errors import MediaError

IMAGE_GEOMETRY = ("image_grid_thw", "image_sizes")
"""The processor's outputs that give each image's geometry to the encoder (``ImageInput.grid``):
Qwen-VL's patch grid, LLaVA-NeXT's original size, Pixtral's size after its resize."""

IMAGE_MARKDOWN = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
"""TGI's image syntax in ``inputs``: ``![](url)``."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where a request's images may come from and how large they may be (``ServeConfig``'s limits)."""

    max_images: int
    max_bytes: int
    max_pixels: int
    local_root: str | None
    allow_remote: bool
    timeout_s: float

    @classmethod
    def of(cls, cfg) -> MediaPolicy:
        root = os.path.realpath(cfg.allowed_local_media_path) if cfg.allowed_local_media_path else None
        return cls(cfg.max_images_per_request, cfg.max_image_bytes, cfg.max_image_pixels, root,
                   cfg.allow_remote_media, cfg.media_timeout_s)

    def describe(self) -> dict:
        """What ``/info`` says of it (the page's image picker reads it)."""
        return {"max_images_per_request": self.max_images, "max_image_bytes": self.max_bytes,
                "max_image_pixels": self.max_pixels, "local_files": self.local_root is not None,
                "remote_urls": self.allow_remote}

    def check_count(self, count: int) -> None:
        if count > self.max_images:
            raise MediaError(f"the request brings {count} images; at most {self.max_images} "
                             "(--max-images-per-request)", param="--max-images-per-request")


async def read_images(urls: list[str], policy: MediaPolicy) -> list:
    """The images at ``urls``, in order, as RGB ``PIL.Image``s (decoded off the event loop)."""
    from server.api.generation import off_loop

    policy.check_count(len(urls))
    images = []
    for url in urls:
        data = await _remote(url, policy) if url.startswith(("http://", "https://")) else await off_loop(
            _local_or_data, url, policy)
        images.append(await off_loop(decode_image, data, policy))
    return images


def _local_or_data(url: str, policy: MediaPolicy) -> bytes:
    if url.startswith("data:"):
        return _data_url(url, policy)
    if url.startswith("file:"):
        return _local(url, policy)
    scheme = url.split(":", 1)[0] if ":" in url else ""
    raise MediaError(f"an image URL must be data:, file: or http(s):, got {scheme or url[:32]!r}", param="url")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data: image URL must be base64 (data:image/png;base64,...)", param="url")
    if len(payload) * 3 // 4 > policy.max_bytes + 3:
        raise MediaError(f"an image is larger than {policy.max_bytes} bytes (--max-image-bytes)",
                         param="--max-image-bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"a data: image URL is not valid base64: {e}", param="url") from e
    _check_bytes(len(data), policy)
    return data


def _local(url: str, policy: MediaPolicy) -> bytes:
    if policy.local_root is None:
        raise MediaError("file: image URLs are refused: the server was started without --allowed-local-media-path",
                         param="--allowed-local-media-path")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    if os.path.commonpath([path, policy.local_root]) != policy.local_root:
        raise MediaError(f"{path} is outside --allowed-local-media-path", param="--allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            _check_bytes(os.fstat(f.fileno()).st_size, policy)
            return f.read()
    except OSError as e:
        raise MediaError(f"cannot read image {path}: {e.strerror}", param="url") from e


async def _remote(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise MediaError("http(s) image URLs are refused: the server was started without --allow-remote-media",
                         param="--allow-remote-media")
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise MediaError(f"fetching image {url} answered {response.status_code}", param="url")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    _check_bytes(len(data), policy)
                return bytes(data)
    except httpx.TimeoutException as e:
        raise MediaError(f"fetching image {url} took longer than {policy.timeout_s:g} s (--media-timeout)",
                         param="--media-timeout") from e
    except httpx.HTTPError as e:
        raise MediaError(f"fetching image {url} failed: {e}", param="url") from e


def _check_bytes(size: int, policy: MediaPolicy) -> None:
    if size > policy.max_bytes:
        raise MediaError(f"an image is larger than {policy.max_bytes} bytes (--max-image-bytes)",
                         param="--max-image-bytes")


def decode_image(data: bytes, policy: MediaPolicy):
    """``data`` as an RGB ``PIL.Image``; its size checked from its header before it is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError) as e:
        raise MediaError(f"not an image this server reads: {e}", param="url") from e
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(f"an image of {width}x{height} has more than {policy.max_pixels} pixels "
                         "(--max-image-pixels)", param="--max-image-pixels")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image cannot be decoded: {e}", param="url") from e
    return image.convert("RGB")


def load_processor(model_dir: str):
    """The model's processor (``AutoProcessor``). Where transformers builds it only with torchvision
    (which not every torch build has): a processor that also takes videos is built from its image
    processor and tokenizer (Qwen-VL's video processor needs torchvision; images are all the engine
    takes), and Pixtral's (Pixtral-12B, Mistral 3) as :func:`pixtral_processor_class`'s, over the
    PIL backend of its image processor."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (ImportError, ValueError) as exc:  # InternVL's says so with a ValueError
        if "torchvision" not in str(exc).lower():
            raise
        if _processor_class_name(model_dir) == "PixtralProcessor":
            return pixtral_processor_class().from_pretrained(model_dir)
        return _image_processor_only(model_dir)


def _processor_class_name(model_dir: str) -> str | None:
    """The ``processor_class`` the checkpoint's processor files name, or None."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                named = json.load(f).get("processor_class")
            if named:
                return named
    return None


@functools.cache
def pixtral_processor_class():
    """transformers' ``PixtralProcessor`` less its import of the torchvision image processor's
    module (it takes one resize function from it, for ``_get_num_multimodal_tokens``, which this
    one does not have): the same settings (``processor_config.json``) and the same expansion of an
    ``[IMG]`` placeholder into the image's rows of ``[IMG]`` tokens, each row ended by
    ``[IMG_BREAK]`` and the last by ``[IMG_END]``. ``tests/test_vision_pixtral.py`` checks it against
    transformers' own class, imported there past that import."""
    from transformers.processing_utils import ProcessorMixin

    class PixtralProcessor(ProcessorMixin):
        def __init__(self, image_processor=None, tokenizer=None, patch_size: int = 16, spatial_merge_size: int = 1,
                     chat_template=None, image_token="[IMG]", image_break_token="[IMG_BREAK]",
                     image_end_token="[IMG_END]", **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template)
            self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
            self.image_token, self.image_break_token, self.image_end_token = \
                image_token, image_break_token, image_end_token
            self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
            self.image_break_token_id = tokenizer.convert_tokens_to_ids(image_break_token)
            self.image_end_token_id = tokenizer.convert_tokens_to_ids(image_end_token)

        @property
        def image_token_ids(self) -> list[int]:
            return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

        def _process_images(self, images, **images_kwargs):
            images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
            return super()._process_images(images, **images_kwargs)

        def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
            patch = self.patch_size * self.spatial_merge_size
            height, width = image_inputs["image_sizes"][image_idx]
            rows = [[self.image_token] * (int(width) // patch) + [self.image_break_token]] * (int(height) // patch)
            tokens = [token for row in rows for token in row]
            tokens[-1] = self.image_end_token
            return "".join(tokens)

        @property
        def model_input_names(self):
            return self.tokenizer.model_input_names + self.image_processor.model_input_names + ["image_sizes"]

    return PixtralProcessor


def _image_processor_only(model_dir: str):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    processor_class = PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
    if "video_processor" not in processor_class.get_attributes():
        raise ImportError(f"{processor_class.__name__} needs torchvision")

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {}  # the processor's own settings (SmolVLM's image_seq_len), as from_pretrained passes them
    config_file = os.path.join(model_dir, "processor_config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            kwargs = {k: v for k, v in json.load(f).items() if k not in ("processor_class", "auto_map")}
    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer,
                      video_processor=None, chat_template=tokenizer.chat_template, **kwargs)


def _per_image(pixels, masks, tiles: list[int]) -> tuple[list, list | None]:
    """One sample's stacked tiles ([tiles, C, H, W], padded to the sample's most) as each image's own
    ([1, its tiles, C, H, W]), and its mask's likewise."""
    bounds, at = [], 0
    for count in tiles:
        bounds.append((at, at + count))
        at += count
    return ([pixels[a:b].unsqueeze(0) for a, b in bounds],
            [masks[a:b].unsqueeze(0) for a, b in bounds] if masks is not None else None)


class ImagePrompts:
    """The model's processor: a prompt's text and images into token ids and the engine's images."""

    def __init__(self, processor, image_token_id: int, span: tuple[int, int] | None = None,
                 tiles_of: Callable[[list[int]], int] | None = None, family=None):
        self.processor, self.image_token_id = processor, image_token_id
        # LLaVA-OneVision: an image is tiled only alone in its prompt; the processor tells by sample, so a
        # prompt's images go to it as one sample (as transformers' chat template passes a conversation's)
        self.tiled_alone = family is not None and family.tiled_alone
        # InternVL: every image's tiles in one flat batch, image_seq_length tokens a tile
        self.tile_tokens = processor.image_seq_length if family is not None and family.flat_tiles else None
        # Pixtral: an image's pixels at its own resized size, which the processor pads to a request's largest
        self.sized = family is not None and family.sized
        # an image's own tiles from its size (LLaVA-NeXT, whose processor pads a request's images to its
        # most tiles): what its model takes of them, so that its pixels and key are its own alone
        self.tiles_of = tiles_of
        # what stands for an image in a prompt's text: the processor's placeholder, which it expands into
        # image tokens (Gemma 3's <start_of_image> into <image_soft_token>s; elsewhere the token itself)
        self.image_token = getattr(processor, "image_token", None) or \
            processor.tokenizer.convert_ids_to_tokens(image_token_id)
        # what an image in a raw prompt (TGI's ![](url)) becomes: the placeholder, inside the family's
        # vision span where it has one (Qwen-VL's <|vision_start|>...<|vision_end|>), as its template writes it
        # Idefics3's and SmolVLM's image tokens a tile (an image is tiles, its tokens among tile markers)
        self.per_tile = getattr(processor, "image_seq_len", None)
        self.markdown_image = self.image_token
        if span is not None:
            start, end = processor.tokenizer.convert_ids_to_tokens(list(span))
            self.markdown_image = start + self.image_token + end

    @classmethod
    def load(cls, model_dir: str, config) -> ImagePrompts:
        span = (config.vision_start_token_id, config.vision_end_token_id) \
            if getattr(config, "vision_start_token_id", None) is not None else None
        tiles_of = None
        if getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT: the model's own count of an image's tiles
            from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

            tiles_of = functools.partial(image_size_to_num_patches, grid_pinpoints=config.image_grid_pinpoints,
                                         patch_size=config.vision_config.image_size)
        from server.engine.multimodal import image_family

        return cls(load_processor(model_dir), config.image_token_id, span, tiles_of, image_family(config))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None)

    def prompt(self, text: str, images: list, special_tokens: bool = False) -> tuple[list[int], list]:
        """``text`` (one placeholder per image, in order) and ``images`` as token ids and ImageInputs;
        ``special_tokens``: the tokenizer's own (a raw TGI input's), else none (a rendered template's)."""
        import torch

        from server.engine.multimodal import image_key
        from server.engine.plan import ImageInput

        placeholders = text.count(self.image_token)
        if placeholders != len(images):
            raise MediaError(f"the prompt has {placeholders} image placeholders ({self.image_token}) for "
                             f"{len(images)} images", param="messages")
        if not images:
            return self.processor.tokenizer(text, add_special_tokens=special_tokens).input_ids, []
        try:  # the processor's own refusals (an aspect ratio it cannot resize, ...) are the image's fault
            out = self.processor(text=[text], images=[images] if self.tiled_alone else images, return_tensors="pt",
                                 add_special_tokens=special_tokens)
            counts = self._token_counts(images, out)
        except ValueError as e:
            raise MediaError(f"the model's processor refuses the image: {e}", param="messages") from e
        ids = out["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(counts):
            raise MediaError(f"the processor made {len(positions)} image tokens for {len(images)} images "
                             f"({sum(counts)} expected)", param="messages")
        pixels = out["pixel_values"].float().contiguous()
        key = next((k for k in IMAGE_GEOMETRY if k in out), None)
        grids = out[key].tolist() if key else [[] for _ in images]
        masks = out["pixel_attention_mask"].to(torch.uint8) if "pixel_attention_mask" in out else None
        if pixels.dim() == 2:  # patch rows, each image's t*h*w of them in turn (Qwen-VL)
            pixels = pixels.split([t * h * w for t, h, w in grids])
        elif self.per_tile is not None:  # one sample's tiles, every image's in turn (Idefics3, SmolVLM)
            pixels, masks = _per_image(pixels[0], masks[0] if masks is not None else None, self._tiles(images))
        elif self.tile_tokens is not None:  # every image's tiles in turn, one flat batch (InternVL)
            pixels = pixels.split([count // self.tile_tokens for count in counts])
        else:  # one entry an image (LLaVA-NeXT's: its tiles, less the request's padding)
            if self.tiled_alone and len(images) > 1:  # its whole alone (what the processor gives of it)
                pixels = [pixel[:1] for pixel in pixels]
            elif self.tiles_of is not None:
                pixels = [pixel[:self.tiles_of(grid)] for pixel, grid in zip(pixels, grids)]
            elif self.sized:  # its own size, less the request's padding
                pixels = [pixel[:, :height, :width] for pixel, (height, width) in zip(pixels, grids)]
            pixels = [pixel.unsqueeze(0) for pixel in pixels]
            masks = [mask.unsqueeze(0) for mask in masks] if masks is not None else None
        inputs, at = [], 0
        for i, (pixel, grid, count) in enumerate(zip(pixels, grids, counts)):
            data, shape = pixel.numpy().tobytes(), list(pixel.shape)
            start, last = positions[at], positions[at + count - 1]
            length = last + 1 - start if last + 1 - start != count else 0  # its tokens among others (tile markers)
            mask = masks[i].numpy().tobytes() if masks is not None else b""
            key = image_key(data + mask, [*shape, -1, *grid, -1, count])  # geometry too: a grid transposed differs
            inputs.append(ImageInput(key, start, count, shape, data, grid, length, mask))
            at += count
        return ids, inputs

    def _token_counts(self, images: list, out) -> list[int]:
        """Each image's image tokens, from the processor's own arithmetic."""
        if self.per_tile is not None:  # its tiles' (the processor's own count is the whole span, markers too)
            return [tiles * self.per_tile for tiles in self._tiles(images)]
        # LLaVA-OneVision's by its companions' number, which _get_num_multimodal_tokens does not know;
        # Pixtral's among the row markers that count counts
        if self.tiled_alone or self.sized:
            return [self.processor.replace_image_token(out, i).count(self.image_token) for i in range(len(images))]
        sizes = [[image.height, image.width] for image in images]
        counted = self.processor._get_num_multimodal_tokens(image_sizes=sizes)
        if self.tile_tokens is not None:  # its tiles' (the processor's count adds its <img> and </img>)
            return [tiles * self.tile_tokens for tiles in counted.num_image_patches]
        return counted.num_image_tokens

    def _tiles(self, images: list) -> list[int]:
        """Each image's tiles (Idefics3, SmolVLM: its split tiles, then the whole image)."""
        count = self.processor.image_processor.get_number_of_image_patches
        return [count(image.height, image.width)[0] for image in images]

    def check_text_only(self, ids: list[int], param: str) -> None:
        """A prompt without images must hold no image token (it would take an image's place)."""
        if self.image_token_id in ids:
            token = self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
            raise MediaError(f"the prompt holds the image placeholder token {token} but brings no image", param=param)
