"""Forwards without FSDP2's hooks while every unit is resident.

With every unit's parameters gathered for good (``set_resident_units(model, -1)``, shared or
private), FSDP2's pre- and post-forward hooks do nothing a forward needs: there is nothing to
gather, wait for or free. They still run per unit and per forward (root setup, moving inputs,
walking the outputs for backward hooks, profiler ranges), and each one is opaque to
``torch.compile`` (FSDP2 marks them ``dynamo_disable``): a compiled forward would break its graph
at every unit. :class:`DirectForward` takes FSDP2's hooks out for the duration of a call and puts
them back, in their order, afterwards; other hooks stay. The module's parameters then are the
gathered tensors FSDP2 installed, as inside its own forward. The rank engine runs every forward
of a resident model so, eager or compiled (:meth:`DirectForward.resident` asked each step; it
looks at the units again only after ``set_resident_units`` changed them).

:func:`direct_forward_refusal` says why a model cannot run so (a unit not resident, a unit that
casts its outputs, hooks FSDP2 registered in a way this module does not know), or None.
Not thread-safe: one forward at a time per model (a rank's engine loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from shard_engine.torch_private import (
    casts_outputs,
    forward_hooks,
    is_gathered,
    param_group,
    reshards_after_forward,
)
from shard_engine.overlap import residency_changes
from shard_engine.units import fsdp_units


def _gathers(unit: FSDPModule) -> bool:
    """Whether the unit's forward gathers (or frees) parameters: it has some that are not resident."""
    return param_group(unit) is not None and (not is_gathered(unit) or reshards_after_forward(unit))


def gathers_in(module: nn.Module) -> bool:
    """Whether a forward of ``module`` (a model, or a part of one such as its vision tower) runs a
    collective: some FSDP unit inside it holds parameters that are not resident. Every rank of a
    shard group answers alike (residency is set collectively)."""
    return any(_gathers(unit) for unit in module.modules() if isinstance(unit, FSDPModule))


def direct_forward_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s forwards need FSDP2's hooks now, or None when they do not."""
    for unit in fsdp_units(model):
        name = type(unit).__name__
        if _gathers(unit):
            return f"a unit ({name}) is not resident"
        if casts_outputs(unit):
            return f"a unit ({name}) casts its outputs (mixed precision's output_dtype)"
        try:
            pre, pre_id, post, post_id = forward_hooks(unit)
        except AttributeError:
            return f"a unit ({name}) has FSDP2 hooks of a kind not known here (grouped modules?)"
        if pre_id not in pre or post_id not in post:
            return f"a unit ({name}) lacks FSDP2's forward hooks"
    return None


class DirectForward:
    """``direct = DirectForward(model)`` once (it finds the hooks; ValueError with
    :func:`direct_forward_refusal`'s reason where the model needs them), then ``with direct():``
    runs forwards of ``model`` without FSDP2's forward hooks."""

    def __init__(self, model: nn.Module):
        why = direct_forward_refusal(model)
        if why is not None:
            raise ValueError(f"forwards need FSDP2's hooks: {why}")
        self._model = model
        self._units: list[tuple[FSDPModule, dict, int, dict, int]] = [
            (unit, *forward_hooks(unit)) for unit in fsdp_units(model)]
        self._resident_as_of = (residency_changes(model), True)

    def resident(self) -> bool:
        """Whether every unit is still resident. Residency is changed by
        :func:`shard_engine.set_resident_units` (possibly after this was made): the units are
        looked at again only after a call of it, not every step (31 units: ~0.1 ms)."""
        changes, resident = self._resident_as_of
        if changes != residency_changes(self._model):
            resident = not any(_gathers(unit) for unit, *_ in self._units)
            self._resident_as_of = (residency_changes(self._model), resident)
        return resident

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        saved = []
        for _, pre, pre_id, post, post_id in self._units:
            saved.append((pre, list(pre.items()), post, list(post.items())))
            del pre[pre_id], post[post_id]
        try:
            yield
        finally:
            for pre, pre_items, post, post_items in saved:
                pre.clear()
                pre.update(pre_items)
                post.clear()
                post.update(post_items)
