"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, ...) over a paged cache of latents.

transformers' MLA modules compute each token's compressed latent ``c`` (``kv_lora_rank`` values,
normed) and its rope key ``k_rot`` (``qk_rope_head_dim``), pass the two through the cache, and
then expand the whole cached context through ``kv_b_proj`` into every head's keys and values
(``expand_kv``), in every layer at every step. The engine caches only ``[c, k_rot]``: one
"head" of ``kv_lora_rank + qk_rope_head_dim`` values a token a layer (576 for DeepSeek-V3,
against 128 heads x (192 + 128) expanded), the values a view of its first ``kv_lora_rank``
(:class:`server.engine.attention.PagedKVCache` with ``values_in_keys``). Attention runs in the
absorbed form (DeepSeek's, FlashMLA's, vLLM's): with ``W_UK`` and ``W_UV`` each head's slices of
``kv_b_proj``, a head's query ``[q_nope W_UK, q_rot]`` attends over ``[c, k_rot]`` as one key
head (multi-query attention), its output over the values ``c`` is multiplied by ``W_UV``, and
``o_proj`` follows as in the module. That is transformers' product reassociated, ``q (W c) =
(q W) c``, with every other step (the projections, the norms, the rope) the module's own code:
equal to it up to float rounding, not bit for bit.

Prompt chunks attend in whichever form costs them fewer multiply-adds (:meth:`Absorbed.expands`):
a long chunk expanded, as transformers computes it and as vLLM and SGLang prefill (its context's
latents through the module's own ``expand_kv``, then attention over every head's keys of nope +
rope and values of v: a third of the absorbed form's for DeepSeek-V3), a chunk of a few queries
over a long context absorbed; decodes always absorbed (``attention.paged_attention``).

Contract. :func:`install` sets, on each MLA module of a model (one with ``expand_kv`` and
``kv_b_proj``), ``expand_kv`` to :func:`_latent_key_value` (this step's ``[c, k_rot]`` and ``c``,
or the cache's pools unchanged) and ``hsdp_mla`` to an :class:`Absorbed`, which the engine's
attention function applies around its own (``attention.paged_attention``). :func:`latent_geometry`
gives the cache's shape for such a model.
"""

from __future__ import annotations

import torch
from torch import nn


def is_mla(config) -> bool:
    """Whether ``config``'s model attends through cached latents."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "kv_lora_rank", None))


def latent_geometry(config) -> tuple[int, int]:
    """(key dim, value dim) of one cached token of an MLA layer: ``kv_lora_rank + qk_rope_head_dim``,
    ``kv_lora_rank`` (the values are the keys' first ``kv_lora_rank``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.kv_lora_rank + text.qk_rope_head_dim, text.kv_lora_rank


def has_mla_modules(model_class) -> bool:
    """Whether ``model_class``'s modeling file has an attention whose latents this engine caches
    (an ``expand_kv`` method: transformers' MLA modules since 5.x)."""
    import sys

    module = sys.modules.get(model_class.__module__)
    return module is not None and any(isinstance(obj, type) and issubclass(obj, nn.Module) and hasattr(obj, "expand_kv")
                                      for obj in vars(module).values())


def install(model: nn.Module) -> int:
    """Give every MLA module of ``model`` the latent cache's ``expand_kv`` and its :class:`Absorbed`;
    returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(type(module), "expand_kv") and hasattr(module, "kv_b_proj"):
            module.expand_kv = _latent_key_value
            module.hsdp_mla = Absorbed(module)
            count += 1
    return count


def _latent_key_value(latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's ``expand_kv`` here: this step's ``[c, k_rot]`` keys and ``c`` values ([1, 1, T, d]),
    or, where the cache already wrote them and returned its pools ([1 head, slots, d]), those."""
    if latent.dim() == 3:
        return latent, k_rot
    return torch.cat((latent, k_rot), dim=-1), latent


class Absorbed:
    """One MLA module's up-projections, applied around the engine's attention (the module docstring)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.heads = module.num_heads
        self.nope, self.rope, self.v = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
        self.rank = module.kv_lora_rank

    def expands(self, queries: int, context: int) -> bool:
        """Whether a prompt chunk of ``queries`` tokens over ``context`` cached tokens takes fewer
        multiply-adds a head expanded (``context`` latents through ``kv_b_proj``, then attention over
        keys of nope + rope and values of v) than absorbed (the queries and outputs through its slices,
        attention over keys of kv_lora_rank + rope and values of kv_lora_rank). A chunk whose queries
        are its whole context always does where 2 x kv_lora_rank > nope + v (DeepSeek-V3: 1024 > 256);
        a decode (one query over a long context) never does."""
        expanded = context * self.rank * (self.nope + self.v) + queries * context * (self.nope + self.rope + self.v)
        absorbed = queries * self.rank * (self.nope + self.v) + queries * context * (2 * self.rank + self.rope)
        return expanded < absorbed

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``[c, k_rot]`` [1, L, kv_lora_rank + rope] -> every head's keys [H, L, nope + rope]
        and values [H, L, v], by the module's own ``expand_kv`` (its ``kv_b_proj``, quantized or not)."""
        c, k_rot = torch.split(latents[None], [self.rank, self.rope], dim=-1)  # [1, 1, L, .]
        keys, values = type(self.module).expand_kv(self.module, c, k_rot)
        return keys[0], values[0]

    def up_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``kv_b_proj``'s weight [heads, nope + v, kv_lora_rank] (dequantized where it is stored quantized)."""
        proj = self.module.kv_b_proj
        weight = proj.dequantized_weight(dtype).to(dtype) if hasattr(proj, "dequantized_weight") else proj.weight
        return weight.view(self.heads, self.nope + self.v, self.rank)

    def query(self, query: torch.Tensor, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, H, T, nope + rope] -> ([1, H, T, kv_lora_rank + rope], the weight for :meth:`output`)."""
        if weight is None:
            weight = self.up_weight(query.dtype)
        q_nope, q_rot = torch.split(query, [self.nope, self.rope], dim=-1)
        absorbed = torch.einsum("bhtn,hnc->bhtc", q_nope, weight[:, :self.nope])
        return torch.cat((absorbed, q_rot), dim=-1), weight

    def output(self, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The attention's output over the latents [1, T, H, kv_lora_rank] -> each head's values [1, T, H, v]."""
        return torch.einsum("bthc,hvc->bthv", out, weight[:, self.nope:])
