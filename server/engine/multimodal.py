"""Images in an image-text model's prompt: each image encoded once, on the rank that holds its
sequence, its embeddings put in the rows of its placeholder tokens.

The API side turns a request's images into the processor's pixel values and the prompt's
placeholder tokens (``server.api.media``); each image travels to its rank as an
:class:`~server.engine.plan.ImageInput` with its sequence's ``SequenceAdd``, only where some of its
tokens lie beyond the sequence's cached prefix (after a preemption too: from the rank's embedding
cache where it still holds them, else the pixels come again and are encoded again). In the step they arrive (``StepPlan.encode``) every rank runs
:meth:`ImageEncoder.encode` over its new images at once, through transformers' own
``get_image_features`` of the model; where the encoder is sharded (``--mm-encoder shard``) a rank
with none encodes a blank image, so that the encoder's all-gathers match (its forward hooks do
more than gather: a shared-memory ring's fill and barrier, prefetches; running them without the
compute is not yet done), but only while some encoder unit gathers: with every unit resident
(the CPU default's shared copy) an encoder forward runs no collective, and an idle rank encodes
nothing. The features stay with
the sequence until its image's last token is computed; each forward passes the rows its chunks
need, in order, as transformers' ``mm_encoder_outputs`` (:meth:`ImageEncoder.outputs`), which the model
scatters into its placeholders' embeddings exactly as its own ``generate`` does with the pixels.
A chunk may end inside an image where the family attends over an image's tokens causally, as over
text (LLaVA, LLaVA-NeXT, Qwen-VL): splitting one changes nothing. Gemma 3 attends over an image's
tokens both ways (each sees the whole image, on top of the causal mask and within a sliding
layer's window): its scheduler never ends a chunk inside an image (``Scheduler.whole_images``), and
each prefill chunk's mask opens the spans of the images its queries lie in
(``PagedLayout.build``'s ``image_spans``). A prefix hit may still end inside an image: the cached
keys were computed over the same whole image.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL place an image's tokens in their 3-D rope by the image's patch grid
(temporal, height, width), and every later token one past the image's largest position, so that a
sequence's positions are not its token indices (:class:`GridRope`). Each such sequence brings every
image's span and grid (``SequenceAdd.image_grids``, cached images too); the rank computes its
prompt's positions once with the model's own ``get_rope_index`` and each later token's as its index
plus the prompt's offset (transformers' ``rope_deltas``). A step passes the model the 3-D positions
only where some row is an image's; otherwise the shifted 1-D positions, as its text tokens take.

The prefix cache keys an image's placeholders by the image's content (:func:`image_keyed_tokens`):
two prompts with the same text and image share blocks; another image never matches. Each rank
also keeps the embeddings it computed by the image's content (``RankEngine.image_cache``, host
memory), exactly as rank 0's :class:`ImageCacheBook` accounts for them: an image a rank holds
travels as ``cached`` (no pixels) and is not encoded again, whatever text precedes it.

Contract: :data:`IMAGE_FAMILIES` the families served with images and what each needs
(``server.engine.capability`` refuses the other image-text families); :func:`takes_images` whether a
loaded model does; nothing here knows HTTP or the processor.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect

import torch
from torch import nn

from server.engine.plan import ImageInput

@dataclasses.dataclass(frozen=True)
class ImageFamily:
    """What the engine does differently for an image-text family."""

    bidirectional: bool = False  # its attention over an image's tokens goes both ways: a chunk holds an image whole
    tensor_features: bool = False  # its forward takes mm_encoder_outputs' features as one tensor, not a list
    tiles: bool = False  # an image is tiles [1, tiles, C, H, W] with a pixel mask, its tokens among tile markers
    # an image alone in its prompt is its whole and its tiles; among others, its whole alone (LLaVA-OneVision)
    tiled_alone: bool = False
    # an image is tiles [tiles, C, H, W], every image's concatenated by the processor, its tokens the
    # processor's image_seq_length a tile (InternVL)
    flat_tiles: bool = False
    # an image is its pixels [1, C, H, W] at its own size (Pixtral's tower: H and W multiples of its
    # patch), its geometry that size, its tokens its rows of patches among row markers ([IMG_BREAK])
    sized: bool = False


IMAGE_FAMILIES = {
    "llava": ImageFamily(),  # (with a Pixtral tower, Pixtral-12B: PIXTRAL_TOWER)
    "mistral3": ImageFamily(sized=True),
    "llava_next": ImageFamily(),
    "llava_onevision": ImageFamily(tiled_alone=True),
    "internvl": ImageFamily(tensor_features=True, flat_tiles=True),
    "qwen2_vl": ImageFamily(),
    "qwen2_5_vl": ImageFamily(),
    "qwen3_vl": ImageFamily(),
    "qwen3_5": ImageFamily(),  # (its text layers carry state: server.engine.state)
    "qwen3_5_moe": ImageFamily(),
    "gemma3": ImageFamily(bidirectional=True, tensor_features=True),
    "idefics3": ImageFamily(tiles=True),
    "smolvlm": ImageFamily(tiles=True),
}
"""Image-text families whose image tokens the engine computes exactly (``model_type``): their tokens
one run an image, or tiles' runs among tile markers (Idefics3, SmolVLM); their attention over an
image's tokens causal (LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Qwen-VL, Idefics3, SmolVLM) or
both ways (Gemma 3); their rope one position per token or placed by the image's grid (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL: :class:`GridRope`); an image's tiles its own (LLaVA-NeXT) or, in LLaVA-OneVision, only
where it is alone in its prompt (its tokens depend on its companions' number: an image among others
is its whole image's features and a newline, so its key and its cached embeddings differ)."""

SERVED_IMAGE_TEXT_MODEL_TYPES = frozenset(IMAGE_FAMILIES)

PIXTRAL_TOWER = ImageFamily(sized=True)
"""What any served family with a Pixtral vision tower is (a LLaVA's: Pixtral-12B; Mistral 3's)."""


def image_family(config) -> ImageFamily | None:
    """The family of a model's ``config`` served with images, or None."""
    family = IMAGE_FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and getattr(getattr(config, "vision_config", None), "model_type", None) == "pixtral":
        return PIXTRAL_TOWER
    return family


GEOMETRY_ARGUMENTS = ("image_grid_thw", "image_sizes")
"""``get_image_features``' argument for the images' geometry (``ImageInput.grid``), where it takes one."""


def image_key(pixels: bytes, shape: list[int]) -> bytes:
    """An image's content key: 16-byte BLAKE2b of its pixel values as the model takes them, and their shape."""
    digest = hashlib.blake2b(digest_size=16, person=b"hsdp-image")
    digest.update(repr(list(shape)).encode())
    digest.update(pixels)
    return digest.digest()


def image_keyed_tokens(prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
    """``prompt_ids`` with each image's placeholders replaced by an id of its content key (negative:
    no token's), for the prefix cache's keys."""
    keyed = list(prompt_ids)
    for image in images:
        pseudo = -1 - int.from_bytes(image.key[:7], "little")
        token = prompt_ids[image.start]
        for i in range(image.start, image.end):
            if prompt_ids[i] == token:  # its tokens, not the text between them (Idefics3's tile markers)
                keyed[i] = pseudo
    return keyed


def _base(model: nn.Module) -> nn.Module:
    """The module with transformers' ``get_image_features`` (a ``*ForConditionalGeneration``'s ``model``)."""
    for holder in (getattr(model, "model", None), model):
        if holder is not None and callable(getattr(holder, "get_image_features", None)):
            return holder
    raise ValueError(f"{type(model).__name__} has no get_image_features: it takes no images")


def takes_images(model: nn.Module) -> bool:
    """Whether ``model`` is an image-text model of a family served with images."""
    if getattr(model.config, "model_type", None) not in SERVED_IMAGE_TEXT_MODEL_TYPES:
        return False
    try:
        _base(model)
    except ValueError:
        return False
    return True


class ImageEncoder:
    """A rank's image encoder: features of the images its sequences bring, one call per step."""

    def __init__(self, model: nn.Module, device: torch.device):
        from shard_engine.units import encoder_module_names, is_unit

        self.model, self.device = model, device
        self.base = _base(model)
        self.sharded = any(is_unit(m) for name in encoder_module_names(model)
                           for m in model.get_submodule(name).modules())
        parameters = inspect.signature(self.base.get_image_features).parameters
        self.geometry = next((name for name in GEOMETRY_ARGUMENTS if name in parameters), None)
        self.family = image_family(model.config)
        self.blank, self.blank_grid = _blank_image(model.config, device, self.family)
        self.blank_mask = torch.ones(self.blank.shape[:2] + self.blank.shape[3:], dtype=torch.bool, device=device) \
            if self.family.tiles else None
        self.output_class = None  # what get_image_features returns (BaseModelOutputWithPooling or a subclass)
        self._settled = False
        self._gathers_as_of: tuple[int, bool] | None = None  # (residency changes, encoder gathers) (_gathers)

    @torch.no_grad()
    def encode(self, images: list[ImageInput], threads: int = 0) -> list[torch.Tensor]:
        """Each image's embeddings [1 + deepstack layers, its tokens, hidden], in order: what goes in
        its placeholders' rows, then what the family adds to them in its first decoder layers (Qwen3-VL's
        deepstack; none elsewhere). Every rank calls it in a step whose plan says ``encode``, with its
        own new images or none. An image's rows may not number its placeholders (a processor at odds
        with its model): the caller checks."""
        if not self._settled:
            self._settle()
        if not images:
            if self.sharded and self._gathers():  # the other ranks' encoder units gather: match them
                self._features(self.blank, [self.blank_grid] if self.blank_grid else [], None, self.blank_mask)
            return []
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # the idle ranks' cores, as the step's forward (server.engine.cores)
        if self.family.tiled_alone:
            return self._tiled_alone(images)
        if self.family.sized and sum(image.count for image in images) < 2:
            # Mistral 3's get_image_features squeezes a batch of one token into none: the blank beside it
            pixels = _stack([pixel_tensor(image).to(self.device) for image in images] + [self.blank])
            return self._features(pixels, [image.grid for image in images] + [self.blank_grid], None)[:len(images)]
        pixels = _stack([pixel_tensor(image) for image in images]).to(self.device)
        masks = _stack([mask_tensor(image) for image in images], tile_dim=1).to(self.device) \
            if self.family.tiles else None
        return self._features(pixels, [image.grid for image in images if image.grid],
                              [image.count for image in images], masks)

    def _tiled_alone(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """LLaVA-OneVision's images in one call: its ``get_image_features`` tiles the images of a
        sample of one image and takes the whole of each image of a sample of several
        (``batch_num_images``). The images alone in their prompts (more than their whole: its tiles,
        as ``server.api.media`` keeps them) go first, one sample each; then the others as one sample
        (its tokens do not depend on which images share it), with the one such image twice where it
        is the only one (a sample of one would be tiled)."""
        alone = [i for i, image in enumerate(images) if image.shape[1] > 1]
        among = [i for i, image in enumerate(images) if image.shape[1] == 1]
        order = alone + among + among[:1] * (len(among) == 1)
        samples = [1] * len(alone) + [len(order) - len(alone)] * bool(among)
        pixels = _stack([pixel_tensor(images[i]) for i in order]).to(self.device)
        rows = self._features(pixels, [images[i].grid for i in order], [images[i].count for i in order],
                              samples=samples)
        placed = dict(zip(order[:len(images)], rows))  # the repeated image's second rows dropped
        return [placed[i] for i in range(len(images))]

    def _features(self, pixels: torch.Tensor, grids: list[list[int]], counts: list[int] | None,
                  masks: torch.Tensor | None = None, samples: list[int] | None = None) -> list[torch.Tensor]:
        extra = {self.geometry: torch.tensor(grids, device=self.device)} if grids else {}
        if masks is not None:
            extra["pixel_attention_mask"] = masks
        if samples is not None:
            extra["batch_num_images"] = torch.tensor(samples, device=self.device)
        out = self.base.get_image_features(pixel_values=pixels, return_dict=True, **extra)
        if self.output_class is None:
            self.output_class = type(out)
        deepstack = getattr(out, "deepstack_features", None) or []
        main = out.pooler_output
        if isinstance(main, torch.Tensor) and counts is not None:  # LLaVA-NeXT's: every image's rows, packed
            main = main.reshape(-1, main.shape[-1])
            # rows that do not add up to the placeholders: every image gets none (its sequence fails)
            main = main.split(counts) if main.shape[0] == sum(counts) else [main[:0]] * len(counts)
        main = [rows.reshape(-1, rows.shape[-1]) for rows in main]
        return [torch.stack([rows, *(layer[i].reshape(rows.shape) for layer in deepstack)]) for i, rows in enumerate(main)]

    def outputs(self, rows: list[torch.Tensor]):
        """``mm_encoder_outputs`` for a forward whose packed row holds these image rows ([1 + deepstack
        layers, count, hidden] each), in order: the family's own output class."""
        rows = torch.cat(rows, dim=1)
        fields = {"pooler_output": rows[0] if self.family.tensor_features else [rows[0]]}
        if rows.shape[0] > 1:
            fields["deepstack_features"] = [[layer] for layer in rows[1:]]
        return {"image": self.output_class(**fields)}

    def _gathers(self) -> bool:
        """Whether an encoder forward runs collectives now (some encoder unit not resident), looked
        at again only after residency changed (``shard_engine.set_resident_units``)."""
        from shard_engine.direct import gathers_in
        from shard_engine.overlap import residency_changes

        changes = residency_changes(self.model)
        if self._gathers_as_of is None or self._gathers_as_of[0] != changes:
            from shard_engine.units import encoder_module_names

            gathers = any(gathers_in(self.model.get_submodule(name)) for name in encoder_module_names(self.model))
            self._gathers_as_of = (changes, gathers)
        return self._gathers_as_of[1]

    def _settle(self) -> None:
        # the encoder's units are called outside the root's forward: the root must be the root first
        from shard_engine.units import settle_root

        settle_root(self.model)
        self._settled = True


def _blank_image(config, device: torch.device, family: ImageFamily) -> tuple[torch.Tensor, list[int]]:
    """The smallest image the encoder takes (zeros) and its geometry: a square of ``image_size``
    (CLIP), its tiles with its size (LLaVA-NeXT), one tile of ones (Idefics3: all-zero tiles are
    padding it drops), or one merged patch's worth of patch rows (Qwen-VL: grid [1, merge, merge]),
    or two merged patches' of pixels side by side (Pixtral: its size; Mistral 3's ``get_image_features``
    squeezes the rows of a batch of one token into none)."""
    vision = config.vision_config
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", 3)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is not None and getattr(vision, "temporal_patch_size", None) is not None:
        patch = channels * vision.temporal_patch_size * vision.patch_size ** 2
        return torch.zeros(merge * merge, patch, device=device), [1, merge, merge]
    if family.sized:
        side = vision.patch_size * getattr(config, "spatial_merge_size", 1)
        return torch.zeros(1, channels, side, 2 * side, device=device), [side, 2 * side]
    size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
    if family.tiles:
        return torch.ones(1, 1, channels, size, size, device=device), []
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if pinpoints:
        from transformers.image_processing_utils import select_best_resolution

        height, width = select_best_resolution((size, size), pinpoints)
        tiles = 1 + (height // size) * (width // size)  # the whole image, then its tiles
        return torch.zeros(1, tiles, channels, size, size, device=device), [size, size]
    return torch.zeros(1, channels, size, size, device=device), []


def _stack(pixels: list[torch.Tensor], tile_dim: int | None = None) -> torch.Tensor:
    """Images' pixel values (or masks: ``tile_dim`` 1) in one batch along dim 0, each zero-padded to
    the most tiles among them (LLaVA-NeXT's encoder drops each image's padding tiles by its size,
    Idefics3's the all-zero ones), or images of their own sizes [1, C, H, W] to the largest height
    and width among them (Pixtral's encoder drops each image's padding patches by its size, as its
    processor pads a request's images)."""
    if (tile_dim is not None or pixels[0].dim() == 5) and len({p.shape[1] for p in pixels}) > 1:
        most = max(p.shape[1] for p in pixels)
        pixels = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, most - p.shape[1])) for p in pixels]
    elif pixels[0].dim() == 4 and len({p.shape[2:] for p in pixels}) > 1:
        height, width = max(p.shape[2] for p in pixels), max(p.shape[3] for p in pixels)
        pixels = [torch.nn.functional.pad(p, (0, width - p.shape[3], 0, height - p.shape[2])) for p in pixels]
    return torch.cat(pixels)


class GridRope:
    """A rope that places image tokens by their grid (Qwen-VL's M-RoPE): each sequence's prompt
    positions [3, its tokens] from the model's own ``get_rope_index``, and the offset (transformers'
    ``rope_deltas``) every later token's position adds to its index."""

    def __init__(self, model: nn.Module):
        self.base = _base(model)

    @staticmethod
    def applies(model: nn.Module) -> bool:
        try:
            return callable(getattr(_base(model), "get_rope_index", None))
        except ValueError:
            return False

    @torch.no_grad()
    def positions(self, tokens: list[int], image_grids: list[list[int]]) -> tuple[torch.Tensor, int]:
        """([3, len(tokens)] positions, offset) of a sequence whose images are ``image_grids``
        ([start, count, t, h, w] each, in order)."""
        ids = torch.tensor([tokens])
        types = torch.zeros_like(ids, dtype=torch.int)
        for start, count, *_ in image_grids:
            types[0, start:start + count] = 1
        grids = torch.tensor([grid for _, _, *grid in image_grids])
        positions, delta = self.base.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids)
        return positions[:, 0], int(delta.reshape(-1)[0])


def placeholder_ids(config) -> list[int]:
    """The token ids that stand for an image's rows in a prompt: never generated, since the model
    takes every one in a step's ``input_ids`` for a row of the step's images (transformers'
    ``get_placeholder_mask`` counts them)."""
    ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index")}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def mask_tensor(image: ImageInput) -> torch.Tensor:
    """An :class:`ImageInput`'s pixel attention mask: bool of its shape without the channels."""
    shape = image.shape[:2] + image.shape[3:]
    return torch.frombuffer(bytearray(image.mask), dtype=torch.uint8).reshape(shape).bool()


class ImageCacheBook:
    """Rank 0's account of each rank's image cache: which images' embeddings it holds, least
    recently used first, within ``capacity`` embedding rows a rank (``--mm-embedding-cache`` over
    a row's bytes). The scheduler decides from it whether an image travels with its pixels or as
    ``cached``, and tells each rank what to let go (``StepPlan.forget_images``): the ranks keep
    exactly what it says, so the two never disagree."""

    def __init__(self, ranks: int, capacity: int):
        self.capacity = capacity
        self._held = [collections.OrderedDict() for _ in range(ranks)]  # key -> rows, least recent first
        self._rows = [0] * ranks

    def take(self, rank: int, image: ImageInput, forget: list[bytes]) -> ImageInput:
        """``image`` as it travels to ``rank``: ``cached`` (no pixels) where the rank holds it; else
        with its pixels, and held from now on, the least recently used let go (added to ``forget``)."""
        held = self._held[rank]
        if image.key in held:
            held.move_to_end(image.key)
            return dataclasses.replace(image, pixels=b"", mask=b"", cached=True)
        if image.count > self.capacity:  # larger than the whole cache: not held, and the rest kept
            forget.append(image.key)
            return image
        while forget and image.key in forget:  # let go earlier in this step, held again: the rank keeps it
            forget.remove(image.key)
        held[image.key] = image.count
        self._rows[rank] += image.count
        while self._rows[rank] > self.capacity:
            key, rows = held.popitem(last=False)
            self._rows[rank] -= rows
            forget.append(key)
        return image

    def held(self, rank: int, images: list[ImageInput]) -> int:
        """Embedding rows of ``images`` that ``rank`` holds (where to place their sequence)."""
        return sum(image.count for image in images if image.key in self._held[rank])

    def clear(self, forget: dict[int, list[bytes]] | None = None) -> None:
        """Every rank's cache is dropped: new weights (their embeddings were the old weights'; the
        ranks drop theirs as they update), or a pause clearing caches, whose ranks are told in
        ``forget`` (a plan's ``forget_images``)."""
        for rank, held in enumerate(self._held):
            if forget is not None and held:
                forget.setdefault(rank, []).extend(held)
            held.clear()
        self._rows = [0] * len(self._rows)


def embedding_row_bytes(config, dtype: torch.dtype) -> int:
    """Host bytes of one image token's embeddings in the served ``dtype``: its hidden size, and
    Qwen3-VL's deepstack layers too."""
    layers = 1 + len(getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None) or ())
    return layers * config.get_text_config().hidden_size * torch.empty((), dtype=dtype).element_size()


def pixel_tensor(image: ImageInput) -> torch.Tensor:
    """An :class:`ImageInput`'s pixel values as a float32 tensor of its shape."""
    return torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).reshape(image.shape)
