"""Speed knobs for a sharded model: forward prefetch (all-gathers overlapped with compute) and
residency (units that keep their gathered parameters).

Both act on the FSDP2 units of a model that :func:`~shard_engine.finalize_hsdp_root` (or
:func:`~shard_engine.apply_hsdp_to_model`) has sharded. Both are collective in effect: every
rank of the mesh must apply the same settings, or the all-gathers of the next forward no longer
match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shard_engine.shared_weights import share_resident_units
from shard_engine.torch_private import set_unshard_async
from shard_engine.units import encoder_module_names, fsdp_units, unit_gathered_bytes


def enable_forward_prefetch(model: nn.Module, *, depth: int = 2, async_collectives: bool | None = None) -> int:
    """Have each unit's pre-forward start the all-gathers of the next ``depth`` units, so that they
    run while this unit computes. Returns the number of prefetch links set.

    Depth 1 leaves the collective idle while each unit copies its gathered parameters out and the
    next one's in; depth 2 keeps one all-gather queued behind the running one, at the cost of one
    more unit's gathered parameters held at a time.

    On an accelerator the all-gathers already run on their own stream. On the CPU (gloo) nothing
    runs beside the compute thread unless the all-gather is issued asynchronously, so
    ``async_collectives`` defaults to True there: gloo then moves the bytes on its own threads
    while this one computes.
    """
    units = fsdp_units(model)
    if async_collectives is None:
        async_collectives = _param_device(model).type == "cpu"
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    links = 0
    for chain in _forward_chains(model, units):
        for i, unit in enumerate(chain):
            following = chain[i + 1:i + 1 + depth]
            unit.set_modules_to_forward_prefetch(following)
            links += len(following)
    for unit in units:
        set_unshard_async(unit, async_collectives)
    return links


def _forward_chains(model: nn.Module, units: list) -> list[list]:
    """The units in the orders forwards run them: an image-text model's encoder units (its tower and
    projector, called on their own when images arrive) apart from the rest (the root, the decoder).
    A link across would gather the encoder's first units in every decoder forward, and the decoder's
    in every encode, which a rank that only matches an encode's all-gathers does not run."""
    inside = tuple(f"{name}." for name in encoder_module_names(model))
    names = {id(m): name for name, m in model.named_modules()}
    encoder = [u for u in units if (names[id(u)] + ".").startswith(inside)] if inside else []
    chosen = {id(u) for u in encoder}
    return [chain for chain in (encoder, [u for u in units if id(u) not in chosen]) if chain]


def disable_forward_prefetch(model: nn.Module) -> None:
    """Undo :func:`enable_forward_prefetch`: each unit gathers its parameters in its own pre-forward."""
    for unit in fsdp_units(model):
        unit.set_modules_to_forward_prefetch([])
        set_unshard_async(unit, False)


@dataclass
class Residency:
    """What :func:`set_resident_units` made resident, and what it costs."""

    units: list[str] = field(default_factory=list)
    """Qualified names of the resident units ('' is the root)."""

    shared_bytes: int = 0
    """Bytes of the host's one shared copy of the resident units (``shared=True``), mapped by every
    rank of the shard group; each rank's local shards are views of it."""

    shared_with: int = 1
    """Ranks mapping that copy: each one's proportional share is ``shared_bytes / shared_with``."""

    total_units: int = 0
    extra_bytes: int = 0
    """Memory this rank holds beyond its shards: the gathered parameters of the resident units."""

    @property
    def shared(self) -> bool:
        return self.shared_bytes > 0

    @property
    def everything(self) -> bool:
        """Every unit resident: a forward gathers nothing and runs no collective."""
        return len(self.units) == self.total_units

    def as_dict(self) -> dict:
        return {"units": len(self.units), "of": self.total_units, "names": self.units,
                "extra_bytes_per_rank": self.extra_bytes, "shared_bytes": self.shared_bytes,
                "shared_with": self.shared_with}


def set_resident_units(model: nn.Module, count: int, *, shared: bool = False,
                       fallback_private: bool = True) -> Residency:
    """Keep the gathered parameters of the first ``count`` units in forward order (-1: all of them).

    Resident units are gathered once, now (a collective), and never resharded: later forwards
    skip their all-gathers. The others gather and free their parameters in every forward. May be
    called again with another count; units that stop being resident are resharded.

    ``shared``: where the shard group's ranks share a host's memory, the resident units are
    gathered into one shared copy per host instead of one per rank, and each rank's shards become
    views of it (:mod:`shard_engine.shared_weights`): no extra memory per host. Elsewhere (GPUs,
    several hosts) the copies stay private, as without it, or with ``fallback_private=False`` no
    unit is made resident (the returned Residency then lists none).
    """
    units = fsdp_units(model)
    count = len(units) if count < 0 else min(count, len(units))
    model._hsdp_residency_changes = residency_changes(model) + 1
    names = {id(m): name for name, m in model.named_modules()}
    previous = getattr(model, "_hsdp_shared_weights", None)
    if previous is not None:  # shared storage must become private before FSDP may reshard it
        previous.release()
        model._hsdp_shared_weights = None
    ring = getattr(model, "_hsdp_unit_ring", None)
    if ring is not None:  # the same for the leaf units' shared slots (shard_engine.shm_all_gather)
        ring.release()  # they gather through the shared-memory ring again, copy-out and all
        model._hsdp_unit_ring = None
    residency = Residency(total_units=len(units), units=[names[id(u)] for u in units[:count]])
    if shared and count:
        for unit in units:  # sharing starts from sharded units
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()
        weights = share_resident_units(model, count)
        if weights is not None:
            model._hsdp_shared_weights = weights
            residency.shared_bytes, residency.shared_with = weights.nbytes, weights.sharers
            return residency
        if not fallback_private:
            residency.units = []
            return residency
    for i, unit in enumerate(units):
        resident = i < count
        unit.set_reshard_after_forward(not resident)
        if resident:
            residency.extra_bytes += _gathered_extra_bytes(unit)
    for i, unit in enumerate(units):  # gather now, in the same order on every rank
        if i < count:
            unit.unshard()
        else:
            unit.reshard()
    return residency


def residency_changes(model: nn.Module) -> int:
    """How many times :func:`set_resident_units` has been called on ``model``: what a cached
    view of its residency compares to know it is still current."""
    return getattr(model, "_hsdp_residency_changes", 0)


def shared_weights_of(model: nn.Module):
    """The :class:`shard_engine.shared_weights.SharedWeights` of ``model``'s resident units, or None."""
    return getattr(model, "_hsdp_shared_weights", None)


def _gathered_extra_bytes(unit: FSDPModule) -> int:
    """Bytes the unit's own sharded parameters take once gathered, beyond the local shards."""
    gathered, local = unit_gathered_bytes(unit)
    return gathered - local


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: its shard of each sharded parameter, and the whole of
    each replicated (ignored) one. Gathered copies (resident units, prefetch) are not counted."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _param_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
