"""Decode steps through ``torch.compile`` (``--compile decode``).

A *decode-only* forward (every sequence of the step computes one token; none asks for its
prompt's log-probabilities), and with the layer region also a step that carries prompt chunks
(the open graph, below), runs through ``torch.compile``'d code (inductor), with FSDP2's hooks
out of the way (:class:`shard_engine.direct.DirectForward`). What one graph covers is
``--compile-region``:

* ``layer`` (the default): a decoder layer. Every layer calls a graph of one compiled function of
  the layer (:class:`_CompiledLayers`) with its own parameters and KV pools as the graph's inputs,
  so dynamo traces one layer, not the model, and the model's layers of one kind (Gemma 2's
  windowed and global layers: two kinds) share a graph. The graphs are traced ahead of time and
  called as plain functions (no dynamo frame or guards between layers; inductor's code entered
  past AOTAutograd's runtime wrapper where it has nothing to do: ``CompiledCall.go_direct``), and
  kept on disk
  (:mod:`server.engine.graph_store`): a second start loads them instead of tracing. The
  embeddings, final norm, head and masks run eagerly around the layers.
* ``model``: the whole forward, one call of generated code a step; the start traces and compiles
  every layer.

Which graphs, is ``--compile-batch-sizes`` (:class:`server.config.CompileSizes`):

* a *static* size is a graph of that batch, traced once at startup; a step is padded to the
  smallest that holds it (vLLM's CUDA-graph capture sizes do the same): the static shapes CUDA
  graphs need, the GPU default;
* the *open* size (``N+``) is one graph whose batch dimension is symbolic, for every step of at
  least N sequences (padded up to N if fewer): one trace for all of them, the CPU default beside
  a static graph for one sequence. A trace is most of a cached start of the model's graph
  (dynamo over transformers' Python: 5-8 s at 24 layers on 2 cores), and inductor's CPU code
  runs a symbolic batch as fast as a fixed one.

Only the KV pools' slot count and the sequences' context length (a size that reaches nothing but
the decode attention op, :mod:`server.engine.kernels`) are symbolic besides. The layers' open graph
also takes steps that carry prompt chunks (:meth:`CompiledDecode.takes_whole_step`): its attention
is one opaque op over the whole step (``torch.ops.hsdp.paged_step``, which reads the step's layout
when it runs: ``attention.whole_step_op``), so nothing in it depends on what a step carries but its
rows. Steps with prompt chunks under the model's graph or below the open size, and decode steps
larger than the largest static size where there is no open one, run eagerly. Eager stays the
reference (the exactness tests compare the two token for token) and the fallback.

A padding row is token 0 at position 0 whose key and value go to the KV pool's scratch block
(``PagedKVCache.scratch_block``, which the scheduler never hands out) and whose logits are
dropped: no other row reads what it computes (each sequence's attention reads its own slots).

Requires every unit resident (the CPU default): a model whose forwards gather is refused with
the reason at startup (:class:`CompileUnavailable`), as is a device or torch without inductor.
:meth:`CompiledDecode.warm_up` compiles every graph at startup, before any request is admitted
(``/ready`` says ``compiling``), with decode forwards whose keys and values go to the first KV
block, which nothing holds yet. Inductor keeps what it generated on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default under hsdp-serve's cache directory): a second start of
the model's graph traces again but compiles less; the layers' graphs are kept beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from server.engine.adapters import POOLS_KEYWORD
from server.engine.attention import LAYER_POOLS, LAYER_STATES, LayerPools, PagedKVCache, one_decode_inline, step_layout, \
    whole_step_op
from server.engine.cores import threads_inside
from server.engine.linears import plain_forwards

logger = logging.getLogger(__name__)

WARM_UP_CONTEXTS = (5, 7)
"""The context lengths each graph's warm-up forwards run at: two, so that the context is seen to
vary and kept symbolic (it is also marked dynamic on every call)."""
ONE_ROW_PRODUCT_MAX_DIM = 1 << 18
"""The largest side of a weight whose product with one row inductor generates itself (see below)."""
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False,
                    "cpp.dynamic_threads": True, "post_grad_fusion_options": {"decompose_mm_pass": {}}}
"""What inductor generates, beside its defaults (vLLM's CPU platform sets the first and the last):

* its checks, on every call, of its inputs' sizes, strides, alignment and scalars left out: a layer
  of the tiny Llama made 21 such calls, ~20 us of its ~190. A step's inputs are what its graph was
  traced for by construction (:meth:`CompiledDecode.pad` admits only the sizes the warm-up ran, and
  each layer calls the graph it was matched to);
* CPU kernels that take the intra-op thread count when they run rather than hold the compile's as
  a constant: one graph of a layer serves every count a plan carries (:mod:`server.engine.cores`),
  where a set of graphs per count doubled a first start's traces;
* on CPU, a product of one row by a weight (a step of one sequence: its static graph, and the
  output head, :class:`_CompiledHead`) as a reduction inductor generates (``decompose_mm_pass``,
  its sides up to :data:`ONE_ROW_PRODUCT_MAX_DIM`) rather than a BLAS call: the weights streamed
  from memory at 11-14 GB/s on one and two threads of these cores, against 6-7 GB/s through the
  BLAS's product of one row (f32, weights beyond the caches; benchmarks/RESULTS.md, session 22).
  Its sums are taken in another order than the BLAS's (float32 products ~1e-6 relative apart).
  Products of more rows keep the BLAS: the same reduction of 4 to 16 rows was slower."""


class CompileUnavailable(RuntimeError):
    """``--compile decode`` cannot be served here; the message says why."""


@dataclasses.dataclass(frozen=True)
class WarmUpPeers:
    """The processes of one host that warm up the same model at once (:meth:`CompiledDecode.warm_up`):
    this one's ``index`` of ``count``, and ``wait()``, which returns once every one has called it."""

    index: int
    count: int
    wait: Callable[[], None]


def inductor_cache_dir() -> str:
    """Where inductor's on-disk caches go: ``TORCHINDUCTOR_CACHE_DIR`` if set, else under
    hsdp-serve's cache directory (kept between starts, unlike /tmp in a container). The
    launcher sets the variable before any rank starts: inductor reads it once."""
    from loaders.sources.default_model import cache_root

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_root(), "inductor")


def import_compiler_in_background(device_type: str) -> threading.Thread:
    """Imports dynamo and inductor, and on CPU has inductor pick its vector ISA (it compiles a probe),
    on a daemon thread: 2.6 s of a compiled start on these cores whose cache is filled, done while
    the rank loads its shards (reading and copying, mostly outside the GIL) rather than after.
    A failure here is left to the compile to report."""
    from shard_engine.torch_private import import_compiler

    def work():
        try:
            import_compiler(device_type)
        except Exception:  # noqa: BLE001 - CompiledDecode raises CompileUnavailable with the reason
            logger.debug("importing the compiler ahead failed", exc_info=True)

    thread = threading.Thread(target=work, name="import-compiler", daemon=True)
    thread.start()
    return thread


def _layer_forward(layer: nn.Module, *args, **kwargs):
    """A decoder layer's own forward, its class's (the instance's is :class:`_CompiledLayers`'s
    wrapper around this, compiled). A layer whose forward keeps its keywords from its attention
    (:data:`server.engine.adapters.POOLS_KEYWORD` names its cache's keyword), and a stateful
    model's layer (its states under :data:`LAYER_STATES`), get their pools (and states) in place of
    the cache (:class:`server.engine.attention.LayerPools`), passed by keyword or by position."""
    keyword = getattr(layer, POOLS_KEYWORD, None)
    states = kwargs.pop(LAYER_STATES, None)
    if states is not None:  # a stateful model's layer: its cache keyword's (none: its states found by its index)
        keyword = next((k for k, v in kwargs.items() if isinstance(v, PagedKVCache)), None)
        # passed by position (RecurrentGemma's); looked for only then: dynamo specializes every argument looked at
        # (Zamba2's layers take their index as an int: a graph a layer)
        at = None if keyword is not None else next((i for i, v in enumerate(args) if isinstance(v, PagedKVCache)),
                                                   None)
        if at is not None and LAYER_POOLS in kwargs:
            args = (*args[:at], LayerPools(args[at].layout, kwargs.pop(LAYER_POOLS), states), *args[at + 1:])
    if keyword is not None and LAYER_POOLS in kwargs:
        kwargs[keyword] = LayerPools(kwargs[keyword].layout, kwargs.pop(LAYER_POOLS), states)
    return type(layer).forward(layer, *args, **kwargs)


def _head_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The output head of one row (:class:`_CompiledHead`)."""
    return torch.nn.functional.linear(x, weight, bias)


class _CompiledHead:
    """The output head (an ``nn.Linear`` whose forward is its class's) of a step of one sequence,
    through a graph of its own: inductor makes a product of one row a reduction it generates
    itself (``decompose_mm_pass``, :data:`INDUCTOR_OPTIONS`), which streams the weight at about
    twice the speed of the BLAS call on these cores (SmolLM2-135M's tied 49152 x 576 head in
    float32: ~17 ms a step through ``F.linear``). Traced at the warm-up's first one-sequence
    step, called as plain code after it (no guards: :meth:`call` admits one row only), not kept
    on disk (a trace of one product: well under a second)."""

    def __init__(self, model: nn.Module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head if type(head) is nn.Linear and "forward" not in vars(head) else None
        self.compiled = torch.compile(_head_forward, dynamic=False, fullgraph=True, options=INDUCTOR_OPTIONS)
        self.graph = None  # a shard_engine.torch_private.CompiledCall, once traced

    @contextlib.contextmanager
    def installed(self, tracing: bool) -> Iterator[None]:
        """Within, the head's forward of one row is its graph (traced now if ``tracing`` and none is)."""
        if self.head is None or (self.graph is None and not tracing):
            yield
            return
        object.__setattr__(self.head, "forward", functools.partial(self.call, tracing))
        try:
            yield
        finally:
            object.__delattr__(self.head, "forward")

    def call(self, tracing: bool, x: torch.Tensor) -> torch.Tensor:
        head = self.head
        if x.shape[:-1].numel() != 1 or (self.graph is None and not tracing):
            return type(head).forward(head, x)
        x = x.contiguous()  # the strides it was traced at (its code checks none)
        if self.graph is None:
            from shard_engine.torch_private import CompiledCall

            self.graph = CompiledCall.trace(self.compiled, (x, head.weight, head.bias), {})
            return _call_and_go_direct(self.graph, "the head's graph", x, head.weight, head.bias)
        return self.graph.call(x, head.weight, head.bias)


def _complex_rope(model: nn.Module) -> nn.Module | None:
    """``model``'s rotary module where it gives complex frequencies (DeepSeek-V2's ``freqs_cis``)
    rather than cos and sin; else None."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            buffer = next(iter(module.buffers()), None)
            device = buffer.device if buffer is not None else torch.device("cpu")
            try:
                with torch.no_grad():
                    out = module(torch.zeros(1, 2, 1, device=device), torch.arange(2, device=device)[None])
            except TypeError:  # a rope per layer type (Gemma 3: cos and sin)
                return None
            return module if isinstance(out, torch.Tensor) and out.is_complex() else None
    return None


def _rotate_by_real_pairs(apply_complex):
    """DeepSeek-V2's ``apply_rotary_emb`` that also takes its frequencies as real pairs
    (``view_as_real(freqs_cis)``, [..., dim/2, 2]): each (even, odd) pair of the query and key
    rotated as the complex product computes it, (a c - b s, a s + b c), in float32. Complex
    frequencies go to the module's own function."""
    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor):
        if freqs.is_complex():
            return apply_complex(xq, xk, freqs)
        cos, sin = freqs[..., 0].unsqueeze(1).to(xq.device), freqs[..., 1].unsqueeze(1).to(xq.device)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)

    apply_rotary_emb.hsdp_real_pairs = True
    return apply_rotary_emb


@contextlib.contextmanager
def _real_valued_rope(rotary: nn.Module | None) -> Iterator[None]:
    """Within, a complex rope's rotary module (:func:`_complex_rope`) gives its frequencies as real
    pairs, which its modeling module's ``apply_rotary_emb`` takes (:func:`_rotate_by_real_pairs`):
    a compiled layer's graph then has no complex input, whose views inductor specialized to one
    step's size. The rotary module runs eagerly, before the layers."""
    if rotary is None:
        yield
        return
    modeling = sys.modules[type(rotary).__module__]
    if not getattr(modeling.apply_rotary_emb, "hsdp_real_pairs", False):
        modeling.apply_rotary_emb = _rotate_by_real_pairs(modeling.apply_rotary_emb)
    forward = type(rotary).forward
    object.__setattr__(rotary, "forward", lambda *args, **kwargs: torch.view_as_real(forward(rotary, *args, **kwargs)))
    try:
        yield
    finally:
        object.__delattr__(rotary, "forward")


class _CompiledLayers:
    """``--compile-region layer``: the model's decoder layers (``detect_decoder_layer_names``), each
    run through a graph of one compiled function of the layer, so that dynamo traces a layer rather
    than the model, and every layer of a kind shares its graph (parameters are inputs of it:
    dynamo's inlined modules). Each layer's ``forward``, within :meth:`installed`, is its graph
    with its own KV pools as the keyword :data:`server.engine.attention.LAYER_POOLS` (not found by
    its ``layer_idx``, a constant that would make a graph of each); the rest of the model
    (embeddings, final norm, head, masks) runs eagerly around them.

    The graphs are traced ahead of time (:class:`shard_engine.torch_private.CompiledCall`) during
    the warm-up (:attr:`compiling`): each layer's inputs at each graph size and thread count find
    the graph whose guards pass on them, or trace one. After it, a layer calls its graph's code
    directly: no dynamo frame, no guards (dynamo's frame hook, guards and wrappers cost a layer
    ~0.1 ms a call on these cores), which is safe because :meth:`CompiledDecode.pad` admits only
    steps of the sizes the warm-up ran and each layer calls the graph it was matched to. A graph's
    first warm-up call also tries it past AOTAutograd's runtime wrapper (~20 us of a tiny layer's
    ~130; kept where that computes anything else: ``CompiledCall.go_direct``)."""

    def __init__(self, model: nn.Module):
        from shard_engine.units import detect_decoder_layer_names

        self.layers: list[tuple[nn.Module, int]] = []  # (layer, its pools' index)
        names = detect_decoder_layer_names(model)
        for name in names:
            if any(name.startswith(other + ".") for other in names):
                continue  # a layer inside a layer (Zamba's hybrid layers hold a Mamba layer): the outer one's graph
            layer = model.get_submodule(name)
            index = next((m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)
            if index is None or "forward" in vars(layer):
                why = "has no layer_idx" if index is None else "has a forward of its own instance"
                raise CompileUnavailable(f"--compile-region layer: decoder layer {name} ({type(layer).__name__}) {why}; "
                                         "--compile-region model compiles the whole forward instead")
            self.layers.append((layer, index))
        if not self.layers:
            raise CompileUnavailable("--compile-region layer: the model has no repeated decoder layers; "
                                     "--compile-region model compiles the whole forward instead")
        self.complex_rope = _complex_rope(model)  # its frequencies as real pairs within (_real_valued_rope)
        self.compiled = torch.compile(_layer_forward, dynamic=False, fullgraph=True, options=INDUCTOR_OPTIONS)
        self.store = None  # a server.engine.graph_store.GraphStore (set by each warm-up), or None: none kept
        self.graphs: list = []  # the graphs traced in this process (CompiledCall), matched by their guards
        self.assigned: dict[str, list] = {}  # graph ("1" or "2+") -> each layer's graph
        self.unchecked: set[int] = set()  # ids of loaded graphs not yet checked against eager
        self.calls: dict[str, list] = {}  # after the warm-up: each layer's graph's code
        self.saved: set[str] = set()  # the graphs this warm-up saved
        self.threads = 0  # the intra-op threads of the warm-up (what the store files its graphs under)
        self.compiling = False  # the warm-up: each layer's inputs matched to a graph, or one traced
        self.mark_rows = False  # ... of the open graph: the rows' dimension of each layer's inputs symbolic
        self.head = _CompiledHead(model)  # the output head of a sequence alone

    def start_warm_up(self, threads: int) -> None:
        self.assigned, self.calls, self.unchecked, self.saved = {}, {}, set(), set()
        self.compiling, self.threads = True, threads

    def loaded(self) -> int:
        """The graphs loaded from the store (and kept) by the last warm-up."""
        return len({id(g) for graphs in self.assigned.values() for g in graphs if g is not None and not g.traced})

    def loaded_whole(self, graph: str) -> bool:
        """Whether every layer's ``graph`` was loaded from disk and has been checked."""
        graphs = self.assigned.get(graph)
        return bool(graphs) and all(g is not None and not g.traced and id(g) not in self.unchecked for g in graphs)

    def save_traced(self) -> None:
        """The graphs traced in this warm-up and not yet saved, saved."""
        for key, graphs in self.assigned.items():
            if self.store is not None and key not in self.saved and any(g is not None and g.traced for g in graphs):
                self.store.save(key, self.threads, graphs)
                self.saved.add(key)

    def end_warm_up(self, completed: bool) -> None:
        """Each layer's graph's code from now on; the entries traced in this warm-up saved."""
        self.compiling = False
        if not completed:
            return
        self.save_traced()
        self.calls = {key: [g.call for g in graphs] for key, graphs in self.assigned.items()}

    @contextlib.contextmanager
    def installed(self, cache, graph: str, threads: int) -> Iterator[None]:
        """Within, each layer runs its ``graph`` (:meth:`CompiledDecode._graph_of`: a static size,
        ``"1"``, or the open one, ``"2+"``), entered at ``threads`` (any count after the warm-up:
        :data:`INDUCTOR_OPTIONS`), reading and writing ``cache``'s pools."""
        key = graph
        if self.compiling and key not in self.assigned:
            loaded = self.store.load(graph, self.threads, _layer_forward, len(self.layers)) if self.store else None
            self.assigned[key] = loaded or [None] * len(self.layers)
            self.unchecked |= {id(g) for g in loaded or ()}
        calls = None if self.compiling else self.calls[key]
        for i, (layer, index) in enumerate(self.layers):  # object's setattr: nn.Module's checks cost 24 layers ~0.1 ms
            # an MLA cache's one pool a layer: its values are a view of it (server.engine.mla)
            pools = (cache.keys[index],) if cache.values_in_keys else (cache.keys[index], cache.values[index])
            extra = {LAYER_POOLS: pools}
            if cache.states is not None:  # a stateful model's (server.engine.state)
                extra[LAYER_STATES] = cache.states.of_layer(index)
            forward = (functools.partial(self._match, i, key, extra) if calls is None else
                       functools.partial(_run_graph, calls[i], layer, threads, extra))
            object.__setattr__(layer, "forward", forward)
        cache.pools_in_kwargs = True
        try:
            # traced (and guards evaluated) with a sequence alone's attention in its graph
            # a sequence alone's products as inductor's reductions, not packed linears (plain_forwards);
            # the open graph's attention one op over the step, whatever it carries (whole_step_op)
            open_graph = graph.endswith("+")
            with one_decode_inline() if self.compiling else contextlib.nullcontext(), \
                    _real_valued_rope(self.complex_rope), \
                    self.head.installed(self.compiling) if graph == "1" else contextlib.nullcontext(), \
                    plain_forwards(layer for layer, _ in self.layers) if graph == "1" and self.compiling \
                    else contextlib.nullcontext(), \
                    whole_step_op() if open_graph and self.compiling else contextlib.nullcontext(), \
                    step_layout(cache.layout) if open_graph else contextlib.nullcontext():
                yield
        finally:
            cache.pools_in_kwargs = False
            for layer, _ in self.layers:
                object.__delattr__(layer, "forward")

    def _match(self, i: int, key: str, extra: dict, *args, **kwargs):
        """The warm-up's call of layer ``i`` at ``key``: its loaded graph (checked against eager on
        first use), else the traced graph whose guards pass on its inputs, traced now if none does."""
        layer = self.layers[i][0]
        if self.mark_rows:
            _mark_rows(args, kwargs)
        kwargs.update(extra)  # the layer's pools (and states)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        graphs = self.assigned[key]
        graph = graphs[i]
        if graph is not None and not graph.traced:
            if id(graph) in self.unchecked:
                why = _disagreement(graph, layer, args, kwargs)
                if why:
                    self.store.drop(key, self.threads, f"decoder layer {i}'s graph {why}")
                    self.unchecked -= {id(g) for g in graphs}
                    graphs[:] = [None] * len(graphs)
                    return self._match(i, key, extra, *args, **kwargs)
                self.unchecked.discard(id(graph))
            return _call_and_go_direct(graph, f"decoder layer {i}'s graph", layer, *args, **kwargs)
        fit = next((g for g in self.graphs if g.fits(layer, *args, **kwargs)), None)
        if graph is not None and fit is not graph:
            raise CompileUnavailable(f"--compile-region layer: the graph of decoder layer {i} ({type(layer).__name__}) "
                                     "specializes on the context length or the open graph's batch; "
                                     "--compile-region model instead")
        if fit is None:
            from shard_engine.torch_private import CompiledCall

            forward = vars(layer).pop("forward")  # this wrapper: not part of the layer's state that dynamo pickles
            try:
                fit = CompiledCall.trace(self.compiled, (layer, *args), kwargs)
            finally:
                object.__setattr__(layer, "forward", forward)
            self.graphs.append(fit)
        graphs[i] = fit
        return _call_and_go_direct(fit, f"decoder layer {i}'s graph", layer, *args, **kwargs)


def _call_and_go_direct(graph, name: str, /, *args, **kwargs):
    """A warm-up's call of ``graph`` (a CompiledCall, ``name`` in the log); on a graph's first call,
    its code entered directly from then on where that is the same (``CompiledCall.go_direct``)."""
    restore = _states_restorer(args, kwargs)
    output = graph.call(*args, **kwargs)
    if not graph.direct_tried:
        why = graph.go_direct(args, kwargs, output, before_again=restore)
        if why:
            logger.info("compiled decode: %s keeps AOTAutograd's wrapper (%s)", name, why)
    return output


def _disagreement(graph, layer: nn.Module, args, kwargs) -> str | None:
    """Why a loaded graph's output on a layer's warm-up inputs is not eager's (None: it is, to 1e-2
    of its norm in float32, 5e-2 in 16-bit types: a graph of other code is far off, or fails).
    Both write the same keys and values."""
    restore = _states_restorer(args, kwargs)
    expected = _layer_forward(layer, *args, **kwargs)
    if restore is not None:
        restore()
    try:
        got = graph.call(layer, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a graph that fails is traced again
        return f"fails ({type(e).__name__}: {e})"
    expected, got = (x[0] if isinstance(x, tuple) else x for x in (expected, got))
    if got.shape != expected.shape:
        return f"computes {tuple(got.shape)}, eager {tuple(expected.shape)}"
    error = float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))
    tolerance = 1e-2 if expected.element_size() >= 4 else 5e-2
    return None if error <= tolerance else f"is {error:.2g} of the norm from eager"


def _states_restorer(args, kwargs) -> Callable[[], None] | None:
    """For a stateful layer's warm-up call (its states among ``kwargs``: :data:`LAYER_STATES`): a
    function that puts the states of the step's slots back as they are now, so that a second call,
    a check of the first, starts from the same states (None for a layer without)."""
    states = kwargs.get(LAYER_STATES)
    if states is None:
        return None
    cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, PagedKVCache)), None)
    if cache is None:
        return None
    slots = cache.layout.state_slots_S
    saved = {key: t.index_select(0, slots) for key, t in states.tensors.items()}

    def restore() -> None:
        for key, t in saved.items():
            states.tensors[key].index_copy_(0, slots, t)

    return restore


def _run_graph(call, layer: nn.Module, threads: int, extra: dict, *args, **kwargs):
    """A decoder layer's forward after the warm-up: its graph's code, entered at ``threads``, with
    its pools (and states) as ``extra`` keywords."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return call(layer, *args, **kwargs, **extra)


def _mark_rows(args, kwargs) -> None:
    """Marks dynamic the rows' dimension (1) of a layer's tensor inputs that have it: [1, rows, ...]
    where rows is the hidden states' (the first argument's) second dimension."""
    hidden = args[0] if args else kwargs["hidden_states"]
    rows = hidden.shape[1]
    stack = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == rows:
                torch._dynamo.mark_dynamic(value, 1)
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())


class CompiledDecode:
    """The compiled decode forward of one rank's model. :meth:`pad` turns a decode-only step's
    inputs into a bucket's, or says it has none; ``forward(**kwargs)`` is then the model's forward
    (same arguments, same output) over the padded rows. ``sizes``: the graphs, a
    :class:`server.config.CompileSizes`."""

    def __init__(self, model: nn.Module, sizes, region: str = "layer", graph_dir: str | None = None):
        from shard_engine.direct import DirectForward

        from server.engine.state import stateful, uses_cache

        self.stateful = stateful(model)  # its steps with prompt chunks or first states run eagerly
        self.use_cache = uses_cache(getattr(model, "config", None))  # what the steps pass (none: a plain module)
        try:
            self._direct = DirectForward(model)
        except ValueError as e:
            raise CompileUnavailable(f"--compile decode: {e} (every unit must be resident: --resident-units all, "
                                     "or auto on CPU ranks of one host)") from None
        from shard_engine.torch_private import decompose_one_row_products

        decompose_one_row_products(ONE_ROW_PRODUCT_MAX_DIM)
        self.sizes = sizes
        self._model = model
        self.graph_dir = None  # the layers' graphs on disk (server.engine.graph_store): "" for none
        if region == "model":
            self._layers = None
            self._compiled = torch.compile(model.forward, dynamic=False, options=INDUCTOR_OPTIONS)
        elif region == "layer":
            self._layers = _CompiledLayers(model)
            self.graph_dir = graph_dir if graph_dir is not None else os.path.join(inductor_cache_dir(),
                                                                                   "hsdp-layer-graphs")
            self._compiled = model.forward  # eager around the layers
        else:
            raise ValueError(f"--compile-region: {region!r} is neither layer nor model")
        self.calls = 0  # decode forwards run compiled, warm-up included
        self.whole_steps = 0  # steps that carry prompt chunks run through the open graph (takes_whole_step)
        self.warm = False
        # the model's graph: guards skipped after the warm-up (:meth:`_stance`); off for good after a
        # call no graph fit (the layers' graphs are called without guards: pad() admits what they fit)
        self.skip_guards = True
        self.threads = torch.get_num_threads()  # the warm-up's: the count each graph is compiled at
        self.padded_rows = 0  # rows computed only to fill a bucket, warm-up included
        self.warm_up_padded_rows = 0  # ... of which the warm-up's
        self.batches: set[int] = set()  # the batches run compiled since the warm-up
        self.graphs_loaded = 0  # the layers' graphs the last warm-up loaded from disk instead
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
        if self.stateful and any(start == 0 for start, _, _ in items):  # a state begins: eagerly (server.engine.state)
            return False
        extra = bucket - len(ids)
        ids += [0] * extra
        positions += [0] * extra
        items += [(0, 1, [scratch_block])] * extra
        keep += [bucket - 1] * (bucket - len(keep))  # a static size: the logits of padding rows, dropped
        self.padded_rows += extra
        return True

    def takes_whole_step(self, rows: int) -> bool:
        """Whether a step that carries prompt chunks (``rows`` tokens in all) runs through the layers'
        open graph, whose attention is one op over whatever the step carries (the decoding
        sequences, the chunks: ``attention.whole_step_op``): with the layer region, an open size,
        and at least its rows. The model's graph, and static sizes, hold decode steps only."""
        if self._layers is None or self.stateful or not self.sizes.in_open_graph(rows):
            return False
        self.whole_steps += 1
        return True

    def entry_threads(self, threads: int) -> int:
        """The intra-op threads a forward whose plan carries ``threads`` (0: none) is entered at: the
        layers' graphs at that count (their kernels take it when they run: :data:`INDUCTOR_OPTIONS`),
        the model's graph at the count it was compiled at (dynamo guards on it; its opaque ops then
        switch to the plan's: :func:`server.engine.cores.threads_inside`)."""
        return (threads or self.threads) if self._layers is not None else self.threads

    def forward(self, threads: int = 0, **kwargs):
        """The model's forward over a padded decode step, entered at :meth:`entry_threads`;
        ``threads``: the intra-op threads its opaque ops run at (the plan's, :mod:`server.engine.cores`;
        0: the graphs' own count)."""
        self.calls += 1
        batch = kwargs["input_ids"].shape[1]
        if self.warm:
            self.batches.add(batch)
        if not self.warm or self._layers is None:  # dynamo traces (the layers' graphs: at warm-up only)
            self._mark_dynamic(kwargs)
        try:
            with threads_inside(threads):
                return self._call(kwargs, self.entry_threads(threads))
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
                return self._call(kwargs, self.threads)

    def _graph_of(self, batch: int) -> str:
        """The graph a padded step of ``batch`` rows runs in: its static size (``"1"``), or the open one
        (``"2+"``)."""
        return f"{self.sizes.open_from}+" if self.sizes.in_open_graph(batch) else str(batch)

    def _mark_dynamic(self, kwargs) -> None:
        layout = kwargs["hsdp_paged"]
        decode = layout.decode
        # the context length varies every step: symbolic (it only sizes the attention op's inputs)
        for tensor, dim in ((decode.slots_SL, 1), (decode.valid_SL, 1), (decode.positions_L, 0)):
            torch._dynamo.mark_dynamic(tensor, dim)
        if self.sizes.in_open_graph(kwargs["input_ids"].shape[1]):
            # the open graph's: the batch is symbolic in every input that has it
            for tensor, dim in ((kwargs["input_ids"], 1), (kwargs["position_ids"], 1), (kwargs["logits_to_keep"], 0),
                                (layout.slots_T, 0), (decode.rows_S, 0), (decode.slots_SL, 0), (decode.valid_SL, 0),
                                (decode.contexts_S, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
            if layout.state_slots_S is not None:  # a stateful model's (server.engine.state)
                torch._dynamo.mark_dynamic(layout.state_slots_S, 0)

    def _call(self, kwargs, entry_threads: int):
        # specialize_float: the modules' float attributes (norm epsilons, scales) are constants.
        # As symbolic floats, torch 2.13 traced every graph twice (its pass that turns them into
        # tensors gave up and restarted the analysis with them specialized).
        if self._layers is not None:
            graph = self._graph_of(kwargs["input_ids"].shape[1])
            tracing = (torch._dynamo.config.patch(specialize_float=True) if self._layers.compiling
                       else contextlib.nullcontext())
            with self._direct(), tracing, self._layers.installed(kwargs["cache"], graph, entry_threads):
                return self._compiled(**kwargs)
        # recompile_limit: a graph per static size and the open one (a recompile past it would run eagerly)
        limit = self.sizes.graphs + 1
        with self._direct(), torch._dynamo.config.patch(specialize_float=True, recompile_limit=limit), \
                self._stance():
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

    def warm_up(self, cache, block_size: int, device: torch.device, peers: WarmUpPeers | None = None) -> float:
        """Compile now: for every static size, decode forwards of one sequence at each of
        :data:`WARM_UP_CONTEXTS` (padded to the size, as a step would be); for the open size, one at
        that size and one at the next, so that the batch is seen to vary. Their keys and values go
        to block 0 of ``cache`` (free at startup), at the rank's intra-op thread count. Returns the seconds
        it took; raises CompileUnavailable naming what failed. The model's graph: a forward that
        specializes on the open graph's batch (a graph per batch after all) is warned about, and its
        other batches run eagerly; a layer's graph that does: refused (CompileUnavailable).
        ``peers``: the processes warming up the same model at the same time (every rank, each with
        its index and count among its host's), among which the layers' graphs are shared out on CPU:
        each compiles its share of the entries and saves it, all wait at one barrier, and each loads
        the rest. Every peer reaches the barrier once, a failing one too (then raises after it)."""
        self.warm = False  # every guard evaluated: a new pool (another engine's) compiles anew
        # the entries: each graph's warm-up calls, (bucket, context)
        entries = [[(bucket, context) for context in WARM_UP_CONTEXTS] for bucket in self.sizes.static]
        if self.sizes.open_from is not None:
            entries.append([(self.sizes.open_from + i, context) for i, context in enumerate(WARM_UP_CONTEXTS)])
        # shared out where the peers read one directory and the same graphs fit them all (a CUDA
        # graph's code names its device): decided alike on every rank, so all reach the barrier
        shared = (peers is not None and self._layers is not None and bool(self.graph_dir)
                  and device.type == "cpu")
        mine = entries[peers.index::peers.count] if shared else entries
        rest = [e for i, e in enumerate(entries) if i % peers.count != peers.index] if shared else []
        counter = torch._dynamo.utils.counters["stats"]
        graphs = counter["unique_graphs"]
        specialized = []  # the model's graph: sizes whose second warm-up call compiled again
        start = time.monotonic()
        completed = waited = False
        try:
            torch.set_num_threads(self.threads)  # every graph's (the layers' serve every count after it)
            if max(WARM_UP_CONTEXTS) > block_size * cache.num_blocks:
                raise CompileUnavailable("--compile decode: the KV cache is too small to warm up in")
            # the pools' slot count (the KV budget, sized from free memory at every start) as one
            # symbol: a graph of fixed sizes otherwise, whose cache on disk a new budget would miss
            for pool in cache.keys + ([] if cache.values_in_keys else cache.values):
                torch._dynamo.mark_dynamic(pool, 1)
            if self._layers is not None:  # each layer matched to its graphs anew (this cache's pools)
                self._layers.store = self._store(device, block_size)
                self._layers.start_warm_up(self.threads)
                graphs = len(self._layers.graphs)
            self._warm_up_entries(mine, cache, block_size, device, counter, specialized)
            if shared:  # this process's share saved; the others' loaded once every peer has saved its own
                self._layers.save_traced()
                waited = True
                peers.wait()
            self._warm_up_entries(rest, cache, block_size, device, counter, specialized)
            completed = True
        except BaseException:
            if shared and not waited:  # the peers are not left waiting: they go on, and this rank fails
                with contextlib.suppress(Exception):
                    peers.wait()
            raise
        finally:
            torch.set_num_threads(self.threads)
            if self._layers is not None:
                self._layers.end_warm_up(completed)
        self.graphs_compiled = (counter["unique_graphs"] if self._layers is None else len(self._layers.graphs)) - graphs
        self.graphs_loaded = 0 if self._layers is None else self._layers.loaded()
        if specialized:
            logger.warning("compiled decode: the model's forward specializes on the context or the batch (%s compiled "
                           "again at their second warm-up step, %d graphs in all): steps of sizes not warmed up run "
                           "eagerly", ", ".join(specialized), self.graphs_compiled)
        self.warm_up_padded_rows = self.padded_rows
        self.warm = True
        return time.monotonic() - start

    def _warm_up_entries(self, entries, cache, block_size: int, device: torch.device, counter,
                         specialized: list[str]) -> None:
        for calls in entries:
            for i, (bucket, context) in enumerate(calls):
                if i and self._layers is not None and self._layers.loaded_whole(self._graph_of(bucket)):
                    break  # graphs loaded and checked: nothing to see the context vary for
                before = counter["unique_graphs"]
                self._warm_up_call(cache, block_size, device, bucket, context)
                if i and counter["unique_graphs"] > before:
                    specialized.append(f"{bucket}+" if self.sizes.in_open_graph(bucket) else str(bucket))

    def _store(self, device: torch.device, block_size: int):
        """The layers' graphs on disk for this model, device and block size; None without (no
        directory, or its key cannot be made: then each start traces, with a warning)."""
        if not self.graph_dir:
            return None
        from server.engine.graph_store import GraphStore, store_key

        try:
            return GraphStore(self.graph_dir, store_key(self._model, [layer for layer, _ in self._layers.layers],
                                                         device, block_size))
        except Exception as e:  # noqa: BLE001 - the graphs serve this start either way
            logger.warning("compiled decode: the layers' graphs will not be kept on disk (%s: %s)", type(e).__name__, e)
            return None

    def _warm_up_call(self, cache, block_size: int, device: torch.device, bucket: int, context: int) -> None:
        """One warm-up forward: a sequence of ``context`` tokens padded to ``bucket``, at the warm-up's threads."""
        from server.engine.attention import PagedLayout

        ids, positions, keep = [1], [context - 1], [0]
        items = [(context - 1, 1, list(range(-(-context // block_size))))]
        self.pad(ids, positions, items, keep, cache.scratch_block, bucket=bucket)
        # a stateful model's: every row's state in the scratch slot (nobody's)
        states = [cache.states.add_scratch_slot()] * len(items) if self.stateful else None
        layout = PagedLayout.build(items, block_size, device, states)
        cache.layout = layout
        if self._layers is not None:  # the open graph's: the layers' inputs of the step's rows symbolic too
            self._layers.mark_rows = self.sizes.in_open_graph(bucket)
        try:
            with torch.no_grad():
                self.forward(threads=self.threads, input_ids=torch.tensor([ids], device=device),
                             position_ids=torch.tensor([positions], device=device), cache=cache,
                             use_cache=self.use_cache,
                             logits_to_keep=torch.tensor(keep, device=device), hsdp_paged=layout)
        except CompileUnavailable:
            raise
        except Exception as e:
            raise CompileUnavailable(f"--compile decode: torch.compile failed ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''})") from e
        finally:
            cache.layout = None
            if self._layers is not None:
                self._layers.mark_rows = False
