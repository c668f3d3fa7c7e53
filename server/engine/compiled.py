"""Decode steps through ``torch.compile`` (``--compile decode``).

A *decode-only* forward (every sequence of the step computes one token; none asks for its
prompt's log-probabilities) runs the model through one ``torch.compile``'d function (inductor,
dynamic shapes: one graph for a single sequence, one for any batch and context beyond it), with
FSDP2's hooks out of the way (:class:`shard_engine.direct.DirectForward`): the Python of a few
hundred module calls per step becomes one call of generated code. Steps with prompt chunks run
eagerly (their cost is arithmetic, and their shapes vary most). Eager stays the reference (the
exactness tests compare the two token for token) and the fallback.

Requires every unit resident (the CPU default): a model whose forwards gather is refused with
the reason at startup (:class:`CompileUnavailable`), as is a device or torch without inductor.
:meth:`CompiledDecode.warm_up` compiles at startup, before any request is admitted (``/ready``
says ``compiling``): decode forwards of one and of three sequences whose keys and values go to
the first KV block, which nothing holds yet. Inductor keeps what it generated on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default under hsdp-serve's cache directory): a second start
traces again but compiles less.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

WARM_UP_CONTEXTS = ((5,), (7, 9, 11))
"""The decode forwards warm-up runs, as the contexts of their sequences: one alone (a batch of
one is its own graph), then three (none equal to another size of the graph, which inductor would
otherwise take for a constant relation)."""


class CompileUnavailable(RuntimeError):
    """``--compile decode`` cannot be served here; the message says why."""


def inductor_cache_dir() -> str:
    """Where inductor's on-disk caches go: ``TORCHINDUCTOR_CACHE_DIR`` if set, else under
    hsdp-serve's cache directory (kept between starts, unlike /tmp in a container). The
    launcher sets the variable before any rank starts: inductor reads it once."""
    from loaders.sources.default_model import cache_root

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_root(), "inductor")


class CompiledDecode:
    """The compiled decode forward of one rank's model. ``forward(**kwargs)`` is the model's
    forward (same arguments, same output) for decode-only steps."""

    def __init__(self, model: nn.Module):
        from shard_engine.direct import DirectForward

        try:
            self._direct = DirectForward(model)
        except ValueError as e:
            raise CompileUnavailable(f"--compile decode: {e} (every unit must be resident: --resident-units all, "
                                     "or auto on CPU ranks of one host)") from None
        self._compiled = torch.compile(model.forward, dynamic=True)
        self.calls = 0  # decode forwards run compiled, warm-up included

    def forward(self, **kwargs):
        self.calls += 1
        # specialize_float: the modules' float attributes (norm epsilons, scales) are constants.
        # As symbolic floats, torch 2.13 traced every graph twice (its pass that turns them into
        # tensors gave up and restarted the analysis with them specialized): half the compile.
        with self._direct(), torch._dynamo.config.patch(specialize_float=True):
            return self._compiled(**kwargs)

    def warm_up(self, cache, block_size: int, device: torch.device) -> float:
        """Compile now: the decode forwards of :data:`WARM_UP_CONTEXTS`, their keys and values
        written into block 0 of ``cache`` (free at startup). Returns the seconds it took; raises
        CompileUnavailable naming what failed."""
        from server.engine.attention import PagedLayout
        from shard_engine.torch_private import mark_static

        mark_static(cache.keys + cache.values)  # the pools never change size (and are many)
        if max(max(c) for c in WARM_UP_CONTEXTS) > block_size * cache.num_blocks:
            raise CompileUnavailable("--compile decode: the KV cache is too small to warm up in")
        start = time.monotonic()
        for contexts in WARM_UP_CONTEXTS:
            layout = PagedLayout.build([(c - 1, 1, list(range(-(-c // block_size)))) for c in contexts],
                                       block_size, device)
            cache.layout = layout
            try:
                with torch.no_grad():
                    self.forward(input_ids=torch.ones(1, len(contexts), dtype=torch.long, device=device),
                                 position_ids=torch.tensor([[c - 1 for c in contexts]], device=device),
                                 cache=cache, use_cache=True,
                                 logits_to_keep=torch.arange(len(contexts), device=device), hsdp_paged=layout)
            except Exception as e:
                raise CompileUnavailable(f"--compile decode: torch.compile failed ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})") from e
            finally:
                cache.layout = None
        return time.monotonic() - start
