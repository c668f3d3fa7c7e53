"""Which modules become FSDP units, and which parameters stay out of FSDP; once sharded, the
units in forward order and what each one's parameters take gathered.

Model-agnostic: works from what a transformers model declares (``_no_split_modules``,
``get_input_embeddings``) or, failing that, from the module tree's shape.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shard_engine.modes import ENCODER_MODES
from shard_engine.torch_private import fsdp_params, gathered_dtype, gathered_numel, local_numel

logger = logging.getLogger(__name__)

ShardCondition = Callable[[str, nn.Module], bool]


def detect_decoder_layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks (decoder layers) of ``model``.

    Uses the classes in ``model._no_split_modules`` when any module matches; otherwise the
    one homogeneous ``ModuleList`` holding the most parameters.
    """
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    named = [(name, module) for name, module in model.named_modules() if name]
    if no_split:
        found = [name for name, module in named if type(module).__name__ in no_split]
        if found:
            return found
    best: tuple[int, list[str]] = (0, [])
    for name, module in named:
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > best[0]:
            best = (numel, [f"{name}.{i}" for i in range(len(module))])
    return best[1]


def _shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    ids = {id(p) for p in a.parameters()}
    return any(id(p) in ids for p in b.parameters())


ENCODER_ATTRIBUTES = ("vision_tower", "visual", "vision_model", "multi_modal_projector", "connector",
                      "mm_projector")
"""Where transformers' image-text-to-text models keep their vision encoder and its projector (on the
model or on its ``model``): Llava's ``vision_tower`` and ``multi_modal_projector``, Qwen2-VL's
``visual``, Idefics3's ``vision_model`` and ``connector``."""

def encoder_module_names(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s image encoder and projector modules (empty for a text model)."""
    names = []
    for prefix, holder in (("", model), ("model.", getattr(model, "model", None))):
        if not isinstance(holder, nn.Module):
            continue
        for attribute in ENCODER_ATTRIBUTES:
            if isinstance(getattr(holder, attribute, None), nn.Module):
                names.append(prefix + attribute)
    return names


def default_shard_conditions(model: nn.Module, encoder: str = "shard") -> list[ShardCondition]:
    """Decoder layers, plus the input and output embeddings when they are untied; an image-text
    model's vision encoder and projector (:func:`encoder_module_names`) as units of their own, their
    blocks each a unit (``encoder="shard"``), or none of them (``"replicate"``: they are
    ``_hsdp_ignored_modules``, whole on every rank).

    Tied embeddings (``tie_word_embeddings``) share one parameter, which FSDP2 allows in one
    group only: they stay with the root. Untied ones get groups of their own so that their
    gathered weights are freed after use instead of living as long as the root's.
    """
    names = set(detect_decoder_layer_names(model))
    embeddings: list[nn.Module] = []
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb_in = get_in() if callable(get_in) else None
    emb_out = get_out() if callable(get_out) else None
    if emb_in is not None and emb_out is not None and _shares_parameters(emb_in, emb_out):
        emb_in = emb_out = None
    for module in (emb_in, emb_out):
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            embeddings.append(module)
    # Embeddings inside a decoder-layer-class module (e.g. BertEmbeddings) are covered by it.
    layer_prefixes = tuple(f"{n}." for n in names)
    embedding_names = {
        name
        for name, module in model.named_modules()
        if any(module is e for e in embeddings) and not name.startswith(layer_prefixes)
    }
    selected = names | embedding_names
    encoders = encoder_module_names(model)
    if encoder == "shard":
        selected |= set(encoders)  # their own parameters (a tower's norms, the projector) gathered on their call
    elif encoder == "replicate":
        inside = tuple(f"{name}." for name in encoders)
        selected = {name for name in selected if not name.startswith(inside)}
    else:
        raise ValueError(f"encoder must be one of {ENCODER_MODES}, got {encoder!r}")
    return [lambda name, module, selected=frozenset(selected): name in selected]


def select_units(model: nn.Module, conditions: Iterable[ShardCondition]) -> list[tuple[str, nn.Module]]:
    """Modules matching any condition, children before parents (the order ``fully_shard`` needs)."""
    conditions = list(conditions)
    matched = [
        (name, module)
        for name, module in model.named_modules()
        if name and any(cond(name, module) for cond in conditions)
    ]
    # named_modules() is pre-order: reversing puts every child before its ancestors.
    return list(reversed(matched))


def owning_unit(fqn: str, unit_names, exclude: str | None = None) -> str:
    """The name of the deepest unit owning module or tensor ``fqn``: its longest dotted prefix in
    ``unit_names`` other than ``exclude`` (a walk up the name, not a scan of every unit: a
    256-expert MoE has 10^5 tensors); "" (the root) where none is."""
    prefix = fqn
    while prefix and (prefix not in unit_names or prefix == exclude):
        prefix = prefix.rpartition(".")[0]
    return prefix


def tied_across_units(model: nn.Module, units: list[tuple[str, nn.Module]]) -> set[str]:
    """Names (each parameter's first, as ``named_parameters`` gives it) of the parameters that
    modules of two or more units (or of a unit and the root) hold: Zamba's shared attention
    blocks, one set of weights in every few hybrid layers. FSDP2 cannot shard one parameter in
    two units (each would make a DTensor of its own, and a unit's gather would not reach the
    other's), so such parameters stay out of FSDP, replicated (:func:`find_ignored_param_names`'s
    fate), and the root installs them in every module that holds them."""
    unit_names = {name for name, _ in units}
    holders: dict[int, set[str]] = {}
    first: dict[int, str] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for key, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), set()).add(owning_unit(fqn, unit_names))
    for name, p in model.named_parameters():
        first[id(p)] = name
    return {first[i] for i, owners in holders.items() if len(owners) > 1 and i in first}


def _dominant_dtype(params: Iterable[tuple[str, nn.Parameter]]) -> torch.dtype | None:
    counts: Counter[torch.dtype] = Counter()
    for _, p in params:
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def find_ignored_param_names(model: nn.Module) -> set[str]:
    """Names of parameters FSDP must not manage; they stay replicated in their own dtype.

    0-dim parameters, non-floating (packed integer) parameters, floating parameters whose
    dtype is not the model's dominant one (by element count), and every parameter of the
    modules named in ``model._hsdp_ignored_modules``. Except: a module's parameters that it names
    in a ``row_sharded`` attribute (quantized weights and their scales,
    ``loaders.quantization``) are sharded by rows whatever their dtype, where they have rows
    (FSDP2 gathers a unit of mixed dtypes as bytes); the model's dominant dtype is counted
    without them.
    """
    row_sharded = {f"{fqn}.{n}" if fqn else n for fqn, m in model.named_modules()
                   for n in getattr(m, "row_sharded", ())}
    params = list(model.named_parameters())
    dominant = _dominant_dtype([(n, p) for n, p in params if n not in row_sharded])
    ignored: set[str] = set()
    off_dtype: list[str] = []
    for name, p in params:
        if name in row_sharded and p.dim() > 0:
            continue
        if p.dim() == 0 or not p.is_floating_point():
            ignored.add(name)
        elif p.dtype != dominant:
            ignored.add(name)
            off_dtype.append(f"{name} ({p.dtype})")
    if off_dtype:
        logger.warning(
            "Keeping %d parameter(s) replicated because their dtype differs from the model's "
            "dominant %s: %s",
            len(off_dtype),
            dominant,
            ", ".join(off_dtype),
        )
    for module_name in getattr(model, "_hsdp_ignored_modules", None) or ():
        module = model.get_submodule(module_name)
        ignored.update(f"{module_name}.{n}" for n, _ in module.named_parameters())
    return ignored


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 units of ``model`` in forward order: the root first, then its units in module
    order (for Hugging Face decoders: embeddings, decoder layers in order, then any others)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unit_gathered_bytes(unit: FSDPModule) -> tuple[int, int]:
    """(gathered, local) bytes of the unit's own sharded parameters, in the dtype they are
    gathered in: mixed precision's param_dtype, else the parameter's own (before FSDP2's lazy
    init too)."""
    gathered = local = 0
    for fsdp_param in fsdp_params(unit):
        itemsize = gathered_dtype(fsdp_param).itemsize
        gathered += gathered_numel(fsdp_param) * itemsize
        local += local_numel(fsdp_param) * itemsize
    return gathered, local


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit (its parameters gathered on its call)."""
    return isinstance(module, FSDPModule)


def settle_root(model: nn.Module) -> None:
    """Make ``model`` the FSDP root now (where it is sharded), so that a unit inside it may be called
    before the root's first forward (``shard_engine.torch_private.init_root``)."""
    if isinstance(model, FSDPModule):
        from shard_engine.torch_private import init_root

        init_root(model)
