"""What the paged engine can serve exactly, decided from the config before any weight is read.

The engine computes attention itself, per sequence, over its paged cache (``attention.py``), and
packs the tokens of many sequences into one row. A model is served only if both hold for it:

* its attention goes through transformers' attention interface (``_supports_attention_backend``),
  where the engine's function is plugged in, or through an adapter of ``server.engine.adapters``
  (Bloom, MPT: ALiBi built inside the module; Falcon's rope and ALiBi layouts); other models with their own
  attention code would bypass the cache;
* nothing in a sequence's computation depends on the others packed beside it: recurrent and
  convolution state is kept per sequence (``server.engine.state``) for the stateful families
  tested with it (``SERVED_STATEFUL_MODEL_TYPES``: LFM2, Qwen3-Next, Qwen3.5, Mamba2, ...), the
  others are refused; rope factors that
  transformers takes from the longest position in the batch (dynamic NTK, longrope) are chosen
  per sequence (``server.engine.rope``), except where a model has one rope per layer type;

and the engine's cache holds what its attention keeps (multi-head latent attention: its latents,
``server.engine.mla``).

:func:`check_servable` raises :class:`UnsupportedModelError` naming the architecture and the
reason; the server calls it before loading, so the refusal is one line and nothing is read.
"""

from __future__ import annotations

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
"""``layer_types`` entries the engine computes (full causal, or within a sliding window)."""

STATEFUL_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
    "lfm2", "lfm2_moe", "lfm3", "recurrent_gemma", "rwkv", "qwen3_next", "nemotron_h", "minimax", "xlstm",
    "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "bailing_hybrid", "lara_mini", "zaya", "glm5_next_text",
})
"""Families whose layers carry recurrent or convolution state (state-space models and hybrids)."""

LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class UnsupportedModelError(ValueError):
    """The engine cannot serve this model exactly; raised before anything is loaded."""

    def __init__(self, architecture: str, reason: str):
        self.architecture, self.reason = architecture, reason
        super().__init__(f"{architecture} is not served: {reason}")


def check_servable(config, model_class=None) -> None:
    """Raise :class:`UnsupportedModelError` where the engine cannot serve ``config``'s model exactly.

    ``model_class``: the causal-LM class transformers maps the config to (looked up when None)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    architecture = _architecture(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(architecture, "encoder-decoder models are not decoder-only")
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    from server.engine.state import HYBRID_LAYER_TYPES, MIXERLESS_LAYER_TYPES, SERVED_STATEFUL_MODEL_TYPES, \
        STATEFUL_LAYER_TYPES

    stateful = model_type in SERVED_STATEFUL_MODEL_TYPES
    if model_type in STATEFUL_MODEL_TYPES and not stateful:
        raise UnsupportedModelError(
            architecture, "its layers carry recurrent or convolution state between tokens, which the engine keeps per "
            f"sequence only for the families tested with it ({', '.join(sorted(SERVED_STATEFUL_MODEL_TYPES))})")
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    computed = ATTENTION_LAYER_TYPES | (STATEFUL_LAYER_TYPES | HYBRID_LAYER_TYPES | MIXERLESS_LAYER_TYPES
                                        if stateful else frozenset())
    if other := sorted(set(layer_types) - computed):
        raise UnsupportedModelError(
            architecture, f"layer types {other} are not computed by the engine (it computes full and sliding-window "
            "attention; recurrent, convolution and chunked layers are not kept per sequence)")
    if model_class is None:
        model_class = _causal_lm_class(config, architecture)
    from loaders.skeleton import builds_image_text
    from server.engine.multimodal import SERVED_IMAGE_TEXT_MODEL_TYPES

    takes_images = builds_image_text(config)
    if takes_images and config.model_type not in SERVED_IMAGE_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(
            architecture, "its images are not computed by the engine: the image-text families served are "
            f"{', '.join(sorted(SERVED_IMAGE_TEXT_MODEL_TYPES))} (video is not yet)")
    if getattr(text, "kv_lora_rank", None):
        from server.engine.mla import has_mla_modules

        if not has_mla_modules(model_class):
            raise UnsupportedModelError(
                architecture, "its multi-head latent attention has no expand_kv (transformers' MLA modules have one), "
                "so the engine cannot cache its latents")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    per_layer_type = isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) and rope
    for params in (rope.values() if per_layer_type else [rope]):
        rope_type = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
        if per_layer_type and rope_type in LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModelError(
                architecture, f"rope_type {rope_type!r} for one layer type of several takes its factors from the "
                "longest position in the batch; the engine chooses them per sequence only for a model's one rope")
    from server.engine.adapters import ADAPTED_MODEL_TYPES

    # (the served stateful families' attention layers call the interface, unflagged: Qwen3-Next; Mamba2 has none)
    if not getattr(model_class, "_supports_attention_backend", False) and model_type not in ADAPTED_MODEL_TYPES \
            and not stateful:
        raise UnsupportedModelError(
            architecture, "its attention does not go through transformers' attention interface (it computes its own, "
            "e.g. with ALiBi), so the engine's paged attention cannot be plugged in")


def _architecture(config) -> str:
    """The name users know the model by: config.json's architectures, else the causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "architectures", None):
        return config.architectures[0]
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    except KeyError:
        return type(config).__name__.removesuffix("Config")


def _causal_lm_class(config, architecture: str):
    """The class the loader builds for ``config`` (``loaders.skeleton.auto_model_class``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        try:
            return mapping[type(config)]
        except KeyError:
            pass
    if getattr(config, "auto_map", None):
        raise UnsupportedModelError(architecture, "it needs remote code (auto_map), which the server does not run")
    raise UnsupportedModelError(architecture, f"AutoModelForCausalLM has no class for {type(config).__name__}")
