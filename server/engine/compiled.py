"""Decode steps through ``torch.compile`` (``--compile decode``).

A *decode-only* forward (every sequence of the step computes one token; none asks for its
prompt's log-probabilities) runs the model through one ``torch.compile``'d function (inductor),
with FSDP2's hooks out of the way (:class:`shard_engine.direct.DirectForward`): the Python of a
few hundred module calls per step becomes one call of generated code. Which graphs, is
``--compile-batch-sizes`` (:class:`server.config.CompileSizes`):

* a *static* size is a graph of that batch, traced once at startup; a step is padded to the
  smallest that holds it (vLLM's CUDA-graph capture sizes do the same): the static shapes CUDA
  graphs need, the GPU default;
* the *open* size (``N+``) is one graph whose batch dimension is symbolic, for every step of at
  least N sequences (padded up to N if fewer): one trace of the model for all of them, the CPU
  default beside a static graph for one sequence. A trace is most of a start with inductor's
  cache filled (dynamo over transformers' Python: 5-8 s at 24 layers on 2 cores), and inductor's
  CPU code runs a symbolic batch as fast as a fixed one.

Only the KV pools' slot count and the sequences' context length (a size that reaches nothing but
the decode attention op, :mod:`server.engine.kernels`) are symbolic besides. Steps with prompt
chunks, and decode steps larger than the largest static size where there is no open one, run
eagerly. Eager stays the reference (the exactness tests compare the two token for token) and the
fallback.

A padding row is token 0 at position 0 whose key and value go to the KV pool's scratch block
(``PagedKVCache.scratch_block``, which the scheduler never hands out) and whose logits are
dropped: no other row reads what it computes (each sequence's attention reads its own slots).

Requires every unit resident (the CPU default): a model whose forwards gather is refused with
the reason at startup (:class:`CompileUnavailable`), as is a device or torch without inductor.
:meth:`CompiledDecode.warm_up` compiles every graph at startup, before any request is admitted
(``/ready`` says ``compiling``), with decode forwards whose keys and values go to the first KV
block, which nothing holds yet. Inductor keeps what it generated on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default under hsdp-serve's cache directory): a second start
traces again but compiles less.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from server.engine.cores import threads_inside

logger = logging.getLogger(__name__)

WARM_UP_CONTEXTS = (5, 7)
"""The context lengths each graph's warm-up forwards run at: two, so that the context is seen to
vary and kept symbolic (it is also marked dynamic on every call)."""


class CompileUnavailable(RuntimeError):
    """``--compile decode`` cannot be served here; the message says why."""


def inductor_cache_dir() -> str:
    """Where inductor's on-disk caches go: ``TORCHINDUCTOR_CACHE_DIR`` if set, else under
    hsdp-serve's cache directory (kept between starts, unlike /tmp in a container). The
    launcher sets the variable before any rank starts: inductor reads it once."""
    from loaders.sources.default_model import cache_root

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_root(), "inductor")


class CompiledDecode:
    """The compiled decode forward of one rank's model. :meth:`pad` turns a decode-only step's
    inputs into a bucket's, or says it has none; ``forward(**kwargs)`` is then the model's forward
    (same arguments, same output) over the padded rows. ``sizes``: the graphs, a
    :class:`server.config.CompileSizes`."""

    def __init__(self, model: nn.Module, sizes):
        from shard_engine.direct import DirectForward

        try:
            self._direct = DirectForward(model)
        except ValueError as e:
            raise CompileUnavailable(f"--compile decode: {e} (every unit must be resident: --resident-units all, "
                                     "or auto on CPU ranks of one host)") from None
        self.sizes = sizes
        self._compiled = torch.compile(model.forward, dynamic=False)
        self.calls = 0  # decode forwards run compiled, warm-up included
        self.warm = False
        self.skip_guards = True  # after the warm-up (:meth:`_stance`); off for good after a call no graph fit
        self.threads = torch.get_num_threads()  # the warm-up's: part of every graph's guards
        self.padded_rows = 0  # rows computed only to fill a bucket, warm-up included
        self.warm_up_padded_rows = 0  # ... of which the warm-up's
        self.batches: set[int] = set()  # the batches run compiled since the warm-up
        self.graphs_compiled = 0  # by the last warm-up (a graph per static size and the open one, unless
        # the model specialized on the open graph's batch)

    def bucket(self, sequences: int) -> int | None:
        """The batch a decode step of ``sequences`` rows runs compiled at: the smallest static size
        that holds it, else (with an open size) ``sequences`` itself, padded up to the open size if
        fewer; None: eagerly."""
        static = next((b for b in self.sizes.static if b >= sequences), None)
        if static is not None or self.sizes.open_from is None:
            return static
        return max(sequences, self.sizes.open_from)

    def pad(self, ids: list[int], positions: list[int], items: list, keep: list[int], scratch_block: int,
            bucket: int | None = None) -> bool:
        """Pads a decode-only step's token ids, positions, layout items (``PagedLayout.build``'s:
        one token each) and rows kept for logits, in place, to its bucket (or ``bucket``); False
        (nothing changed, run it eagerly) where it has none, or where its longest context is 1 (a
        step of one-token prompts: compile took the context for at least 2). The logits of the
        first ``len(keep)`` rows kept are the step's, as unpadded."""
        bucket = bucket or self.bucket(len(ids))
        if bucket is None or max(start + count for start, count, _ in items) < 2:
            return False
        extra = bucket - len(ids)
        ids += [0] * extra
        positions += [0] * extra
        items += [(0, 1, [scratch_block])] * extra
        keep += [bucket - 1] * (bucket - len(keep))  # a static size: the logits of padding rows, dropped
        self.padded_rows += extra
        return True

    def forward(self, threads: int = 0, **kwargs):
        """The model's forward over a padded decode step; ``threads``: the intra-op threads its
        opaque ops run at (the plan's, :mod:`server.engine.cores`; 0: the graphs' own count)."""
        self.calls += 1
        if self.warm:
            self.batches.add(kwargs["input_ids"].shape[1])
        layout = kwargs["hsdp_paged"]
        decode = layout.decode
        # the context length varies every step: symbolic (it only sizes the attention op's inputs)
        for tensor, dim in ((decode.slots_SL, 1), (decode.valid_SL, 1), (decode.positions_L, 0)):
            torch._dynamo.mark_dynamic(tensor, dim)
        if self.sizes.open_from is not None and kwargs["input_ids"].shape[1] >= self.sizes.open_from:
            # the open graph's: the batch is symbolic in every input that has it
            for tensor, dim in ((kwargs["input_ids"], 1), (kwargs["position_ids"], 1), (kwargs["logits_to_keep"], 0),
                                (layout.slots_T, 0), (decode.rows_S, 0), (decode.slots_SL, 0), (decode.valid_SL, 0),
                                (decode.contexts_S, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
        try:
            with threads_inside(threads):
                return self._call(kwargs)
        except RuntimeError as e:
            # a call no graph fits (what pad() admits should never be one): under
            # skip_guard_eval_unsafe torch raises before running anything; from now on every
            # guard is evaluated, and such a call runs eagerly
            if not (self.warm and self.skip_guards and "skip_guard_eval_unsafe" in str(e)):
                raise
            logger.warning("compiled decode: a step no compiled graph fits (%s); guards evaluated in full from now on",
                           {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            self.skip_guards = False
            torch.set_num_threads(self.threads)
            with threads_inside(threads):
                return self._call(kwargs)

    def _call(self, kwargs):
        # specialize_float: the modules' float attributes (norm epsilons, scales) are constants.
        # As symbolic floats, torch 2.13 traced every graph twice (its pass that turns them into
        # tensors gave up and restarted the analysis with them specialized).
        # recompile_limit: a graph per static size and the open one (a recompile past it would run eagerly)
        with self._direct(), torch._dynamo.config.patch(specialize_float=True,
                                                        recompile_limit=self.sizes.graphs + 1), self._stance():
            return self._compiled(**kwargs)

    def _stance(self):
        """After the warm-up: a call that no graph fits runs eagerly rather than compiling
        mid-serving, and only the guards that tell the graphs apart are evaluated (the rest cost
        1.1-1.4 ms a step at 24 layers: a guard per parameter). That is safe because :meth:`pad`
        admits only what the warm-up compiled for: a static size's batch or one at or above the
        open size, one token per row, a context of at least 2 (the size compile assumes of a
        symbolic one), no grad, the same pools."""
        if not self.warm:
            return torch.compiler.set_stance("default")
        return torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=self.skip_guards)

    def warm_up(self, cache, block_size: int, device: torch.device) -> float:
        """Compile now: for every static size, decode forwards of one sequence at each of
        :data:`WARM_UP_CONTEXTS` (padded to the size, as a step would be); for the open size, one at
        that size and one at the next, so that the batch is seen to vary. Their keys and values go
        to block 0 of ``cache`` (free at startup). Returns the seconds it took; raises
        CompileUnavailable naming what failed. A model whose forward specializes on the open
        graph's batch (a graph per batch after all) is warned about: its other batches run eagerly."""
        from server.engine.attention import PagedLayout
        # the pools' slot count (the KV budget, sized from free memory at every start) as one
        # symbol: a graph of fixed sizes otherwise, whose cache on disk a new budget would miss
        for pool in cache.keys + cache.values:
            torch._dynamo.mark_dynamic(pool, 1)
        if max(WARM_UP_CONTEXTS) > block_size * cache.num_blocks:
            raise CompileUnavailable("--compile decode: the KV cache is too small to warm up in")
        self.warm = False  # every guard evaluated: a new pool (another engine's) compiles anew
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        calls = [(bucket, context) for bucket in self.sizes.static for context in WARM_UP_CONTEXTS]
        if self.sizes.open_from is not None:
            calls += [(self.sizes.open_from + i, context) for i, context in enumerate(WARM_UP_CONTEXTS)]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.monotonic()
        for bucket, context in calls:
            ids, positions, keep = [1], [context - 1], [0]
            items = [(context - 1, 1, list(range(-(-context // block_size))))]
            self.pad(ids, positions, items, keep, cache.scratch_block, bucket=bucket)
            layout = PagedLayout.build(items, block_size, device)
            cache.layout = layout
            try:
                with torch.no_grad():
                    self.forward(input_ids=torch.tensor([ids], device=device),
                                 position_ids=torch.tensor([positions], device=device),
                                 cache=cache, use_cache=True,
                                 logits_to_keep=torch.tensor(keep, device=device), hsdp_paged=layout)
            except Exception as e:
                raise CompileUnavailable(f"--compile decode: torch.compile failed ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})") from e
            finally:
                cache.layout = None
        self.graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        if self.graphs_compiled > self.sizes.graphs:
            logger.warning("compiled decode: %d graphs for --compile-batch-sizes %s (expected %d): the model's forward "
                           "specializes on the batch; steps of batches not warmed up run eagerly",
                           self.graphs_compiled, self.sizes, self.sizes.graphs)
        self.warm_up_padded_rows = self.padded_rows
        self.warm = True
        return time.monotonic() - start
