"""Build a model's skeleton: parameters on the meta device, buffers real.

Non-persistent buffers (rotary ``inv_freq``, causal masks) are computed in ``__init__`` and are
not in the checkpoint, so they must be built for real; parameters are the checkpoint's job and
cost nothing on meta.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and type(param) is nn.Parameter:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def image_text_only(config) -> bool:
    """Whether transformers builds ``config``'s model as image-text-to-text only, with no causal-LM
    class (Llava, Qwen2-VL, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


IMAGE_TEXT_WITH_A_TEXT_CLASS = frozenset({"qwen3_5", "qwen3_5_moe"})
"""Image-text families whose config transformers also maps to a text-only causal LM ("VLM
compatibility"), built image-text here: their images are served (``server.engine.multimodal``)."""


def builds_image_text(config) -> bool:
    """Whether the loader builds ``config``'s model with its vision encoder: an :func:`image_text_only`
    model, or one of :data:`IMAGE_TEXT_WITH_A_TEXT_CLASS` whose config has a vision tower."""
    return image_text_only(config) or (getattr(config, "model_type", None) in IMAGE_TEXT_WITH_A_TEXT_CLASS
                                       and getattr(config, "vision_config", None) is not None)


def auto_model_class(config):
    """The Auto class that builds ``config``'s model: ``AutoModelForCausalLM``, or for a model
    :func:`builds_image_text` ``AutoModelForImageTextToText``, which keeps its vision encoder."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if builds_image_text(config) else AutoModelForCausalLM


def build_skeleton(config, model_class, dtype: torch.dtype) -> nn.Module:
    """Instantiate ``model_class`` for ``config`` with meta parameters and real buffers."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), _parameters_on_meta():
        if hasattr(model_class, "_model_mapping"):  # an Auto* class
            model = model_class.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    model.tie_weights()
    return model


@dataclass
class ModelLayout:
    """What the model expects from a checkpoint."""

    expected: dict[str, torch.Tensor]  # name -> meta parameter or persistent buffer
    aliases: dict[str, str]  # tied name -> canonical name (e.g. lm_head.weight -> embed weight)
    ignore_unexpected: list[re.Pattern]


def describe_layout(model: nn.Module) -> ModelLayout:
    expected: dict[str, torch.Tensor] = dict(model.named_parameters())
    canonical = {id(p): n for n, p in expected.items()}
    aliases = {
        name: canonical[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if name not in expected
    }
    persistent = set(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        if name in persistent:
            expected[name] = buf
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    # As from_pretrained (_adjust_missing_and_unexpected_keys): older checkpoints carry buffers that
    # are no longer persistent, a per-layer rotary_emb.inv_freq and position_ids; skipped where the
    # model still has such a buffer (not saved), an error elsewhere.
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.append(re.compile(r"rotary_emb\.inv_freq"))
    if any(name.endswith("position_ids") for name in buffers):
        patterns.append(re.compile(r"(^|\.)position_ids$"))
    return ModelLayout(expected, aliases, patterns)


def match_key_prefix(model: nn.Module, checkpoint_keys: set[str], expected: set[str]) -> tuple[str, str]:
    """How checkpoint keys map onto model keys: ``(strip, add)`` prefixes.

    A checkpoint saved from ``BertForMaskedLM`` holds ``bert.*`` keys that a ``BertModel``
    expects without the prefix, and the reverse; pick the mapping that matches the most keys.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    options = [("", "")]
    if prefix:
        options += [(prefix + ".", ""), ("", prefix + ".")]

    def score(option: tuple[str, str]) -> int:
        strip, add = option
        return sum(
            1 for k in checkpoint_keys if k.startswith(strip) and add + k[len(strip):] in expected
        )

    return max(options, key=score)
