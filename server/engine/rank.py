"""The per-rank engine: the sequences this rank owns, its KV pool, and one forward per step.

Every rank runs exactly one forward per step that has work anywhere in the group, because the
FSDP all-gathers inside forward are collectives. A rank computes only what the plan gives it:
chunks of its sequences' tokens, packed into one row, their keys and values written into the
blocks rank 0 assigned (:mod:`server.engine.attention`), and a next token for each sequence whose
last token was computed (:mod:`server.engine.sampling`). A rank with nothing to do runs a
one-token forward to keep the all-gathers matched.
The engine knows nothing of HTTP, of text, or of the control channel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from server.engine.attention import PagedKVCache, PagedLayout, use_paged_attention
from server.engine.plan import PromptLogprobs, SequenceAdd, StepPlan, StepResult, TokenResult, Work
from server.engine.adapters import install as install_adapters, kv_heads as adapted_kv_heads
from server.engine.capability import ATTENTION_LAYER_TYPES
from server.engine.state import HYBRID_LAYER_TYPES, StatePool, StateShapes, install as install_state, \
    is_stateful_config, state_shapes, uses_cache
from server.engine.mla import install as install_mla, is_mla, latent_geometry
from server.engine.multimodal import GridRope, ImageEncoder, placeholder_ids, takes_images
from server.engine.rope import install as install_rope, sequence_lengths, token_lengths
from server.engine.sampling import BatchSampler, Row, RowMasks

logger = logging.getLogger(__name__)
CPU_KV_SHARE = 0.2
"""``--kv-cache-memory auto`` on CPU: this share of the node's available memory, split between its ranks."""
GPU_KV_SHARE = 0.9
GPU_ACTIVATION_HEADROOM = 1 << 30
MEMORY_REPORT_EVERY_S = 5.0
TRIM_WHEN_IDLE_EVERY_S = 10.0
STATE_ONLY_BLOCKS = 1 << 16
"""Blocks of a model with no attention layer (Mamba2): they hold nothing, and only count tokens."""


@dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """What one token of KV cache costs on a rank, from the model's config."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    value_dim: int | None = None  # where it differs from head_dim
    values_in_keys: bool = False  # multi-head latent attention: the values are the keys' first value_dim
    kv_layers: tuple[int, ...] | None = None  # a hybrid's attention layers (the others keep state); None: all

    @property
    def cached_layers(self) -> int:
        return self.num_layers if self.kv_layers is None else len(self.kv_layers)

    @property
    def bytes_per_token(self) -> int:
        values = 0 if self.values_in_keys else (self.value_dim or self.head_dim)
        return (self.cached_layers * self.kv_heads * (self.head_dim + values)
                * torch.empty((), dtype=self.dtype).element_size())

    def describe(self) -> dict:
        """For /info: the cache's layout a layer and a token, and its bytes a token (all layers)."""
        return {"layout": "latent" if self.values_in_keys else "heads", "kv_heads": self.kv_heads,
                "key_dim": self.head_dim, "value_dim": self.value_dim or self.head_dim,
                "values_in_keys": self.values_in_keys, "dtype": str(self.dtype).removeprefix("torch."),
                "bytes_per_token": self.bytes_per_token,
                "bytes_per_token_per_layer": self.bytes_per_token // max(1, self.cached_layers),
                "layers": self.cached_layers}

    @classmethod
    def of(cls, model: nn.Module) -> KVGeometry:
        config = model.config.get_text_config()
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        if is_mla(config):  # one cached "head" a token: the latent and the rope key (server.engine.mla)
            key_dim, value_dim = latent_geometry(config)
            return cls(num_layers=config.num_hidden_layers, kv_heads=1, head_dim=key_dim, dtype=dtype,
                       value_dim=value_dim, values_in_keys=True)
        kv_layers = None
        if is_stateful_config(config):  # a hybrid: only its attention layers cache keys and values
            cached = ATTENTION_LAYER_TYPES | HYBRID_LAYER_TYPES
            # (no layer types: every layer stateful, xLSTM's)
            kv_layers = tuple(i for i, t in enumerate(getattr(config, "layer_types", None) or ()) if t in cached)
            if not kv_layers:  # a state-space model: no attention at all
                return cls(num_layers=config.num_hidden_layers, kv_heads=1, head_dim=1, dtype=dtype, kv_layers=())
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = adapted_kv_heads(config) or getattr(config, "num_key_value_heads", None) or heads
        return cls(num_layers=config.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                   kv_layers=kv_layers)


def size_kv_pool(budget_bytes: int | None, geometry: KVGeometry, block_size: int, device: torch.device,
                 state_bytes: int = 0) -> int:
    """Blocks of ``block_size`` tokens this rank's KV pool holds: ``budget_bytes``, or for None
    (``auto``) a share of the memory available now (the loaded model and gather buffers already
    taken), less ``state_bytes`` (a stateful model's state slots, taken from the same budget).
    Raises ValueError when the states or not even one block fit."""
    block_bytes = geometry.bytes_per_token * block_size
    if budget_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int((free - GPU_ACTIVATION_HEADROOM) * GPU_KV_SHARE)
        else:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            budget_bytes = int(_available_memory() * CPU_KV_SHARE / local_ranks)
    if state_bytes and state_bytes >= budget_bytes:
        raise ValueError(f"--kv-cache-memory: {budget_bytes} bytes do not hold the recurrent states of the sequences "
                         f"a rank runs at once ({state_bytes} bytes; lower --max-concurrent-requests or raise it)")
    if block_bytes == 0:  # a state-space model caches nothing a token: blocks only count its tokens
        return STATE_ONLY_BLOCKS
    blocks = (budget_bytes - state_bytes) // block_bytes
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory: {budget_bytes - state_bytes} bytes hold no KV block of {block_size} "
                         f"tokens ({block_bytes} bytes)" + (f" beside the states' {state_bytes}" if state_bytes else ""))
    return blocks


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.virtual_memory().available


class _Sequence:
    __slots__ = ("seq_id", "tokens", "blocks", "params", "num_generated", "images", "rope", "rope_delta")

    def __init__(self, add: SequenceAdd, grid_rope: GridRope | None = None):
        self.seq_id = add.seq_id
        self.tokens = list(add.tokens)
        self.blocks = list(add.blocks)
        self.params = add.params
        self.num_generated = add.num_generated
        self.images = [[image, None] for image in add.images]  # [ImageInput, its embeddings once encoded]
        # a grid-placed rope's positions of its tokens [3, n] and later tokens' offset (server.engine.multimodal)
        self.rope, self.rope_delta = None, 0
        if grid_rope is not None and add.image_grids:
            self.rope, self.rope_delta = grid_rope.positions(self.tokens, add.image_grids)

    def rope_positions(self, start: int, count: int) -> torch.Tensor:
        """[3, count]: the grid-placed rope's positions of tokens ``start`` .. ``start + count - 1``."""
        end, known = start + count, 0 if self.rope is None else self.rope.shape[1]
        later = torch.arange(max(start, known), end).add_(self.rope_delta).expand(3, -1)
        return torch.cat([self.rope[:, start:end], later], dim=1) if start < known else later

    def image_spans(self, start: int, count: int) -> list[tuple[int, int]]:
        """[start, end) of each image among positions ``start`` .. ``start + count - 1``: whole
        within them from where they start (a chunk never ends inside an image whose tokens see one
        another: ``Scheduler.whole_images``)."""
        spans, end = [], start + count
        for image, _ in self.images:
            first, last = image.start, image.end
            if first < end and last > start:
                if last > end:
                    raise ValueError(f"a chunk ends at {end} inside an image at {first}..{last - 1}")
                spans.append((first, last))
        return spans

    def image_rows(self, start: int, count: int) -> list[torch.Tensor]:
        """The embeddings of the image tokens among positions ``start`` .. ``start + count - 1``, in
        order; an image whose last token is among them is let go."""
        rows, end = [], start + count
        for entry in self.images:
            image, features = entry
            first, last = max(start, image.start), min(end, image.end)
            if first < last:
                if image.length:  # its tokens lie among others: count them
                    token = self.tokens[image.start]
                    before = self.tokens[image.start:first].count(token)
                    rows.append(features[:, before:before + self.tokens[first:last].count(token)])
                else:
                    rows.append(features[:, first - image.start:last - image.start])
        self.images = [entry for entry in self.images if entry[0].end > end]
        return rows


class RankEngine:
    """This rank's sequences, its paged KV cache and sampler: :meth:`step` applies rank 0's plan
    (sequences added and removed, the chunks of tokens to compute) and returns the step's
    tokens. Called by the rank's engine loop only (``server.group.control``), one step at a time;
    every rank of a step group calls it for every plan, so that their forwards' collectives match."""

    def __init__(self, model: nn.Module, device: torch.device, rank: int, *, num_blocks: int, block_size: int,
                 tokenizer=None, max_sequences: int = 64, states_per_sequence: StateShapes | None = None):
        self.model, self.device, self.rank = model, device, rank
        self._use_cache = uses_cache(model.config)  # (False for a model that refuses any cache but its own)
        self.tokenizer = tokenizer  # for grammars (constrained decoding), built at their first use
        self._grammar_rows = None
        self.block_size = block_size
        geometry = KVGeometry.of(model)
        self.cache = PagedKVCache(num_layers=geometry.num_layers, num_blocks=num_blocks, block_size=block_size,
                                  kv_heads=geometry.kv_heads, head_dim=geometry.head_dim, dtype=geometry.dtype,
                                  device=device, value_head_dim=geometry.value_dim,
                                  values_in_keys=geometry.values_in_keys, kv_layers=geometry.kv_layers)
        use_paged_attention(model)
        install_mla(model)  # multi-head latent attention over cached latents, where the model has it
        install_adapters(model)  # Bloom's, MPT's and Falcon's own attention code: adapters onto the paged attention
        # hybrid and state-space families: each sequence's conv and recurrent states in a slot of their own, one
        # for each of the ``max_sequences`` this rank runs at most (server.engine.state); ``states_per_sequence``:
        # their shapes where the caller probed them already (server.main, sizing the KV pool)
        self.states = None
        if install_state(model):
            shapes = states_per_sequence if states_per_sequence is not None else state_shapes(model)
            self.states = StatePool(device, shapes, max_sequences)
        self.cache.states = self.states
        self.sampler = BatchSampler()
        self.sequences: dict[int, _Sequence] = {}
        self.sequences_started = 0
        self.tokens_computed = 0
        self.forwards = 0
        self._prompt_logprobs: list[PromptLogprobs] = []  # this step's, for the step's result
        self.fault_at = _injected_fault(rank)
        self.delay_s = _injected_delay(rank)
        self.compiled = None  # a server.engine.compiled.CompiledDecode: decode-only forwards go through it
        self._direct = _direct_forward(model)  # eager forwards without FSDP2's hooks, where every unit is resident
        self._rope = install_rope(model)  # rope frequencies per sequence (dynamic NTK, longrope), or None
        self.images = ImageEncoder(model, device) if takes_images(model) else None  # server.engine.multimodal
        self._grid_rope = GridRope(model) if self.images is not None and GridRope.applies(model) else None
        self._both_ways = self.images is not None and self.images.family.bidirectional
        if self.images is not None:
            self.sampler.never = placeholder_ids(model.config)
        # image key -> embeddings (host memory): exactly what rank 0's ImageCacheBook says this rank holds
        self.image_cache: dict[bytes, torch.Tensor] = {}
        self.memory = None  # a server.group.memory.MemoryReport, reported every few seconds
        self._reported_at = 0.0
        self._trimmed_at, self._forwards_at_trim = 0.0, 0

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.remove:
            self.sequences.pop(seq_id, None)
            if self.states is not None:
                self.states.remove(seq_id)
            if self._grammar_rows is not None:
                self._grammar_rows.forget(seq_id)
        for add in plan.add:
            if add.rank == self.rank:
                self.sequences[add.seq_id] = _Sequence(add, self._grid_rope)
                if self.states is not None:
                    self.states.add(add.seq_id)
                self.sequences_started += 1
                if add.params.grammar is not None:
                    self._start_grammar(self.sequences[add.seq_id])
        failed: list[TokenResult] = []  # sequences whose images cannot go in their placeholders
        if self.images is not None:
            if plan.update is not None:  # embeddings of the old weights
                self.image_cache.clear()
            arrived = [self.sequences[add.seq_id] for add in plan.add if add.rank == self.rank and add.images]
            forget = plan.forget_images.get(self.rank, ())  # as rank 0's ImageCacheBook says
            if plan.encode or arrived:
                failed = self._encode(arrived, plan.threads, plan.encode, set(forget))
            for key in forget:
                self.image_cache.pop(key, None)
        tokens: list[TokenResult] = failed
        self._prompt_logprobs: list[PromptLogprobs] = []
        if plan.forward:
            self.forwards += 1
            if self.fault_at is not None and self.forwards >= self.fault_at:
                raise RuntimeError(f"injected fault in forward {self.forwards} on rank {self.rank}")
            if self.delay_s:
                time.sleep(self.delay_s)
            work = [w for w in plan.work.get(self.rank) or () if w.seq_id in self.sequences]  # less the failed
            tokens += self._forward(work, plan.threads) if work else self._idle_forward()
        elif self.forwards != self._forwards_at_trim and time.monotonic() - self._trimmed_at > TRIM_WHEN_IDLE_EVERY_S:
            # idle after work: what a burst's activations left in the allocator goes back to the system
            from server.group.memory import release_freed_memory

            release_freed_memory()
            self._trimmed_at, self._forwards_at_trim = time.monotonic(), self.forwards
        result = StepResult(
            self.rank, tokens, len(self.sequences), self.sequences_started, self.tokens_computed, os.getpid(),
            prompt_logprobs=self._prompt_logprobs, forwards=self.forwards,
        )
        if self.memory is not None and time.monotonic() - self._reported_at > MEMORY_REPORT_EVERY_S:
            self._reported_at = time.monotonic()
            result.memory = self.memory.snapshot()
        return result

    def _encode(self, sequences: list[_Sequence], threads: int, encode: bool,
                forget: set[bytes] = frozenset()) -> list[TokenResult]:
        """The new sequences' images: those that come with pixels through the image encoder, in one
        call (every rank calls it where the plan says ``encode``), kept in the image cache; the
        others' embeddings from the cache, where rank 0's ImageCacheBook says they are (an image it
        lets go in this step, ``forget``, is never copied there: none is with ``--mm-embedding-cache 0``). A sequence
        with an image whose embeddings do not fill its placeholders (a processor at odds with its
        model) is dropped here, before its forward: one failed result each."""
        entries = [entry for seq in sequences for entry in seq.images]
        new = [entry for entry in entries if not entry[0].cached]
        if encode:
            for entry, features in zip(new, self.images.encode([image for image, _ in new], threads)):
                entry[1] = features
                if entry[0].key not in forget:
                    self.image_cache[entry[0].key] = features.to("cpu", copy=features.device.type != "cpu")
        for entry in entries:
            if entry[0].cached:
                entry[1] = self.image_cache[entry[0].key].to(self.device)
        failed = []
        for seq in sequences:
            wrong = next(((image, rows) for image, rows in seq.images if rows.shape[1] != image.count), None)
            if wrong is not None:
                failed.append(TokenResult(seq.seq_id, -1, 0.0, error=(
                    f"an image encoded to {wrong[1].shape[1]} embeddings for its {wrong[0].count} placeholders")))
                self._drop(seq.seq_id)
        return failed

    def _drop(self, seq_id: int) -> None:
        """Forget a sequence this rank fails (rank 0 frees its blocks when the failure arrives)."""
        del self.sequences[seq_id]
        if self.states is not None:
            self.states.remove(seq_id)
        if self._grammar_rows is not None:
            self._grammar_rows.forget(seq_id)

    @torch.no_grad()
    def _idle_forward(self) -> list[TokenResult]:
        # Matches the other ranks' all-gathers; the result is discarded.
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return []

    @torch.no_grad()
    def _forward(self, work: list[Work], threads: int = 0) -> list[TokenResult]:
        ids, positions, items, sample_rows, sampling, rope_items = [], [], [], [], [], []
        scored = []  # (seq, first row, first position, count): prompt positions whose next token is scored
        image_rows = []  # the embeddings of the image tokens among them, in order (server.engine.multimodal)
        image_spans = [] if self._both_ways else None  # per item: its images whose tokens see one another
        for w in work:
            seq = self.sequences[w.seq_id]
            if image_spans is not None:
                image_spans.append(seq.image_spans(w.start, w.count))
            if seq.images:
                image_rows += seq.image_rows(w.start, w.count)
            seq.blocks += w.new_blocks
            assert w.start + w.count <= len(seq.tokens), (w, len(seq.tokens))
            if seq.params.prompt_logprobs is not None:
                prompt_len = len(seq.tokens) - seq.num_generated
                end = min(w.start + w.count, prompt_len - 1)  # the last prompt position predicts a new token
                if end > w.start:
                    scored.append((seq, len(ids), w.start, end - w.start))
            ids += seq.tokens[w.start:w.start + w.count]
            positions += range(w.start, w.start + w.count)
            items.append((w.start, w.count, seq.blocks))
            if self._rope is not None:
                rope_items.append((w.start, w.count, self._rope.prompt_length(len(seq.tokens), seq.num_generated)))
            if w.start + w.count == len(seq.tokens):  # its last token: a next one is due
                sample_rows.append(len(ids) - 1)
                sampling.append(seq)
        computed = len(ids)
        keep = sample_rows + [row + i for _, row, _, count in scored for i in range(count)]
        decode_only = not scored and all(count == 1 for _, count, _ in items)
        forward = self.model
        extra = {"mm_encoder_outputs": self.images.outputs(image_rows)} if image_rows else {}
        rope_positions = positions  # what the rope takes: the tokens' indices, unless a grid places them
        placed = [self.sequences[w.seq_id] for w in work] if self._grid_rope is not None else []
        if any(seq.rope is not None for seq in placed):
            grid = torch.cat([seq.rope_positions(w.start, w.count) for seq, w in zip(placed, work)], dim=1)
            if torch.equal(grid[0], grid[1]) and torch.equal(grid[0], grid[2]):
                rope_positions = grid[0].tolist()  # no image token: one position a token, as text (compiles too)
            else:  # the model's packed form: the tokens' indices, then the three rows
                extra["position_ids"] = torch.cat([torch.tensor([positions]), grid])[:, None].to(self.device)
        if self.compiled is not None and not extra and (
                self.compiled.pad(ids, rope_positions, items, keep, self.cache.scratch_block) if decode_only
                else self.compiled.takes_whole_step(len(ids))):
            # the layers' graphs at the plan's threads; the model's graph at the count it was compiled at,
            # its opaque ops at the plan's (server.engine.compiled.CompiledDecode.entry_threads)
            forward = functools.partial(self.compiled.forward, threads=threads)
            threads = self.compiled.entry_threads(threads)
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # the idle ranks' cores (server.engine.cores)
        state_slots = None
        if self.states is not None:
            for w in work:
                self.states.starts(w.seq_id, w.start)
            state_slots = [self.states.slot_of[w.seq_id] for w in work]
            # a compiled step's padding rows (CompiledDecode.pad): their states in the scratch slot, nobody's
            state_slots += [self.states.scratch_slot] * (len(items) - len(work))
        layout = PagedLayout.build(items, self.block_size, self.device, state_slots,
                                   image_spans if image_spans and any(image_spans) else None)
        self.cache.layout = layout
        lengths = None
        if self._rope is not None:  # each token's own sequence's length picks its rope frequencies (server.engine.rope)
            lengths = token_lengths(rope_items)
            if len(rope_positions) > lengths.numel():  # a static size's padding rows (position 0)
                lengths = torch.cat([lengths, torch.ones(len(rope_positions) - lengths.numel(), dtype=torch.long)])
        # FSDP2's hooks have nothing to do for resident units, and cost each unit two calls a step
        direct = self._direct if forward is self.model and self._direct is not None and self._direct.resident() else None
        hooks_out = direct() if direct is not None else contextlib.nullcontext()
        extra.setdefault("position_ids", torch.tensor([rope_positions], device=self.device))
        with hooks_out, sequence_lengths(lengths):
            out = forward(
                input_ids=torch.tensor([ids], device=self.device),
                cache=self.cache,
                use_cache=self._use_cache,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                hsdp_paged=layout,
                **extra,
            )
        self.cache.layout = None
        self.tokens_computed += computed
        if scored:
            self._score_prompts(out.logits[0, len(sample_rows):], scored)
        if not sampling:
            return []
        rows = [Row(s.params, s.tokens, s.num_generated) for s in sampling]
        logits = out.logits[0, :len(sample_rows)]
        masks, failed = self._grammar_masks(sampling, rows, logits)
        chosen = None
        if not failed:
            try:
                chosen = self.sampler.sample(logits, rows, masks)
            except Exception:  # noqa: BLE001 - find the row at fault below; the others go on
                pass
        if chosen is None:
            chosen = [failed.get(i) or self._sample_alone(logits[i:i + 1], row, masks and masks.row(i))
                      for i, row in enumerate(rows)]
        # the constrained rows' tokens, fed to their matchers in one call
        fed = [(seq.seq_id, pick[0]) for seq, pick in zip(sampling, chosen)
               if seq.params.grammar is not None and not isinstance(pick, str)]
        outcomes = dict(zip((seq_id for seq_id, _ in fed), self._grammars().accept(fed) if fed else ()))
        results = []
        for seq, pick in zip(sampling, chosen):
            stop, error = outcomes.get(seq.seq_id, (False, None))
            if isinstance(pick, str) or error is not None:
                # a matcher in an error state (a limit reached) fails its sequence: never a stop
                results.append(TokenResult(seq.seq_id, -1, 0.0, error=pick if isinstance(pick, str) else error))
                self._drop(seq.seq_id)
                continue
            token, logprob, top = pick
            seq.tokens.append(token)
            seq.num_generated += 1
            results.append(TokenResult(seq.seq_id, token, logprob, top, stop=stop))
        return results

    def compile_decode(self, compiled=None, sizes=None, region: str | None = None, graph_dir: str | None = None,
                       peers=None) -> float:
        """``--compile decode``: decode-only forwards that ``sizes`` (a CompileSizes; by default the
        device's) has a graph for from now on go through a compiled forward (:mod:`server.engine.compiled`,
        graphs of ``region``, by default ``--compile-region``'s; ``compiled``, a CompiledDecode of this
        engine's model that an earlier engine warmed up, or a new one), warmed up in this engine's KV
        pool now; returns the seconds it took.
        ``graph_dir``: where the layers' graphs are kept between starts (:mod:`server.engine.graph_store`;
        by default beside inductor's cache, "" for nowhere); ``peers``: the ranks of this host warming
        up at once, which share the layers' graphs out (a :class:`server.engine.compiled.WarmUpPeers`).
        Raises CompileUnavailable with the reason where it cannot be."""
        from server.config import ServeConfig
        from server.engine.compiled import CompiledDecode

        defaults = ServeConfig()
        compiled = compiled or CompiledDecode(self.model, sizes or defaults.compile_batch_sizes_for(self.device.type),
                                              region or defaults.compile_region, graph_dir=graph_dir)
        seconds = compiled.warm_up(self.cache, self.block_size, self.device, peers=peers)
        self.compiled = compiled
        return seconds

    def _start_grammar(self, seq: _Sequence) -> None:
        """Build a new sequence's matcher off the step, while the forward runs (a failure to is
        reported by the step that masks it)."""
        generated = seq.tokens[len(seq.tokens) - seq.num_generated:] if seq.num_generated else []
        try:
            self._grammars().start(seq.seq_id, seq.params.grammar, generated)
        except Exception:  # noqa: BLE001 - _grammar_masks fails the sequence with the reason
            pass

    def _grammar_masks(self, sampling: list[_Sequence], rows: list[Row], logits_NV):
        """The constrained rows' masks (one :class:`RowMasks`, or None), and ``{row: why}`` for
        those that cannot go on."""
        constrained = [(i, seq.seq_id, seq.params.grammar, row.generated())
                       for i, (seq, row) in enumerate(zip(sampling, rows)) if seq.params.grammar is not None]
        if not constrained:
            return None, {}
        try:
            return self._grammars().masks(constrained, logits_NV.shape[-1], logits_NV.device)
        except Exception as e:  # noqa: BLE001 - those sequences fail, the others go on
            return None, {i: f"{type(e).__name__}: {e}" for i, *_ in constrained}

    def _score_prompts(self, logits, scored) -> None:
        """Each scored prompt position's next token: its log-probability under the raw scores, and
        the most likely alternatives, a slice of rows at a time (a full log-softmax of every row of
        a long chunk at once would take chunk x vocabulary floats)."""
        at = 0
        for seq, _, start, count in scored:
            targets = torch.tensor(seq.tokens[start + 1:start + 1 + count], device=logits.device)
            k = seq.params.prompt_logprobs
            chosen, top = [], []
            for a in range(0, count, 64):
                lp = torch.log_softmax(logits[at + a:at + min(count, a + 64)].float(), dim=-1)
                chosen += lp.gather(1, targets[a:a + 64, None])[:, 0].tolist()
                if k:
                    values, indices = lp.topk(k, dim=-1)
                    top += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
                else:
                    top += [[] for _ in range(lp.shape[0])]
            at += count
            self._prompt_logprobs.append(PromptLogprobs(seq.seq_id, start + 1, chosen, top))

    def _grammars(self):
        if self._grammar_rows is None:
            from server.engine.grammar import GrammarRows, grammars_of

            if self.tokenizer is None:
                raise RuntimeError("this rank engine has no tokenizer: it cannot follow grammars")
            self._grammar_rows = GrammarRows(grammars_of(self.tokenizer))
        return self._grammar_rows

    def _sample_alone(self, logits_1V, row: Row, allowed: RowMasks | None = None):
        try:
            return self.sampler.sample(logits_1V, [row], allowed)[0]
        except Exception as e:  # noqa: BLE001 - one sequence's bad parameters must not stop the group
            return f"{type(e).__name__}: {e}"


def _direct_forward(model: nn.Module):
    """A :class:`shard_engine.direct.DirectForward` of ``model`` where every unit is resident (its
    forwards then need none of FSDP2's hooks), else None (they gather: the hooks stay)."""
    from shard_engine.direct import DirectForward

    try:
        return DirectForward(model)
    except ValueError:
        return None


FAULT_ENV = "HSDP_INJECT_FORWARD_FAULT"


DELAY_ENV = "HSDP_INJECT_FORWARD_DELAY"


def _injected_delay(rank: int) -> float:
    """A slow rank for tests: ``HSDP_INJECT_FORWARD_DELAY=RANK:SECONDS`` makes every forward of
    that rank take that much longer (a long prefill, a slower device)."""
    target, _, seconds = os.environ.get(DELAY_ENV, "").partition(":")
    return float(seconds or 0) if target and int(target) == rank else 0.0


def _injected_fault(rank: int) -> int | None:
    """Fault injection for failure tests: ``HSDP_INJECT_FORWARD_FAULT=RANK:N`` makes that rank's
    N-th forward (counting one-token idle forwards) raise, as an out-of-memory error would."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    target, _, count = spec.partition(":")
    return int(count or 1) if int(target) == rank else None
