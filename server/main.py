"""``hsdp-serve``: launch the group; on every rank load the model and step; on rank 0 serve HTTP.

Rank 0's HTTP listener starts before the weights load, so probes can watch the load. Rank 0's
main thread drives the engine loop (the collectives); uvicorn runs on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from server.config import ServeConfig, parse_serve_config, unknown_variables
from server.group.launch import GroupError, launch_group
from server.group.logs import configure_logging
from server.group.process_group import init_rank, resolve_device_type

logger = logging.getLogger(__name__)


def _host_ranks() -> tuple[int, int]:
    """This rank's index among the ranks of its host, and their count (the launcher's LOCAL_RANK and
    LOCAL_WORLD_SIZE; one host of every rank where they are not set)."""
    return (int(os.environ.get("LOCAL_RANK", dist.get_rank())),
            int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))


def _resolve_limits(cfg: ServeConfig, model_config):
    from server.http.state import Limits

    positions = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", 4096)
    total = cfg.max_total_tokens or min(positions, 4096)
    inputs = cfg.max_input_tokens or total - 1
    if inputs >= total:
        raise ValueError(f"--max-input-tokens ({inputs}) must be < --max-total-tokens ({total})")
    return Limits(max_input_tokens=inputs, max_total_tokens=total, max_concurrent_requests=cfg.max_concurrent_requests,
                  max_queued_requests=cfg.max_queued_requests, max_sequences_per_request=cfg.max_sequences_per_request,
                  max_stop_sequences=cfg.max_stop_sequences, max_stop_sequence_chars=cfg.max_stop_sequence_chars,
                  max_top_logprobs=cfg.max_top_logprobs, max_tokenize_tokens=cfg.max_tokenize_tokens)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _warm_up(scheduler, state, world_size: int) -> None:
    """One short sequence per rank through the real path; ready once all have finished."""
    from server.engine.sampling import SamplingParams
    from server.engine.scheduler import RequestHandle

    remaining = [world_size]

    def on_event(event) -> None:
        if getattr(event, "finish", None) is not None:
            remaining[0] -= 1
            if remaining[0] == 0:
                state.set_phase("ready")
                logger.info("ready")

    for _ in range(world_size):
        scheduler.submit(RequestHandle([0, 0], SamplingParams(max_new_tokens=2), deliver=on_event))


def _replicas(mesh_shape: tuple[int, int]) -> list[list[int]]:
    """The global ranks of each replica (shard group): the mesh is replicate x shard, row-major."""
    replicate, shard = mesh_shape
    return [[r * shard + s for s in range(shard)] for r in range(replicate)]


def _group_share(max_concurrent: int, groups: int) -> int:
    """The sequences a step group runs at most (its scheduler's bound), and so one of its ranks."""
    return -(-max_concurrent // groups)


def _step_groups(mesh_shape: tuple[int, int], residency) -> list[list[int]]:
    """The ranks that must enter their forwards together, each group stepped on its own.

    A forward that gathers a unit is a collective over the shard group: its ranks step in
    lockstep, one group per replica. With every unit resident (the CPU default: one shared copy
    per host) a forward gathers nothing and runs no collective, so each rank steps alone: a new
    request waits only for its own rank's step, and no rank waits for a slower one (rank 0 also
    serves HTTP) at the end of every step."""
    if residency.everything:
        return [[rank] for rank in range(mesh_shape[0] * mesh_shape[1])]
    return _replicas(mesh_shape)


def _make_resident(model, cfg: ServeConfig, device):
    """``--resident-units``: ``auto`` makes every unit resident where the shard group can hold them
    in one shared copy per host (CPU ranks of one host, ``--all-gather`` not ``group``) and none
    elsewhere; a count is kept as asked, shared where it can be and private otherwise."""
    from shard_engine import set_resident_units

    share = device.type == "cpu" and cfg.all_gather != "group"
    if cfg.resident_units is None:
        if share:
            residency = set_resident_units(model, -1, shared=True, fallback_private=False)
            if residency.shared:
                logger.info("every unit resident in one shared copy for this host (%.1f MB, %d ranks)",
                            residency.shared_bytes / 1e6, residency.shared_with)
                return residency
        return set_resident_units(model, 0)
    return set_resident_units(model, cfg.resident_units, shared=share)


def _pack_linears(model, cfg: ServeConfig, device, residency) -> int:
    """``--packed-linears`` (server.engine.linears): the packed copies' bytes, 0 where none were made."""
    if cfg.packed_linears == "off":
        return 0
    from server.engine.linears import (
        AUTO_MEMORY_SHARE,
        PACKED_DTYPES,
        linear_weight_bytes,
        pack_linears,
        packing_refusal,
    )
    from server.engine.rank import _available_memory

    on = cfg.packed_linears == "on"
    why = packing_refusal(model, device, (torch.bfloat16, torch.float32) if on else PACKED_DTYPES)
    if why is None and not residency.everything:
        why = "not every unit is resident (--resident-units)"
    if why is None and not on:
        copies = linear_weight_bytes(model) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if copies > AUTO_MEMORY_SHARE * _available_memory():
            why = f"the copies ({copies / 1e9:.2f} GB for this host's ranks) would take over a quarter of its memory"
    if why is not None:
        if on:
            raise ValueError(f"--packed-linears on: {why}")
        logger.info("linears on their plain weights (--packed-linears auto: %s)", why)
        return 0
    return pack_linears(model)


def serve_rank(cfg: ServeConfig, source) -> None:
    """Every rank's body; ``source`` is the resolved :class:`loaders.sources.ModelSource`: load and
    shard the model, size and allocate the KV pool, on rank 0 build the schedulers and open for
    requests, then step until rank 0's shutdown plan (``server.group.control``)."""
    from server.group.control import control_channels, run_engine_loop
    from server.group.lifecycle import drive_other_groups, fail_open_requests, ignore_stop_signals
    from server.group.memory import tune_allocator
    from server.group.watchdog import StepWatchdog

    tune_allocator()  # server.group.memory says why
    device = init_rank(resolve_device_type(cfg.device), cfg.collective_timeout_s)
    rank = dist.get_rank()
    hsdp = cfg.mesh_config(dist.get_world_size(), _host_ranks()[1])
    mesh_shape = hsdp.resolve_mesh_shape(dist.get_world_size())
    state = http = scheduler = None
    group = _Group()
    if rank == 0:
        state, http = _start_listening(cfg, source, mesh_shape)
    if cfg.compile == "decode":
        from server.engine.compiled import import_compiler_in_background

        import_compiler_in_background(device.type)
    try:
        loaded = _load(cfg, source, hsdp, device, state, rank)
        engine, per_rank = _shard_for_serving(loaded, cfg, device, mesh_shape, group, state)
        groups = _step_groups(mesh_shape, group.residency)  # the same on every rank: residency is collective
        channels = control_channels(cfg.collective_timeout_s, groups)
        channel = next(c for c, ranks in zip(channels, groups) if rank in ranks)  # this rank's group's
        sharing = on_share = None
        if cfg.share_weights:
            from server.peer import WeightSharing, share_hook

            if rank == 0:
                sharing = state.weight_sharing = WeightSharing(loaded.manifest, loaded.fingerprint, mesh_shape,
                                                               device, cfg.peer_timeout_s, state.metrics)
            on_share = share_hook(loaded, mesh_shape, rank, sharing)
        from server.weights import WeightsAdmin, apply_update

        def on_update(update):
            return apply_update(loaded, cfg, group.residency, update, mesh_shape)

        if rank == 0:
            scheduler = _build_router(cfg, loaded, groups, per_rank, state, device)
            admin = state.weights_admin = WeightsAdmin(loaded, cfg, source.path, state.metrics)
            admin.router, admin.sharing, admin.state, admin.loaded_mesh = scheduler, sharing, state, mesh_shape
            state.metrics.weights_version.labels(admin.version).set(1)
            for s in scheduler.schedulers:
                s.weights_version = admin.version  # each token says which weights computed it
            if sharing is not None:
                sharing.router, sharing.admin = scheduler, admin
            _open_for_requests(cfg, state, scheduler, loaded, engine, per_rank, group)
        else:
            ignore_stop_signals()
        watchdog = StepWatchdog(cfg.step_timeout_s, on_timeout=lambda why: fail_open_requests(state, scheduler, why))
        watchdog.start()
        drivers = drive_other_groups(state, scheduler, channels, cfg) if rank == 0 else []
        run_engine_loop(engine, channel, scheduler.schedulers[0] if rank == 0 else None, watchdog, on_share, on_update)
        for driver in drivers:
            driver.join()
        watchdog.stop()
    except BaseException as e:
        fail_open_requests(state, scheduler, f"{type(e).__name__}: {e}")
        raise
    finally:
        if group.shm_pool is not None:
            group.shm_pool.close()
        if http is not None:
            http.should_exit = True


class _Group:
    """What :func:`serve_rank`'s phases decide of this rank's share of the model: its residency, its
    shared-memory all-gather ring (closed at the end whatever happened), and with a quantized
    checkpoint every rank's bytes of it (``_quantized_bytes``)."""

    residency = None
    shm_pool = None
    quantized = None


def _start_listening(cfg: ServeConfig, source, mesh_shape):
    """Rank 0, before the load: the server's state and its HTTP listener, so probes watch the load."""
    from server.http.app import build_app
    from server.http.listener import start_http_server
    from server.http.metrics import ServerMetrics
    from server.http.state import ServerState

    state = ServerState(
        model_names=[cfg.served_model_name or source.name], model_path=source.path, model_source=source.kind,
        dtype=cfg.dtype, mesh_shape=mesh_shape, world_size=dist.get_world_size(), metrics=ServerMetrics(),
        api_key=cfg.api_key, liveness_timeout_s=cfg.liveness_timeout_s,
    )
    return state, start_http_server(build_app(state, cfg), cfg, state.metrics)


def _load(cfg: ServeConfig, source, hsdp, device, state, rank: int):
    """Stream this rank's shards of the checkpoint in (``loaders``), every unit sharded as it lands."""
    from loaders import load_hsdp_model
    from loaders.checkpoint import load_config
    from server.engine.capability import check_servable
    from server.group.lifecycle import load_progress_reporter
    from server.group.memory import release_freed_memory

    check_servable(load_config(source.path))  # again under torchrun, where no launcher ran it
    arguments = dict(device=device, dtype=cfg.torch_dtype or "auto", read_mode=cfg.read_mode,
                     progress=load_progress_reporter(state, rank), require_tokenizer=True,
                     load_concurrency=cfg.load_concurrency, map_files=cfg.load_mmap,
                     quantize=None if cfg.quantization == "none" else cfg.quantization)
    weights = {"source": "storage"}
    loaded = None
    if cfg.load_from_peer:
        loaded, weights = _load_from_peer(cfg, source, hsdp, arguments, state)
    if loaded is None:
        loaded = load_hsdp_model(source.path, hsdp, **arguments)
    release_freed_memory()  # the load's read buffers (server.group.memory says why)
    if state is not None:  # (the fingerprint costs a few reads: only where peers compare it)
        state.weights = dict(weights, phase_seconds={k: round(v, 3) for k, v in loaded.stats.phase_seconds.items()},
                             **({"fingerprint": loaded.fingerprint} if cfg.share_weights or cfg.load_from_peer else {}))
    return loaded


def _load_from_peer(cfg: ServeConfig, source, hsdp, arguments: dict, state):
    """``--load-from-peer``: the rows from the running group at its URL (``server.peer``); every rank
    returns (None, why) alike where that failed or was refused, and the caller reads storage."""
    import gc

    from loaders import load_hsdp_model
    from loaders.errors import PeerLoadError
    from server.peer import PeerClient
    from shard_engine import wire

    client = PeerClient(cfg.load_from_peer, cfg.api_key, cfg.peer_timeout_s)  # (every rank passes it; rank 0 asks)
    try:
        loaded = load_hsdp_model(source.path, hsdp, peer=client, **arguments)
    except PeerLoadError as e:
        gc.collect()  # what the failed transfer built, before storage's load allocates
        if dist.get_rank() == 0:
            logger.warning("loading from storage instead of the peer %s: %s", cfg.load_from_peer, e)
            if state is not None:
                state.metrics.peer_transfers.labels("received", "refused" if "refused" in str(e) else "failed").inc()
        return None, {"source": "storage", "peer": cfg.load_from_peer, "peer_error": str(e)}
    received = wire.all_gather(loaded.stats.bytes_received)
    if state is not None:
        state.metrics.peer_transfers.labels("received", "ok").inc()
        state.metrics.peer_bytes.labels("received").inc(received[0])
    return loaded, {"source": "peer", "peer": cfg.load_from_peer, "bytes_received_per_rank": received,
                    "seconds": round(loaded.stats.phase_seconds["total"], 3)}


def _shard_for_serving(loaded, cfg: ServeConfig, device, mesh_shape, group: _Group, state=None):
    """Residency, prefetch and the all-gather ring as ``cfg`` asks, then the KV pool sized from what
    is left, and with ``--compile decode`` the compiled decode forward (rank 0's ``state`` says
    ``compiling`` meanwhile); every rank, collectively. Returns this rank's engine and every rank's
    ``(bytes read, resident bytes, KV blocks)``."""
    from server.engine import KVGeometry, RankEngine, size_kv_pool
    from server.engine.compiled import WarmUpPeers
    from server.engine.state import bytes_per_sequence, is_stateful_config, state_shapes
    from server.group.memory import MemoryReport, release_freed_memory, tensor_bytes
    from shard_engine import enable_forward_prefetch, enable_shared_memory_all_gather, shared_weights_of, \
        slots_for_depth, wire

    if cfg.prefetch_depth:
        enable_forward_prefetch(loaded.model, depth=cfg.prefetch_depth)
    shards = tensor_bytes(loaded.model)  # now, while every unit is sharded
    quantized_bytes = _quantized_bytes(loaded.model) if loaded.stats.quantized_layers else None
    group.residency = residency = _make_resident(loaded.model, cfg, device)  # collective: the same on every rank
    if cfg.all_gather == "shm" or (cfg.all_gather == "auto" and not residency.everything):
        # (with every unit resident nothing is gathered after startup: auto leaves it be)
        group.shm_pool = enable_shared_memory_all_gather(loaded.model, slots=slots_for_depth(cfg.prefetch_depth),
                                                         timeout_s=cfg.collective_timeout_s)
        if group.shm_pool is None and cfg.all_gather == "shm":
            raise ValueError("--all-gather shm: the ranks cannot share memory (see the log); use auto or group")
    # before the KV pool takes what is left; the packed copies count as the rank's resident memory beyond its shards
    extra = residency.extra_bytes + _pack_linears(loaded.model, cfg, device, residency)
    geometry = KVGeometry.of(loaded.model)
    # a rank runs at most its step group's share of the concurrent sequences (_build_router): a stateful model
    # keeps that many state slots, out of the KV cache's budget (server.engine.state)
    max_sequences = _group_share(cfg.max_concurrent_requests, len(_step_groups(mesh_shape, residency)))
    states_per_sequence = state_shapes(loaded.model) if is_stateful_config(loaded.config) else None
    # (--compile decode: one more, the padding rows' scratch slot: StatePool.add_scratch_slot)
    slots = max_sequences + (cfg.compile == "decode")
    state_bytes = slots * bytes_per_sequence(states_per_sequence) if states_per_sequence else 0
    available = size_kv_pool(cfg.kv_cache_memory, geometry, cfg.kv_block_size, device, state_bytes=state_bytes)
    # every rank, once; also the barrier between measuring free memory and allocating the pools
    per_rank = wire.all_gather([loaded.stats.bytes_read, extra, available])
    if loaded.stats.quantized_layers:  # every rank loads the same checkpoint: all or none gather
        group.quantized = wire.all_gather(quantized_bytes)
    engine = RankEngine(loaded.model, device, dist.get_rank(), num_blocks=available, block_size=cfg.kv_block_size,
                        tokenizer=loaded.tokenizer, max_sequences=max_sequences,
                        states_per_sequence=states_per_sequence)
    if cfg.compile == "decode":
        if state is not None:
            state.set_phase("compiling")
        logger.info("compiling the decode forward (--compile decode)")
        index, count = _host_ranks()
        # the ranks of a host share out the layers' graphs (the same model's: the same graphs)
        seconds = engine.compile_decode(sizes=cfg.compile_batch_sizes_for(device.type), region=cfg.compile_region,
                                        peers=WarmUpPeers(index, count, dist.barrier))
        logger.info("decode forward compiled in %.1f s (%d graphs compiled, %d loaded from disk)", seconds,
                    engine.compiled.graphs_compiled, engine.compiled.graphs_loaded)
    release_freed_memory()
    weights = shared_weights_of(loaded.model)
    # shards that are views of the host's shared copy are counted once, in its share
    shards -= weights.shard_view_bytes if weights is not None else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # each shard group maps its own ring: its sharers are the group's ranks (all on this host)
    engine.memory = MemoryReport(shards=shards, resident=extra, kv_pool=engine.cache.nbytes, states=engine.states,
                                 ring=group.shm_pool, ring_sharers=min(local_ranks, mesh_shape[1]),
                                 shared_weights=residency.shared_bytes, shared_weights_sharers=residency.shared_with,
                                 device=device)
    if dist.get_rank() == 0:
        logger.info("KV cache: %s blocks of %d tokens per rank (%.1f MB per rank, %d bytes per token)",
                    "/".join(str(b) for _, _, b in per_rank), cfg.kv_block_size, engine.cache.nbytes / 1e6,
                    geometry.bytes_per_token)
    return engine, per_rank


def _quantized_bytes(model) -> dict[str, int]:
    """This rank's bytes of a quantized checkpoint's tensors (its shards, before any is made
    resident), and of the parameters every rank holds whole."""
    from torch.distributed.tensor import DTensor

    from loaders.quantization import quantized_bytes

    out = quantized_bytes(model)
    out["replicated"] = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    return out


def _weight_bytes(model) -> int:
    """The model's parameters in bytes (whole tensors: a resident rank reads them all a step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _build_router(cfg: ServeConfig, loaded, groups, per_rank, state, device):
    """Rank 0: a scheduler per step group over its ranks' KV pools, one router in front."""
    import torch

    from server.engine import BlockPool, Scheduler, StepGroupRouter
    from server.engine.cores import HostCores, cores_follow_work
    from server.engine.rope import rope_switch
    from server.engine.state import is_stateful_config

    from server.engine.multimodal import embedding_row_bytes, image_family, takes_images

    limits = state.limits = _resolve_limits(cfg, loaded.config)
    whole_images = takes_images(loaded.model) and image_family(loaded.config).bidirectional
    # image embeddings each rank keeps by content (server.engine.multimodal.ImageCacheBook), in rows
    image_rows = cfg.mm_embedding_cache // embedding_row_bytes(
        loaded.config, next(loaded.model.parameters()).dtype) if takes_images(loaded.model) else 0
    # a cached block holds keys and values, not a stateful layer's state after it (server.engine.state)
    prefix_caching = cfg.prefix_caching and not is_stateful_config(loaded.config)
    share = _group_share(limits.max_concurrent_requests, len(groups))
    cores = None
    # a busy rank takes its host's idle cores (server.engine.cores), where a step streams weights
    if cores_follow_work(device.type, _weight_bytes(loaded.model), len(groups)):
        world = sum(len(ranks) for ranks in groups)
        cores = HostCores(_host_ranks()[1], torch.get_num_threads(), world)
    schedulers = [
        Scheduler(
            pools=[BlockPool(per_rank[r][2], cfg.kv_block_size, prefix_caching=prefix_caching) for r in ranks],
            replicas=[list(range(len(ranks)))], rank_ids=ranks, max_running=share,
            max_queued=limits.max_queued_requests, max_total_tokens=limits.max_total_tokens,
            max_prefill_tokens=cfg.prefill_tokens_for(device.type), prefill_share=cfg.prefill_share_for(device.type),
            eos_token_ids=_eos_ids(loaded.model, loaded.tokenizer), metrics=state.metrics, cores=cores,
            rope=rope_switch(loaded.model), whole_images=whole_images, image_cache=image_rows,
        )
        for ranks in groups
    ]
    router = StepGroupRouter(schedulers, max_running=limits.max_concurrent_requests,
                             max_queued=limits.max_queued_requests)
    if router.max_sequence_tokens < limits.max_total_tokens:
        logger.warning("the KV cache holds %d tokens per rank, fewer than --max-total-tokens %d: longer sequences "
                       "are refused (raise --kv-cache-memory)", router.max_sequence_tokens, limits.max_total_tokens)
    return router


def _open_for_requests(cfg: ServeConfig, state, scheduler, loaded, engine, per_rank, group: _Group) -> None:
    """Rank 0: what the APIs need of the model, the drain handler, the warm-up (ready once it ends)
    and the watch over this node's ranks."""
    from server.api.media import ImagePrompts, MediaPolicy
    from server.api.openai.chat import ChatRenderer, read_chat_template
    from server.engine.multimodal import takes_images
    from server.group.lifecycle import install_drain_handler, watch_local_ranks
    from server.group.memory import QuietReclaimer

    _describe_group(state, scheduler, loaded, per_rank, group.residency, group.shm_pool, cfg, group.quantized)
    if engine.states is not None:  # every rank the same: the same model, the same share of sequences
        state.kv_layout.update(state_bytes_per_sequence=engine.states.bytes_per_sequence(),
                               state_slots_per_rank=engine.states.capacity)
    state.special_ids = frozenset(getattr(loaded.tokenizer, "all_special_ids", ()))
    state.vocab_size = min(len(loaded.tokenizer), getattr(loaded.config, "vocab_size", None) or 1 << 62)
    state.tokenizer, state.scheduler = loaded.tokenizer, scheduler
    if takes_images(loaded.model):  # an image-text model: its processor expands images into their tokens
        state.images, state.media = ImagePrompts.load(state.model_path, loaded.config), MediaPolicy.of(cfg)
    state.chat = ChatRenderer(loaded.tokenizer, read_chat_template(cfg.chat_template), cfg.tool_call_parser,
                              state.images)
    state.sampling_defaults = sampling_defaults(loaded.model)
    if state.sampling_defaults:
        logger.info("generation_config.json's sampling defaults apply to OpenAI requests that leave them unset: %s",
                    state.sampling_defaults)
    state.set_phase("warming_up")
    install_drain_handler(scheduler, state, cfg.shutdown_timeout_s)
    _warm_up(scheduler, state, dist.get_world_size())
    watch_local_ranks(state, scheduler)
    # what the HTTP side leaves in the allocator goes back while nothing runs (server.group.memory)
    QuietReclaimer(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0).start()


def _describe_group(state, scheduler, loaded, per_rank, residency, shm_pool, cfg, group_quantized=None) -> None:
    """Rank 0: what /info and /metrics report of the loaded group."""
    from server.engine.rank import KVGeometry

    state.kv_layout = KVGeometry.of(loaded.model).describe()
    state.metrics.load_seconds.set(loaded.stats.phase_seconds["total"])
    for r, (read, _, _) in enumerate(per_rank):
        state.metrics.loaded_bytes.labels(rank=str(r)).set(read)
    state.load_bytes_read = [read for read, _, _ in per_rank]
    state.residency = dict(residency.as_dict(), extra_bytes_per_rank=[extra for _, extra, _ in per_rank],
                           prefetch_depth=cfg.prefetch_depth,
                           all_gather="shm" if shm_pool is not None else
                           "none" if residency.everything else "group")
    state.metrics.resident_units.set(len(residency.units))
    if loaded.stats.quantized_layers:
        state.quantization = {"layers": loaded.stats.quantized_layers, "bytes_per_rank": group_quantized}
        for r, held in enumerate(group_quantized):
            for kind in ("weights", "scales", "replicated"):
                state.metrics.quantized_bytes.labels(str(r), kind).set(held[kind])
    state.metrics.sharded_units.set(residency.total_units)
    for r, (_, extra, _) in enumerate(per_rank):
        state.metrics.resident_bytes.labels(rank=str(r)).set(extra)
    state.metrics.running.set_function(lambda: scheduler.num_running)
    state.metrics.waiting.set_function(lambda: scheduler.num_waiting)
    for r, pool in enumerate(scheduler.pools):
        state.metrics.kv_blocks.labels(str(r), "total").set(pool.num_blocks)
        state.metrics.kv_blocks.labels(str(r), "used").set_function(lambda pool=pool: pool.num_used)
        state.metrics.kv_blocks.labels(str(r), "cached").set_function(lambda pool=pool: pool.num_cached)
        for kind in ("shards", "resident", "shared_weights_share", "gather_ring_share", "kv_pool", "state_pool",
                     "runtime", "rss", "pss", *(("device_allocated", "device_reserved") if loaded.context.target_device.type
                                                == "cuda" else ())):
            state.metrics.rank_memory.labels(str(r), kind).set_function(
                lambda r=r, kind=kind: (scheduler.rank_memory[r] or {}).get(kind, 0))
    state.dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")


def _check_before_launch(cfg: ServeConfig, source) -> None:
    """What can fail before any rank starts fails here, in one line."""
    from loaders.checkpoint import load_config
    from server.api.openai.chat import read_chat_template
    from server.engine.capability import check_servable
    from server.group.process_group import is_under_torchrun, resolve_nproc_per_node

    from loaders.quantization import quantization_plan

    model_config = load_config(source.path)
    check_servable(model_config)  # a model the engine cannot serve is refused unread
    quantization_plan(model_config, path=os.path.join(source.path, "config.json"))  # so is a quantization it cannot
    read_chat_template(cfg.chat_template)  # a --chat-template that is neither file nor template

    if cfg.compile == "decode" and cfg.resident_units == 0:
        raise ValueError("--compile decode needs every unit resident: --resident-units 0 gathers them every step")
    cfg.nproc_per_node = resolve_nproc_per_node(cfg.nproc_per_node, resolve_device_type(cfg.device))
    if not is_under_torchrun():
        cfg.mesh_config(cfg.nproc_per_node, cfg.nproc_per_node).resolve_mesh_shape(cfg.nproc_per_node)


def sampling_defaults(model) -> dict:
    """The sampling settings the checkpoint's generation_config.json sets explicitly (not
    transformers' class defaults): OpenAI requests that leave them unset get them."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return {}
    explicit = generation_config.to_diff_dict()
    return {k: explicit[k] for k in SAMPLING_DEFAULT_KEYS if explicit.get(k) is not None}


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def main(argv: list[str] | None = None, cfg: ServeConfig | None = None) -> None:
    """Serve as the options say: ``cfg`` where the caller parsed them (``server.__main__``: the
    options are parsed once, ``--api-key-file`` read once, a pipe's contents too), else ``argv``'s."""
    from loaders.errors import CheckpointError
    from loaders.sources import resolve_model_on_node

    cfg = cfg if cfg is not None else parse_serve_config(argv)
    configure_logging(cfg.log_level)
    for name in unknown_variables():
        logger.warning("unknown variable %s is ignored (hsdp-serve --help names the variables)", name)
    try:
        # Before the ranks start (one process per node fetches), so they never race.
        source = resolve_model_on_node(cfg.model, revision=cfg.revision)
        logger.info("serving %s (%s, %s)", cfg.served_model_name or source.name, source.kind, source.path)
        _check_before_launch(cfg, source)
        if cfg.compile != "none":
            from server.engine.compiled import inductor_cache_dir

            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        launch_group(serve_rank, (cfg, source), nproc_per_node=cfg.nproc_per_node, log_level=cfg.log_level,
                     shutdown_timeout_s=int(cfg.shutdown_timeout_s) + 15, title="hsdp-serve")
    except GroupError as e:
        print(f"hsdp-serve: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ValueError, CheckpointError) as e:
        print(f"hsdp-serve: {e}", file=sys.stderr)
        sys.exit(2)
