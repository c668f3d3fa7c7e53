"""Linear layers on oneDNN's prepacked weights, on CPU (``--packed-linears``).

A decode step is bound by its weights streaming from memory, and torch's plain CPU linear reads
a bf16 weight at about half the speed oneDNN's prepacked one does (benchmarks/RESULTS.md, session
12): SmolLM2-135M's tied 49152 x 576 head 9.1 against 4.9 ms a step; transformers' own decode
step of it 46 against 35 ms on two threads; served on 2 CPU ranks, 16 clients, 157 against 125
output tokens/s (median of three alternating rounds; one client: no difference measured).

:func:`pack_linears` gives each ``nn.Linear`` of the model a packed copy of its weight
(``torch.ops.mkldnn._reorder_linear_weight``) and makes its forward one op,
``torch.ops.hsdp.linear(x, weight, bias)``. The op finds the packed copy by the weight it was
made from and computes with it (``torch.ops.mkldnn._linear_pointwise``); for any other weight,
or one written in place since it was packed (its version moved), it is ``F.linear``: never a
stale result. The op is opaque to ``torch.compile`` (a compiled decode graph calls it once per
linear, as it calls an extern matmul). In bf16 the packed product equals ``F.linear``'s
(tests/test_linears.py).

The copies are private to the rank (oneDNN's opaque layout cannot live in ``/dev/shm`` like the
host's one copy of the resident units): they cost one more copy of the linears' weights per rank,
counted as the rank's resident memory and taken before the KV pool is sized. Only resident
weights are packed (a unit that gathers gets new storage every forward). Collective-free.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from server.engine.cores import follow_threads
from shard_engine.ops import define_op

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16,)
"""What ``auto`` packs: bf16, where the gain was measured. float32 packs too (``on``); its
product may differ from ``F.linear``'s in the last bits (oneDNN blocks the sum otherwise)."""
AUTO_MEMORY_SHARE = 0.25
"""``auto`` packs only where the copies take at most this share of the host's available memory."""

_PACKED: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
"""weight.data_ptr() -> (the weight, its version when packed, the packed copy). The weight is held,
so its storage (and address) cannot go to another tensor while the entry lives."""


def _version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (in-place writes move it); -1 for an inference tensor, which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    follow_threads()  # inside a compiled step: the plan's threads (server.engine.cores)
    entry = _PACKED.get(weight.data_ptr())
    if entry is not None and entry[0].shape == weight.shape and entry[1] == _version(weight):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry[2], bias, "none", [], "")
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


packed_linear = define_op("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _linear, _linear_fake)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.weight, self.bias)


# Bound to a module as its ``forward``, under that name: dynamo's guard serializer (a compiled
# step's graph kept on disk) finds a bound method by ``getattr(module, func.__name__)``.
_forward.__name__ = "forward"


def packing_refusal(model: nn.Module, device: torch.device, dtypes=PACKED_DTYPES) -> str | None:
    """Why this rank's linears cannot be packed, or None."""
    if device.type != "cpu":
        return f"the ranks run on {device.type}, not CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn)"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype not in dtypes:
        return f"the weights are {dtype}, not {' or '.join(str(d) for d in dtypes)}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bf16 instructions oneDNN uses"
    return None


def _resident_linears(model: nn.Module) -> list[nn.Linear]:
    out = []
    for module in model.modules():
        if type(module) is nn.Linear and isinstance(module.weight, torch.Tensor) and module.weight.device.type == "cpu":
            weight = module.weight
            if type(weight).__name__ != "DTensor" and weight.untyped_storage().size() > 0:
                out.append(module)
    return out


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of ``model``'s resident linears would take (as their weights)."""
    seen, total = set(), 0
    for module in _resident_linears(model):
        if module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            total += module.weight.numel() * module.weight.element_size()
    return total


def pack_linears(model: nn.Module, batch_hint: int = 1) -> int:
    """Pack every resident ``nn.Linear`` of ``model`` and route its forward through the packed op;
    returns the packed copies' bytes. Idempotent; a weight shared by several linears is packed once."""
    total = 0
    for module in _resident_linears(model):
        weight = module.weight
        key = weight.data_ptr()
        entry = _PACKED.get(key)
        if entry is None or entry[0].shape != weight.shape or entry[1] != _version(weight):
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
            _PACKED[key] = (weight, _version(weight), packed)
            total += weight.numel() * weight.element_size()
        module.forward = _forward.__get__(module)
    logger.info("linears on prepacked weights: %.1f MB of copies", total / 1e6)
    return total


@contextlib.contextmanager
def plain_forwards(modules) -> Iterator[None]:
    """Within, the packed linears under ``modules`` run ``nn.Linear``'s own forward (their packed
    copies kept): what a compiled step of one sequence traces, whose products of one row inductor
    makes reductions of its own that stream a weight faster than oneDNN's packed product reads it
    (server.engine.compiled, ``decompose_mm_pass``: SmolLM2-135M's decoder products in bf16 on two
    cores 5.0 against 6.2 ms a step, benchmarks/RESULTS.md session 23)."""
    plain = [m for module in modules for m in module.modules()
             if type(m) is nn.Linear and getattr(vars(m).get("forward"), "__func__", None) is _forward]
    for m in plain:
        del m.forward
    try:
        yield
    finally:
        for m in plain:
            m.forward = _forward.__get__(m)


def repack_linears(model: nn.Module) -> int:
    """Pack again every linear :func:`pack_linears` packed (its weight's values changed in place:
    new weights, ``server.weights``); returns the copies' bytes, 0 where none were packed."""
    packed = [m for m in _resident_linears(model) if "forward" in m.__dict__]
    if not packed:
        return 0
    for module in packed:
        _PACKED.pop(module.weight.data_ptr(), None)
    return pack_linears(model)


def unpack_linears(model: nn.Module) -> None:
    """Undo :func:`pack_linears` for ``model`` (forwards back to ``nn.Linear``'s, copies dropped)."""
    for module in model.modules():
        if type(module) is nn.Linear and "forward" in module.__dict__:
            del module.forward
            _PACKED.pop(module.weight.data_ptr(), None)
