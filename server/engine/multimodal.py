"""Images in an image-text model's prompt: each image encoded once, on the rank that holds its
sequence, its embeddings put in the rows of its placeholder tokens.

The API side turns a request's images into the processor's pixel values and the prompt's
placeholder tokens (``server.api.media``); each image travels to its rank as an
:class:`~server.engine.plan.ImageInput` with its sequence's ``SequenceAdd``, only where some of its
tokens lie beyond the sequence's cached prefix (after a preemption too: the pixels come again and
are encoded again). In the step they arrive (``StepPlan.encode``) every rank runs
:meth:`ImageEncoder.encode` over its new images at once, through transformers' own
``get_image_features`` of the model; where the encoder is sharded (``--mm-encoder shard``) a rank
with none encodes a blank image, so that the encoder's all-gathers match (its forward hooks do
more than gather: a shared-memory ring's fill and barrier, prefetches; running them without the
compute is not yet done). The features stay with
the sequence until its image's last token is computed; each forward passes the rows its chunks
need, in order, as transformers' ``mm_encoder_outputs`` (:func:`encoder_outputs`), which the model
scatters into its placeholders' embeddings exactly as its own ``generate`` does with the pixels.
A chunk may end inside an image: the served families attend over an image's tokens causally, as
over text, so splitting one changes nothing.

The prefix cache keys an image's placeholders by the image's content (:func:`image_keyed_tokens`):
two prompts with the same text and image share blocks; another image never matches.

Contract: :data:`SERVED_IMAGE_TEXT_MODEL_TYPES` the families served with images
(``server.engine.capability`` refuses the other image-text families); :func:`takes_images` whether a
loaded model does; nothing here knows HTTP or the processor.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from server.engine.plan import ImageInput

SERVED_IMAGE_TEXT_MODEL_TYPES = frozenset({"llava"})
"""Image-text families whose image tokens the engine computes exactly (``model_type``): their
attention over an image's tokens is causal, and their rope one position per token."""


def image_key(pixels: bytes) -> bytes:
    """An image's content key: 16-byte BLAKE2b of its pixel values as the model takes them."""
    return hashlib.blake2b(pixels, digest_size=16, person=b"hsdp-image").digest()


def image_keyed_tokens(prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
    """``prompt_ids`` with each image's placeholders replaced by an id of its content key (negative:
    no token's), for the prefix cache's keys."""
    keyed = list(prompt_ids)
    for image in images:
        pseudo = -1 - int.from_bytes(image.key[:7], "little")
        keyed[image.start:image.start + image.count] = [pseudo] * image.count
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
        vision = model.config.vision_config
        size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
        self.blank_shape = (1, getattr(vision, "num_channels", 3), size, size)
        self._settled = False

    @torch.no_grad()
    def encode(self, images: list[ImageInput], threads: int = 0) -> list[torch.Tensor]:
        """Each image's embeddings [its tokens, hidden], in order. Every rank calls it in a step whose
        plan says ``encode``, with its own new images or none."""
        if not self._settled:
            self._settle()
        if not images:
            if self.sharded:  # the other ranks' encoder units gather: match them
                self._features(torch.zeros(self.blank_shape, device=self.device))
            return []
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # the idle ranks' cores, as the step's forward (server.engine.cores)
        pixels = torch.cat([pixel_tensor(image) for image in images]).to(self.device)
        features = self._features(pixels)
        for image, rows in zip(images, features):
            if rows.shape[0] != image.count:
                raise ValueError(f"an image encoded to {rows.shape[0]} embeddings for {image.count} placeholders")
        return features

    def _features(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        out = self.base.get_image_features(pixel_values=pixels, return_dict=True)
        return [rows.reshape(-1, rows.shape[-1]) for rows in out.pooler_output]

    def _settle(self) -> None:
        # the encoder's units are called outside the root's forward: the root must be the root first
        from shard_engine.units import settle_root

        settle_root(self.model)
        self._settled = True


def pixel_tensor(image: ImageInput) -> torch.Tensor:
    """An :class:`ImageInput`'s pixel values as a float32 tensor of its shape."""
    return torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).reshape(image.shape)


def encoder_outputs(rows: list[torch.Tensor]):
    """``mm_encoder_outputs`` for a forward whose packed row holds these image rows, in order."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"image": BaseModelOutputWithPooling(pooler_output=[torch.cat(rows)])}
