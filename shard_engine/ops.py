"""hsdp-serve's custom operators (``torch.ops.hsdp.*``), declared in one way.

:func:`define_op` declares one with the plain ``torch.library.Library`` API, its Python function
registered as the ``CompositeExplicitAutograd`` kernel, so that a call goes from the dispatcher
straight to the Python (``torch.library.custom_op`` adds Python autograd and redispatch layers
around it, a third of the decode attention op's host time at hidden size 64), and a fake (meta)
implementation for ``torch.compile``, which calls the op as one opaque node of its graph.
Collective-free; any device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "hsdp"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Declare ``torch.ops.hsdp.<name>`` by ``schema`` (``"name(Tensor x, ...) -> Tensor"``) with
    ``impl`` as its kernel and ``fake`` as its shape function; returns its default overload."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(torch.ops.hsdp, name).default
