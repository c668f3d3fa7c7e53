"""``hsdp-serve``: launch the group; on every rank load the model and step; on rank 0 serve HTTP.

Rank 0's HTTP listener starts before the weights load, so probes can watch the load. Rank 0's
main thread drives the engine loop (the collectives); uvicorn runs on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from server.config import ServeConfig, parse_serve_config, unknown_variables
from server.launch import GroupError, configure_logging, init_rank, launch_group, resolve_device_type

logger = logging.getLogger(__name__)
_HTTP_START_TIMEOUT_S = 30.0
_FAILURE_LINGER_S = 2.0


def start_http_server(app, cfg: ServeConfig, metrics=None):
    """Run uvicorn on a daemon thread, with the connection timeouts and cap of ``cfg``
    (``server.connections``); returns once it listens, raises if it cannot."""
    import uvicorn

    from server.connections import guarded_protocol

    host, port = cfg.host, cfg.port
    protocol = guarded_protocol(header_timeout_s=cfg.header_timeout_s, slow_reader_timeout_s=cfg.slow_reader_timeout_s,
                                metrics=metrics)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, http=protocol,
        timeout_keep_alive=cfg.keep_alive_timeout_s, limit_concurrency=cfg.max_connections,
        # the listen backlog: connections the kernel queues before accept (uvicorn's default, 2048)
        backlog=2048))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + _HTTP_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"cannot listen on {host}:{port} (in use, or not an address of this host)")
        time.sleep(0.05)
    logger.info("listening on http://%s:%d", host, port)
    return server


def _resolve_limits(cfg: ServeConfig, model_config):
    from server.state import Limits

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


def serve_rank(cfg: ServeConfig, source) -> None:
    """Every rank's body; ``source`` is the resolved :class:`loaders.sources.ModelSource`."""
    from loaders import load_hsdp_model
    from server.app import build_app
    from server.control import control_channels, run_engine_loop
    from server.engine import BlockPool, KVGeometry, RankEngine, ReplicaRouter, Scheduler, size_kv_pool
    from server.memory import MemoryReport, release_freed_memory, tensor_bytes, tune_allocator
    from server.metrics import ServerMetrics
    from server.state import ServerState
    from server.watchdog import StepWatchdog
    from shard_engine import (enable_forward_prefetch, enable_shared_memory_all_gather, shared_weights_of,
                              slots_for_depth, wire)

    tune_allocator()  # server.memory says why
    device = init_rank(resolve_device_type(cfg.device), cfg.collective_timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hsdp = cfg.mesh_config(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    mesh_shape = hsdp.resolve_mesh_shape(world_size)
    state = http = scheduler = shm_pool = None
    if rank == 0:
        state = ServerState(
            model_names=[cfg.served_model_name or source.name], model_path=source.path, model_source=source.kind,
            dtype=cfg.dtype, mesh_shape=mesh_shape, world_size=world_size, metrics=ServerMetrics(),
            api_key=cfg.api_key, liveness_timeout_s=cfg.liveness_timeout_s,
        )
        http = start_http_server(build_app(state, cfg), cfg, state.metrics)
    try:
        from loaders.checkpoint import load_config
        from server.api.openai.chat import ChatRenderer, read_chat_template
        from server.engine.capability import check_servable

        check_servable(load_config(source.path))  # again under torchrun, where no launcher ran it
        loaded = load_hsdp_model(
            source.path, hsdp, device=device, dtype=cfg.torch_dtype or "auto", read_mode=cfg.read_mode,
            progress=_load_progress_reporter(state, rank), require_tokenizer=True,
            load_concurrency=cfg.load_concurrency,
        )
        release_freed_memory()  # the load's read buffers (server.memory says why)
        if cfg.prefetch_depth:
            enable_forward_prefetch(loaded.model, depth=cfg.prefetch_depth)
        shards = tensor_bytes(loaded.model)  # now, while every unit is sharded
        residency = _make_resident(loaded.model, cfg, device)  # collective: the same on every rank
        if cfg.all_gather == "shm" or (cfg.all_gather == "auto" and not residency.everything):
            # (with every unit resident nothing is gathered after startup: auto leaves it be)
            shm_pool = enable_shared_memory_all_gather(loaded.model, slots=slots_for_depth(cfg.prefetch_depth),
                                                       timeout_s=cfg.collective_timeout_s)
            if shm_pool is None and cfg.all_gather == "shm":
                raise ValueError("--all-gather shm: the ranks cannot share memory (see the log); use auto or group")
        geometry = KVGeometry.of(loaded.model)
        available = size_kv_pool(cfg.kv_cache_memory, geometry, cfg.kv_block_size, device)
        # every rank, once; also the barrier between measuring free memory and allocating the pools
        per_rank = wire.all_gather([loaded.stats.bytes_read, residency.extra_bytes, available])
        engine = RankEngine(loaded.model, device, rank, num_blocks=available, block_size=cfg.kv_block_size,
                            tokenizer=loaded.tokenizer)
        release_freed_memory()
        weights = shared_weights_of(loaded.model)
        # shards that are views of the host's shared copy are counted once, in its share
        shards -= weights.shard_view_bytes if weights is not None else 0
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # each shard group maps its own ring: its sharers are the group's ranks (all on this host)
        engine.memory = MemoryReport(shards=shards, resident=residency.extra_bytes, kv_pool=engine.cache.nbytes,
                                     ring=shm_pool, ring_sharers=min(local_ranks, mesh_shape[1]),
                                     shared_weights=residency.shared_bytes,
                                     shared_weights_sharers=residency.shared_with)
        groups = _step_groups(mesh_shape, residency)  # the same on every rank: residency is collective
        channels = control_channels(cfg.collective_timeout_s, groups)
        channel = next(c for c, ranks in zip(channels, groups) if rank in ranks)  # this rank's group's
        if rank == 0:
            limits = _resolve_limits(cfg, loaded.config)
            share = -(-limits.max_concurrent_requests // len(groups))  # each group's running bound
            schedulers = [
                Scheduler(
                    pools=[BlockPool(per_rank[r][2], cfg.kv_block_size, prefix_caching=cfg.prefix_caching)
                           for r in ranks],
                    replicas=[list(range(len(ranks)))], rank_ids=ranks, max_running=share,
                    max_queued=limits.max_queued_requests, max_total_tokens=limits.max_total_tokens,
                    max_prefill_tokens=cfg.max_batch_prefill_tokens,
                    eos_token_ids=_eos_ids(loaded.model, loaded.tokenizer), metrics=state.metrics,
                )
                for ranks in groups
            ]
            scheduler = ReplicaRouter(schedulers, max_running=limits.max_concurrent_requests,
                                      max_queued=limits.max_queued_requests)
            logger.info("KV cache: %s blocks of %d tokens per rank (%.1f MB per rank, %d bytes per token)",
                        "/".join(str(b) for _, _, b in per_rank), cfg.kv_block_size, engine.cache.nbytes / 1e6,
                        geometry.bytes_per_token)
            _describe_group(state, scheduler, loaded, per_rank, residency, shm_pool, cfg)
            if scheduler.max_sequence_tokens < limits.max_total_tokens:
                logger.warning("the KV cache holds %d tokens per rank, fewer than --max-total-tokens %d: longer "
                               "sequences are refused (raise --kv-cache-memory)", scheduler.max_sequence_tokens,
                               limits.max_total_tokens)
            state.special_ids = frozenset(getattr(loaded.tokenizer, "all_special_ids", ()))
            state.vocab_size = min(len(loaded.tokenizer), getattr(loaded.config, "vocab_size", None) or 1 << 62)
            state.limits, state.tokenizer, state.scheduler = limits, loaded.tokenizer, scheduler
            state.chat = ChatRenderer(loaded.tokenizer, read_chat_template(cfg.chat_template), cfg.tool_call_parser)
            state.sampling_defaults = sampling_defaults(loaded.model)
            if state.sampling_defaults:
                logger.info("generation_config.json's sampling defaults apply to OpenAI requests that leave them "
                            "unset: %s", state.sampling_defaults)
            state.set_phase("warming_up")
            _install_drain_handler(scheduler, state, cfg.shutdown_timeout_s)
            _warm_up(scheduler, state, world_size)
            _watch_local_ranks(state, scheduler)
        else:
            _ignore_stop_signals()
        watchdog = StepWatchdog(cfg.step_timeout_s, on_timeout=lambda why: _fail_open_requests(state, scheduler, why))
        watchdog.start()
        drivers = _drive_other_groups(state, scheduler, channels, cfg) if rank == 0 else []
        run_engine_loop(engine, channel, scheduler.schedulers[0] if rank == 0 else None, watchdog)
        for driver in drivers:
            driver.join()
        watchdog.stop()
    except BaseException as e:
        _fail_open_requests(state, scheduler, f"{type(e).__name__}: {e}")
        raise
    finally:
        if shm_pool is not None:
            shm_pool.close()
        if http is not None:
            http.should_exit = True


LOAD_PROGRESS_EVERY_S = 0.25


def _load_progress_reporter(state, rank: int):
    """The loader's progress callback: every rank writes its ``done,total`` into the group's store
    (at most every quarter second, and its last) for rank 0's /ready; rank 0 keeps its own too."""
    from server.state import LOAD_PROGRESS_KEY

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - progress is a nicety: without a store, rank 0's alone
        store = None
    if state is not None:
        state.load_store = store
    last = [0.0]

    def report(done: int, total: int) -> None:
        if state is not None:
            state.set_load_progress(done, total)
        now = time.monotonic()
        if store is not None and (now - last[0] >= LOAD_PROGRESS_EVERY_S or done >= total):
            last[0] = now
            try:
                store.set(f"{LOAD_PROGRESS_KEY}{rank}", f"{done},{total}")
            except Exception:  # noqa: BLE001
                pass

    return report


def _drive_other_groups(state, router, channels, cfg) -> list[threading.Thread]:
    """Rank 0: a thread per step group it is not in (a replica, or a rank stepping alone),
    stepping that group (server.control). A failure there (a rank of the group gone, a step over
    the timeout) fails the whole group of ranks, as one on rank 0's own does: every open request
    answered, rank 0 out, non-zero."""
    from server.control import run_engine_loop
    from server.watchdog import StepWatchdog
    from shard_engine import remove_owned_now

    def drive(index: int) -> None:
        watchdog = StepWatchdog(cfg.step_timeout_s, on_timeout=lambda why: _fail_open_requests(state, router, why))
        watchdog.start()
        try:
            run_engine_loop(None, channels[index], router.schedulers[index], watchdog)
        except BaseException as e:  # noqa: BLE001 - the group is broken: down, fast and loudly
            ranks = ",".join(map(str, router.replicas[index]))
            _fail_open_requests(state, router, f"ranks {ranks}: {type(e).__name__}: {e}")
            logging.shutdown()
            remove_owned_now()
            os._exit(1)
        finally:
            watchdog.stop()

    threads = [threading.Thread(target=drive, args=(i,), name=f"hsdp-steps-{i}", daemon=True)
               for i in range(1, len(router.schedulers))]
    for thread in threads:
        thread.start()
    return threads


def _describe_group(state, scheduler, loaded, per_rank, residency, shm_pool, cfg) -> None:
    """Rank 0: what /info and /metrics report of the loaded group."""
    state.metrics.load_seconds.set(loaded.stats.phase_seconds["total"])
    for r, (read, _, _) in enumerate(per_rank):
        state.metrics.loaded_bytes.labels(rank=str(r)).set(read)
    state.load_bytes_read = [read for read, _, _ in per_rank]
    state.residency = dict(residency.as_dict(), extra_bytes_per_rank=[extra for _, extra, _ in per_rank],
                           prefetch_depth=cfg.prefetch_depth,
                           all_gather="shm" if shm_pool is not None else
                           "none" if residency.everything else "group")
    state.metrics.resident_units.set(len(residency.units))
    state.metrics.sharded_units.set(residency.total_units)
    for r, (_, extra, _) in enumerate(per_rank):
        state.metrics.resident_bytes.labels(rank=str(r)).set(extra)
    state.metrics.running.set_function(lambda: scheduler.num_running)
    state.metrics.waiting.set_function(lambda: scheduler.num_waiting)
    for r, pool in enumerate(scheduler.pools):
        state.metrics.kv_blocks.labels(str(r), "total").set(pool.num_blocks)
        state.metrics.kv_blocks.labels(str(r), "used").set_function(lambda pool=pool: pool.num_used)
        state.metrics.kv_blocks.labels(str(r), "cached").set_function(lambda pool=pool: pool.num_cached)
        for kind in ("shards", "resident", "shared_weights_share", "gather_ring_share", "kv_pool", "runtime", "rss",
                     "pss"):
            state.metrics.rank_memory.labels(str(r), kind).set_function(
                lambda r=r, kind=kind: (scheduler.rank_memory[r] or {}).get(kind, 0))
    state.dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")


def _fail_open_requests(state, scheduler, reason: str) -> None:
    """Rank 0, the group failing: answer every open request with an error and let probes see it."""
    if state is None:
        return
    state.set_phase("failed", reason)
    logger.error("the model group failed: %s", reason)
    if scheduler is not None:
        scheduler.fail_all(f"the model group failed: {reason}")
    time.sleep(_FAILURE_LINGER_S)  # the error responses flush; /health answers 503 meanwhile


LIVENESS_POLL_S = 0.2


def _dead_local_rank(scheduler) -> str | None:
    """Why the group is broken, if a rank of this node has exited (its pid, as the rank reported
    it, is gone), else None. Ranks of a node are numbered from rank 0's up, as torchrun does."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for rank, stats in enumerate(scheduler.rank_stats[:local]):
        if stats is None:
            continue
        try:
            os.kill(stats.pid, 0)
        except ProcessLookupError:
            return f"rank {rank} (pid {stats.pid}) exited"
        except PermissionError:
            pass
    return None


def _watch_local_ranks(state, scheduler) -> None:
    """Rank 0: /health turns 503 the moment a rank of this node dies, not when the collective that
    needs it fails or the launcher's SIGTERM comes (seconds later, and a drain looks alive)."""
    def watch() -> None:
        # while serving: once draining, the ranks leave on purpose (a failure then still shows in
        # the collective that needs the dead rank, and in the SIGTERM handler's check)
        while state.phase in ("warming_up", "ready"):
            reason = _dead_local_rank(scheduler)
            if reason is not None:
                state.set_phase("failed", reason)
                logger.error("the model group failed: %s", reason)
                return
            time.sleep(LIVENESS_POLL_S)

    threading.Thread(target=watch, name="hsdp-liveness", daemon=True).start()


def _install_drain_handler(scheduler, state, timeout_s: float) -> None:
    def drain(signum, _frame) -> None:
        if (reason := _dead_local_rank(scheduler)) is not None:  # the launcher stopping a broken group
            state.set_phase("failed", reason)
        logger.warning("%s: draining (in-flight requests finish within %g s, new ones get 503)",
                       signal.Signals(signum).name, timeout_s)
        state.set_phase("draining")
        scheduler.request_shutdown(timeout_s)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)


def _ignore_stop_signals() -> None:
    # The launcher (or torchrun) passes SIGTERM/SIGINT to every rank; only rank 0 decides when the
    # group stops, and its shutdown plan ends every rank's loop. A rank whose peers are gone still
    # ends: its next collective fails, and the launcher's SIGKILL follows its shutdown timeout.
    def note(signum, _frame) -> None:
        logger.info("%s: waiting for rank 0 to end the group", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)


def _check_before_launch(cfg: ServeConfig, source) -> None:
    """What can fail before any rank starts fails here, in one line."""
    from loaders.checkpoint import load_config
    from server.api.openai.chat import read_chat_template
    from server.engine.capability import check_servable
    from server.launch import is_under_torchrun, resolve_nproc_per_node

    check_servable(load_config(source.path))  # a model the engine cannot serve is refused unread
    read_chat_template(cfg.chat_template)  # a --chat-template that is neither file nor template

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


def main(argv: list[str] | None = None) -> None:
    from loaders.errors import CheckpointError
    from loaders.sources import resolve_model_on_node

    cfg = parse_serve_config(argv)
    configure_logging(cfg.log_level)
    for name in unknown_variables():
        logger.warning("unknown variable %s is ignored (hsdp-serve --help names the variables)", name)
    try:
        # Before the ranks start (one process per node fetches), so they never race.
        source = resolve_model_on_node(cfg.model, revision=cfg.revision)
        logger.info("serving %s (%s, %s)", cfg.served_model_name or source.name, source.kind, source.path)
        _check_before_launch(cfg, source)
        launch_group(serve_rank, (cfg, source), nproc_per_node=cfg.nproc_per_node, log_level=cfg.log_level,
                     shutdown_timeout_s=int(cfg.shutdown_timeout_s) + 15, title="hsdp-serve")
    except GroupError as e:
        print(f"hsdp-serve: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ValueError, CheckpointError) as e:
        print(f"hsdp-serve: {e}", file=sys.stderr)
        sys.exit(2)
