"""Stream a safetensors checkpoint into an HSDP-sharded model, one FSDP unit at a time.

Every rank calls :func:`load_hsdp_model`. The skeleton is built with meta parameters; the
loader knows, per FSDP unit, the exact tensor names it expects, and shards a unit the moment
its last tensor arrives, whatever order files and tensors come in. The root is sharded last.
No collective runs while files are read: ranks only agree, twice, that no rank failed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from loaders.checkpoint import list_checkpoint_files, load_config, load_generation_config, load_tokenizer
from loaders.conversion import ConversionTarget, plan_conversions
from loaders.dtypes import auto_dtype
from loaders.errors import (
    CheckpointError,
    DTypeMismatchError,
    MissingTensorError,
    PartialUpdateError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedQuantizationError,
    error_from_record,
    error_to_record,
)
from loaders.modes import READ_MODES
from loaders.quantization import quantization_plan, quantize_skeleton
from loaders.quantization.linear import check_nothing_else_quantized
from loaders.quantization.on_load import quantize_rows, quantize_skeleton_on_load
from loaders.safetensors_io import map_file, mapped_rows, read_rows, resident_fraction, row_span
from loaders.skeleton import auto_model_class, build_skeleton, describe_layout, match_key_prefix
from loaders.stats import LoadStats, read_proc_status, reset_peak_rss
from shard_engine import (
    HSDPInferenceConfig,
    HSDPShardContext,
    default_device,
    finalize_hsdp_root,
    owning_unit,
    parameter_like,
    prepare_hsdp_shard_context,
    select_units,
    shard_hsdp_module,
    wire,
)
from shard_engine.torch_private import set_buffer, set_parameter
from shard_engine.transfer import Slot, held_tensors, manifest_difference, shard_rows

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object | None
    config: object
    stats: LoadStats
    context: HSDPShardContext
    manifest: list[Slot] = field(default_factory=list)  # what a peer group may receive (loaders.peer)
    files: object | None = field(default=None, repr=False)  # loaders.checkpoint.CheckpointFiles
    source: str = "storage"  # where the rows came from: "storage", or "peer" (loaders.peer)

    @property
    def fingerprint(self) -> str:
        """The checkpoint's (``CheckpointFiles.fingerprint``: a few small reads, the first time)."""
        return self.files.fingerprint()


@dataclass(eq=False)
class _Unit:
    name: str  # "" for the root
    module: nn.Module
    remaining: set[str] = field(default_factory=set)
    children: list[_Unit] = field(default_factory=list)
    parent: _Unit | None = None
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    done: bool = False


def _resolve_dtype(dtype, config, files, device: torch.device) -> tuple[torch.dtype, bool]:
    """The skeleton's dtype, and whether checkpoint tensors may be cast to it.

    None keeps the checkpoint's dtype exactly; ``"auto"`` keeps it too unless ``device`` has no
    native arithmetic for it (bf16 or fp16 on most CPUs: :func:`loaders.dtypes.auto_dtype`).
    """
    if dtype is not None and dtype != "auto":
        return (getattr(torch, dtype) if isinstance(dtype, str) else dtype), True
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    stored = configured or files.dominant_dtype() or torch.float32
    if dtype is None:
        return stored, False
    runnable, why = auto_dtype(stored, device)
    if why is not None and _is_rank_zero():
        logger.warning("%s", why)
    return runnable, runnable != stored


def _agree(error: BaseException | None, stage: str) -> None:
    """Raise on every rank if any rank failed (one all-gather over the default group, of error
    records: plain data, never a pickle; ``loaders.errors``).

    Every rank reaches this call on success and on failure alike, so none is left waiting.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    sendable = error
    if error is not None and not isinstance(error, CheckpointError):
        sendable = CheckpointError(f"{type(error).__name__}: {error}")
    gathered = wire.all_gather(error_to_record(sendable) if sendable is not None else None)
    if error is not None:
        raise error
    for rank, remote in enumerate(gathered):
        if remote is not None:
            exc = error_from_record(remote)
            exc.add_note(f"raised on rank {rank} during {stage}; rank {dist.get_rank()} stops too")
            raise exc


def local_read_ahead(load_concurrency: int, cold: bool = False) -> int:
    """How many positioned reads of a local file a rank keeps in flight ahead of the tensor it
    shards: ``load_concurrency`` where the file is ``cold`` (not in the page cache: the reads wait
    on the device, and reads in flight overlap that wait with the sharding), or where this host has
    cores its ranks leave idle (more cores than ``LOCAL_WORLD_SIZE`` ranks, among those this
    process may run on), else 0. Measured (``benchmarks.load``, 1.5 GB bf16 Llama, a 2-core host):
    warm, 1 rank with 8 reads ahead 0.52-0.56 s against 0.70-0.76 s without (and 0.76 s with 1
    ahead: the page faults of several reads run on both cores); 2 ranks on the 2 cores 0.46-0.52 s
    against 0.41-0.48 s without (no idle core: the threads only compete), hence none there; cold
    (``--cold``), 2 ranks 0.70 s with them against 1.16-1.17 s without, where one read of each
    rank's bytes takes 0.66-0.69 s."""
    if cold:
        return load_concurrency
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return load_concurrency if cores > local_ranks else 0


def maps_rows(map_files: bool, cold: bool) -> bool:
    """Whether a rank takes its rows of a local file as views of a private mapping of it
    (:func:`loaders.safetensors_io.map_file`) rather than reading them into memory of its own:
    where ``map_files`` (``--load-mmap``) and the file is warm in the page cache. A warm file's
    rows then cost their page-table entries, not fresh pages zeroed and a copy into them.
    Measured (``benchmarks.load``, 1.5 GB bf16 Llama, 2 ranks, a 2-core VM): reading a rank's
    0.74 GB into fresh memory takes 0.48-0.54 s, into one reused buffer 0.11-0.12 s (the copy alone),
    mapping it 0.01 s. A cold file is read: its pages come from the device either way, and
    positioned reads keep several large requests in flight where faults of a mapping ask for a
    readahead window at a time."""
    return map_files and not cold


COLD_FRACTION = 0.25
"""A file is read as cold (:func:`is_cold`) where more than this share of a rank's pages of it are not
in the page cache. Mapping such a file faults its missing pages in one readahead window at a time,
where positioned reads keep several requests in flight; reading a warm part costs its fresh pages'
zeroing and a copy. From the figures of :func:`maps_rows` and :func:`local_read_ahead` (2 ranks,
a 2-core VM: a warm rank's 0.74 GB read 0.5 s against 0.01 s mapped, a cold one's read 0.7 s), the
two cost the same near a quarter, with faults taken to cost about three times the reads."""


def is_cold(fd: int, spans: list[tuple[int, int]]) -> bool:
    """Whether more than :data:`COLD_FRACTION` of the pages holding ``spans`` ([(offset, bytes)] of an
    open file: a rank's rows of it) are not in the page cache, from the kernel's own account
    (:func:`loaders.safetensors_io.resident_fraction`). Where that cannot say (a file this process
    neither owns nor may write, as on a read-only model volume): whether more than that share of
    the first bytes of up to :data:`COLD_PROBES` spans, evenly spread, are not, by a 1-byte read at
    each that must not wait for the device (``RWF_NOWAIT``); False where neither can say (the
    reads then go as for a warm file)."""
    fraction = resident_fraction(fd, spans)
    if fraction is not None:
        return fraction < 1 - COLD_FRACTION
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not spans:
        return False
    buf = bytearray(1)
    probed = [spans[i * len(spans) // COLD_PROBES] for i in range(COLD_PROBES)] if len(spans) > COLD_PROBES else spans
    absent = 0
    for offset, _ in probed:
        try:
            os.preadv(fd, [buf], offset, flag)
        except BlockingIOError:
            absent += 1
        except OSError:  # EOPNOTSUPP and the like: no answer
            return False
    return absent > COLD_FRACTION * len(probed)


COLD_PROBES = 64
"""At most this many 1-byte probes a file where :func:`is_cold` cannot ask mincore."""


class _Prefetch:
    """Reads of the next tensors of a file, in file order, started before their turn: ranged GETs
    of a remote file (a store's latency is paid once per window, not once per tensor), positioned
    reads of a local one (page faults and copies on idle cores while this thread shards).
    Bounded: at most ``window`` reads and :data:`PREFETCH_BYTES` in flight or waiting to be taken;
    a planned read whose turn passed without it (read directly instead) is dropped."""

    def __init__(self, load: _StreamingLoad, source, path: str, entries, window: int):
        from concurrent.futures import ThreadPoolExecutor

        self.load, self.source, self.path = load, source, path
        self.window = max(1, window)
        self.pool = ThreadPoolExecutor(self.window, thread_name_prefix="hsdp-prefetch")
        self.plan = [(key, info, rows) for key, info in entries
                     if (rows := load._planned_rows(key, info)) is not None]
        self.position = {key: i for i, (key, _, _) in enumerate(self.plan)}
        self.next = 0
        self.futures: dict[int, tuple[tuple[int, int], int, object]] = {}  # plan position -> rows, bytes, future
        self._fill()

    def _fill(self) -> None:
        while self.next < len(self.plan) and len(self.futures) < self.window:
            key, info, (start, stop) = self.plan[self.next]
            nbytes = row_span(info, start, stop)[2]
            if self.futures and sum(b for _, b, _ in self.futures.values()) + nbytes > PREFETCH_BYTES:
                return
            # one GET per tensor here: the window is the concurrency
            future = self.pool.submit(read_rows, self.source, info, start, stop, path=self.path,
                                      pin_memory=self.load.pin_reads, concurrency=1)
            self.futures[self.next] = ((start, stop), nbytes, future)
            self.next += 1

    def take(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        position = self.position.get(key)
        if position is None:
            return None
        for earlier in [p for p in self.futures if p < position]:  # their turn passed: read directly
            self.futures.pop(earlier)[2].cancel()
        self.next = max(self.next, position)
        entry = self.futures.pop(position, None)
        data = None
        if entry is not None and entry[0] == (start, stop):
            data = entry[2].result()
        elif entry is not None:
            entry[2].cancel()
        self.next = max(self.next, position + 1)
        self._fill()
        return data

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


PREFETCH_BYTES = 512 << 20
"""A rank's prefetched bytes at most (one read is always allowed, however large)."""


class _StreamingLoad:
    """One load: plan the units, stream the files, shard each unit as it completes."""

    def __init__(self, model: nn.Module, context: HSDPShardContext, files, *, read_mode, may_cast, stats, progress,
                 load_concurrency: int = 8, map_files: bool = True):
        self.load_concurrency = load_concurrency
        # Rows of warm local files as views of a private mapping, where the ranks compute on the host
        # (a GPU's copies want page-locked reads): :func:`maps_rows`.
        self.map_files = map_files and context.target_device.type == "cpu"
        self._mapping = None  # the file being read's, while it is read
        self.bytes_done = 0  # checkpoint bytes processed, for progress
        self._prefetch: _Prefetch | None = None
        # a slow load for tests and demos of progress: seconds per checkpoint tensor
        self.delay_s = float(os.environ.get("HSDP_INJECT_LOAD_DELAY", "0") or 0)
        self.model, self.context, self.files = model, context, files
        # Page-locked reads whenever the ranks compute on a GPU (asynchronous copies; FSDP's CPU
        # offload pins its host shards too).
        self.pin_reads = context.target_device.type == "cuda"
        self.read_mode, self.may_cast, self.stats = read_mode, may_cast, stats
        self.progress = progress
        self.skipped: list[str] = []  # checkpoint tensors the model does not use, as from_pretrained skips them
        self.layout = describe_layout(model)
        # transformers' own renamings and conversions (fused experts, say), planned from the keys
        self.conversions = plan_conversions(model, files.tensors, self.layout.expected)
        self.strip, self.add = match_key_prefix(model, self.conversions.model_keys, set(self.layout.expected))
        shard_mesh = context.mesh["shard"]
        self.shard_size, self.shard_rank = shard_mesh.size(), shard_mesh.get_local_rank()
        # Sharded parameters materialise on the host when FSDP offloads them there.
        offloaded = isinstance(context.offload_policy, CPUOffloadPolicy)
        self.local_device = torch.device("cpu") if offloaded else context.target_device
        # linears quantized as their rows arrive (--quantization): model weight name -> its layer
        self.on_load = {f"{fqn}.weight": m for fqn, m in model.named_modules() if getattr(m, "quantize_on_load", False)}
        self.into: dict[str, tuple[torch.Tensor, int]] | None = None  # a live model's tensors (update_hsdp_model)
        self._plan_units()

    def _plan_units(self) -> None:
        self.root = _Unit("", self.model)
        units = [_Unit(name, module) for name, module in select_units(self.model, self.context.shard_conditions)]
        self.units = units + [self.root]

        by_name = {u.name: u for u in units}

        def owner(fqn: str, exclude: _Unit | None = None) -> _Unit:
            return by_name.get(owning_unit(fqn, by_name, exclude.name if exclude else None), self.root)

        for unit in units:
            unit.parent = owner(unit.name, exclude=unit)
            unit.parent.children.append(unit)
        # a parameter that modules of several units hold (Zamba's shared blocks) stays out of FSDP
        # (replicated) and is the root's: it arrives whole, and goes into every module holding it last
        self.owner = {}
        for name in self.layout.expected:
            unit = self.root if name in self.context.tied_param_names else owner(name)
            unit.remaining.add(name)
            self.owner[name] = unit
        # each unit's own modules (not its nested units'), whose buffers _install puts in, and the
        # parameter slots it fills: (module, key, model tensor), in every module holding the tensor
        self.modules_of: dict[_Unit, list[tuple[str, nn.Module]]] = {u: [] for u in units}
        self.modules_of[self.root] = [("", self.model)]
        self.slots_of: dict[_Unit, list[tuple[nn.Module, str, str]]] = {u: [] for u in self.units}
        for fqn, module in self.model.named_modules():
            if fqn:
                self.modules_of[owner(fqn)].append((fqn, module))
            prefix = f"{fqn}." if fqn else ""
            for key, _ in module.named_parameters(recurse=False, remove_duplicate=False):
                name = self.layout.aliases.get(prefix + key, prefix + key)
                self.slots_of[self.owner[name]].append((module, key, name))

    # -- reading ---------------------------------------------------------------------------
    def _model_key(self, key: str) -> str | None:
        if self.strip:
            if not key.startswith(self.strip):
                return None  # another class's head (transformers drops these too)
            key = key[len(self.strip):]
        return self.add + key

    def _ignored(self, name: str) -> bool:
        """A tensor the model does not have, that from_pretrained skips (its unexpected-key patterns)."""
        return any(p.search(name) for p in self.layout.ignore_unexpected)

    def _is_sharded(self, name: str) -> bool:
        t = self.layout.expected[name]
        return isinstance(t, nn.Parameter) and t.dim() > 0 and name not in self.context.ignored_param_names

    def run(self) -> None:
        for unit in self.units:  # units with nothing to read (all tied, say) complete at once
            if not unit.remaining and not unit.children:
                self._complete(unit)
        total = sum(info.nbytes for _, info in self.files.tensors.values())
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="loading",
            disable=not _is_rank_zero(),
            mininterval=1.0,
        )
        with bar:
            for path in self.files.files:
                bar.set_postfix_str(os.path.basename(path), refresh=False)
                self._read_file(path, bar)
        if self.stats.tensors_converted and _is_rank_zero():
            logger.info("converted %d tensor(s) from the checkpoint's layout as from_pretrained does%s",
                        self.stats.tensors_converted,
                        f"; {self.stats.converted_whole_bytes / 1e6:.1f} MB read whole by every rank (conversions "
                        "that do not keep rows local)" if self.stats.converted_whole_bytes else
                        " (each rank read its own rows' sources)")
        if self.skipped and _is_rank_zero():
            logger.info("skipped %d checkpoint tensor(s) the model does not use, as from_pretrained does: %s%s",
                        len(self.skipped), ", ".join(self.skipped[:3]), ", ..." if len(self.skipped) > 3 else "")
        missing = sorted(set().union(*(u.remaining for u in self.units)))
        if missing:
            raise MissingTensorError(
                f"{len(missing)} tensor(s) missing from the checkpoint, first: {missing[:5]}",
                path=self.files.directory,
                tensor=missing[0],
            )
        assert self.root.done, "every tensor arrived but the root was not sharded"
        if self.context.target_device.type == "cuda":
            torch.cuda.synchronize(self.context.target_device)  # the load's time includes its copies

    def _read_file(self, path: str, bar) -> None:
        entries = sorted(
            ((key, info) for key, (p, info) in self.files.tensors.items() if p == path), key=lambda e: e[1].start
        )
        remote = self.files.remote.get(path)  # an s3:// object: ranged GETs instead of reads
        fd = remote if remote is not None else os.open(path, os.O_RDONLY)
        try:
            cold = remote is None and is_cold(fd, self._rank_spans(entries))
            if remote is None and maps_rows(self.map_files, cold):
                self._mapping = map_file(fd)
            # the next tensors in flight while this one is sharded: GETs from a store; positioned reads of a local
            # file where the host has cores its ranks leave idle (:func:`local_read_ahead`); none of a mapped one
            window = self.load_concurrency if remote is not None else 0 if self._mapping is not None else (
                local_read_ahead(self.load_concurrency, cold=cold))
            if window:
                self._prefetch = _Prefetch(self, fd, path, entries, window)
            for key, info in entries:
                self._read_tensor(fd, path, key, info)
                bar.update(info.nbytes)
                self.bytes_done += info.nbytes  # (bar.n stays 0 where the bar is disabled: ranks but 0)
                if self.progress is not None:
                    self.progress(self.bytes_done, bar.total)
        finally:
            if self._prefetch is not None:
                self._prefetch.close()
                self._prefetch = None
            self._mapping = None  # (the rows taken from it hold it; it goes with the last of them)
            if remote is None:
                os.close(fd)
        self.stats.files_read += 1

    def _rank_spans(self, entries) -> list[tuple[int, int]]:
        """The bytes of a file this rank reads, as (offset, bytes) a tensor: its rows of a tensor the
        model shards (in a sliced load), the whole of one it holds whole or a conversion reads, none of
        one the model does not have."""
        out = []
        for key, info in entries:
            name = self._model_key(key) if key not in self.conversions.target_of else None
            if name is not None and name not in self.layout.expected:
                continue  # not the model's (another class's head, an unexpected key): never read
            start, stop = self._rows_to_read(name, info) if name is not None else (0, info.shape[0] if info.shape else 0)
            _, offset, nbytes = row_span(info, start, stop)
            if nbytes:
                out.append((offset, nbytes))
        return out

    def _read_tensor(self, fd: int, path: str, key: str, info) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if key in self.conversions.target_of:
            self._read_source(fd, path, key, info, self.conversions.target_of[key])
            return
        name = self._resolve(path, key, info)
        if name is None or (name in self.owner and (self.owner[name].done or name not in self.owner[name].remaining)):
            return  # not the model's, or a tied copy of a tensor already read
        start, stop = self._rows_to_read(name, info)
        if self.into is not None and self._read_into_live(fd, path, name, info, start, stop):
            return
        data = self._fetch(fd, path, key, info, start, stop)
        self.stats.bytes_read += data.numel() * info.dtype.itemsize
        self.stats.tensors_read += 1
        if name in self.on_load:  # this rank's rows, quantized now: nothing dense is kept
            prefix = name.removesuffix("weight")
            rows = data.to(self.layout.expected[prefix + "weight_scale"].dtype)
            for stored, value in quantize_rows(rows, self.on_load[name].format).items():
                self._deliver(prefix + stored, value)
            return
        self._deliver(name, data)

    def _resolve(self, path: str, key: str, info) -> str | None:
        """The model tensor checkpoint tensor ``key`` (not a conversion's source) becomes, checked
        against the model's shape and dtype from its header alone; None where the model does not
        use it (another class's head, a tensor from_pretrained skips too)."""
        name = self._model_key(self.conversions.renamed.get(key, key))
        if name is None:
            return None
        name = self.layout.aliases.get(name, name)
        expected = self.layout.expected.get(name)
        if expected is None:
            if self._ignored(name):
                self.skipped.append(key)
                return None
            raise UnexpectedTensorError("the model has no parameter or buffer of this name", path=path, tensor=key)
        if tuple(expected.shape) != info.shape:
            raise ShapeMismatchError(
                f"checkpoint shape {list(info.shape)} != model shape {list(expected.shape)}", path=path, tensor=key
            )
        if name not in self.on_load:
            self._check_dtype(expected, info, path, key)
        elif not info.dtype.is_floating_point:
            raise DTypeMismatchError(f"--quantization quantizes floating weights, not {info.dtype}", path=path,
                                     tensor=key)
        return name

    def check_complete(self) -> None:
        """Every check reading makes, from the headers alone, before a byte is read: each
        checkpoint tensor the model's (shape, dtype) and every model tensor given by one."""
        given: set[str] = set()
        for key, (path, info) in self.files.tensors.items():
            target = self.conversions.target_of.get(key)
            if target is not None:
                name = self._model_key(target.name)
                if name is not None and name in self.layout.expected:
                    self._check_dtype(self.layout.expected[name], info, path, key)
                    given.add(name)
                continue
            name = self._resolve(path, key, info)
            if name is not None:
                given.add(name)
                if name in self.on_load:  # quantized as it is read: its scale comes with it
                    given.add(name.removesuffix("weight") + "weight_scale")
        self.skipped.clear()
        missing = sorted(set(self.layout.expected) - given)
        if missing:
            raise MissingTensorError(f"{len(missing)} tensor(s) missing from the checkpoint, first: {missing[:5]}",
                                     path=self.files.directory, tensor=missing[0])

    def _fetch(self, fd, path: str, key: str, info, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of ``key``: a view of the file's mapping where it is mapped, prefetched
        where a GET for them is in flight, else read now."""
        if self._mapping is not None:
            rows = mapped_rows(self._mapping, info, start, stop, path=path)
            if rows is not None:
                self.stats.bytes_mapped += rows.numel() * info.dtype.itemsize
                return rows
        prefetched = self._prefetch.take(key, start, stop) if self._prefetch is not None else None
        if prefetched is not None:
            return prefetched
        return read_rows(fd, info, start, stop, path=path, pin_memory=self.pin_reads, concurrency=self.load_concurrency)

    def _planned_rows(self, key: str, info) -> tuple[int, int] | None:
        """The rows :meth:`_read_tensor` will read of checkpoint tensor ``key``, decided as it
        decides; None where it reads none or where only reading tells (an alias, a mismatch: those
        are read, or refused, when their turn comes)."""
        n = info.shape[0] if info.shape else 0
        if key in self.conversions.target_of:
            target = self.conversions.target_of[key]
            name = self._model_key(target.name)
            if name is None or name not in self.layout.expected:
                return None
            return (0, n) if self._reads_source(name, target, target.position(key)[1]) else None
        name = self._model_key(self.conversions.renamed.get(key, key))
        expected = self.layout.expected.get(name) if name is not None else None
        if expected is None or name in self.layout.aliases or tuple(expected.shape) != info.shape:
            return None
        return self._rows_to_read(name, info)

    def _rows_to_read(self, name: str, info) -> tuple[int, int]:
        """The rows of model tensor ``name`` this rank reads: its shard's when sliced, else all."""
        if self.read_mode == "sliced" and self._is_sharded(name):
            return shard_rows(info.shape[0], self.shard_size, self.shard_rank)
        return 0, (info.shape[0] if info.shape else 0)

    def _reads_source(self, name: str, target: ConversionTarget, index: int) -> bool:
        """Whether this rank reads source ``index`` of a conversion into ``name`` (all of them,
        unless the conversion keeps rows local: then those of its own rows)."""
        rows = self._rows_of(name, target)
        return rows is None or rows[0] <= index < rows[1]

    def _check_dtype(self, expected: torch.Tensor, info, path: str, key: str) -> None:
        if expected.dtype != info.dtype and not (  # (never a 1-byte float: FP8 means scales somewhere)
            self.may_cast and expected.dtype.is_floating_point and info.dtype.is_floating_point
            and info.dtype.itemsize > 1
        ):
            raise DTypeMismatchError(
                f"checkpoint dtype {info.dtype} != model dtype {expected.dtype} (pass dtype= to cast)",
                path=path,
                tensor=key,
            )

    def _deliver(self, name: str, data: torch.Tensor) -> None:
        """``data`` (this rank's rows of model tensor ``name``, on the host) joins its unit."""
        expected = self.layout.expected[name]
        device = self.local_device if self._is_sharded(name) else self.context.target_device
        if device.type == "cuda":
            # From page-locked memory the copy runs while the next tensor is read; PyTorch's
            # host allocator keeps the buffer until the copy has finished. Cast on the GPU.
            data = data.to(device, non_blocking=True)
        unit = self.owner[name]
        unit.pending[name] = data.to(expected.dtype)
        unit.remaining.discard(name)
        self.stats.events.append(("tensor", name))
        if not unit.remaining:
            self._complete(unit)

    # -- from a peer group (loaders.peer) -----------------------------------------------------
    def manifest(self) -> list[Slot]:
        """Every tensor this load delivers, in the model's order (its units complete in turn)."""
        return [Slot(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), self._is_sharded(name))
                for name, t in self.layout.expected.items()]

    def deliver_received(self, name: str, rows: torch.Tensor, done: int, total: int) -> None:
        """This rank's rows of ``name`` as a peer sent them (shape and dtype as the manifest says)."""
        if not self.stats.bytes_received:  # units with nothing to receive (all tied, say) complete at once
            for unit in self.units:
                if not unit.done and not unit.remaining and not unit.children:
                    self._complete(unit)
        self.stats.bytes_received += rows.numel() * rows.element_size()
        self.stats.tensors_read += 1
        self._deliver(name, rows)
        if self.progress is not None:
            self.progress(done, total)

    def finish_received(self) -> None:
        for unit in self.units:
            if not unit.done and not unit.remaining and not unit.children:
                self._complete(unit)
        missing = sorted(set().union(*(u.remaining for u in self.units)))
        if missing:
            raise MissingTensorError(f"{len(missing)} tensor(s) never arrived from the peer, first: {missing[:5]}",
                                     tensor=missing[0])
        assert self.root.done, "every tensor arrived but the root was not sharded"
        if self.context.target_device.type == "cuda":
            torch.cuda.synchronize(self.context.target_device)

    # -- conversions -----------------------------------------------------------------------
    def _read_source(self, fd: int, path: str, key: str, info, target: ConversionTarget) -> None:
        """One checkpoint tensor feeding a conversion: read where this rank needs it (a row-local
        target: only the sources of its own rows), and run the chain once every source is in."""
        name = self._model_key(target.name)
        if name is not None and name not in self.layout.expected and self._ignored(name):
            self.skipped.append(key)  # as from_pretrained (an extra prediction layer, say)
            name = None
        if name is not None:
            expected = self.layout.expected.get(name)
            if expected is None:
                raise UnexpectedTensorError(f"converted to {target.name}, which the model does not have", path=path,
                                            tensor=key)
            self._check_dtype(expected, info, path, key)
            pattern, index = target.position(key)
            if self._reads_source(name, target, index):
                data = self._fetch(fd, path, key, info, 0, info.shape[0] if info.shape else 0)
                target.collected[pattern][index] = data
                nbytes = data.numel() * info.dtype.itemsize
                self.stats.bytes_read += nbytes
                self.stats.tensors_read += 1
                if not target.row_local:
                    self.stats.converted_whole_bytes += nbytes
        target.remaining -= 1
        if target.remaining == 0:
            self._convert(target, name, path)

    def _rows_of(self, name: str, target: ConversionTarget) -> tuple[int, int] | None:
        """The rows [a, b) of a row-local target this rank reads the sources of; None: all."""
        if not (target.row_local and self.read_mode == "sliced" and self._is_sharded(name)):
            return None
        return shard_rows(target.rows, self.shard_size, self.shard_rank)

    def _convert(self, target: ConversionTarget, name: str | None, path: str) -> None:
        if name is None:  # another class's head: nothing was read
            return
        rows = self._rows_of(name, target)
        if rows is not None and rows[0] == rows[1]:  # this rank owns none of its rows
            expected = self.layout.expected[name]
            outputs = {target.name: torch.empty((0, *expected.shape[1:]), dtype=expected.dtype)}
        else:
            outputs = target.run(self.model)
        self.stats.tensors_converted += len(outputs)
        for key, data in outputs.items():
            out = self._model_key(key)
            expected = self.layout.expected.get(out) if out is not None else None
            if expected is None:
                raise UnexpectedTensorError(f"a conversion made {key}, which the model does not have", path=path,
                                            tensor=key)
            full = tuple(expected.shape)
            if rows is not None:  # row-local: the chain made this rank's rows only
                want = (rows[1] - rows[0], *full[1:])
            else:
                want = full
            if tuple(data.shape) != want:
                raise ShapeMismatchError(f"converted shape {list(data.shape)} != model shape {list(want)}", path=path,
                                         tensor=key)
            if rows is None and self.read_mode == "sliced" and self._is_sharded(out):
                start, stop = shard_rows(full[0], self.shard_size, self.shard_rank)
                data = data[start:stop].clone()  # the whole was converted; this rank keeps its rows
            self._deliver(out, data.contiguous())

    # -- sharding --------------------------------------------------------------------------
    def _complete(self, unit: _Unit) -> None:
        if unit.remaining or any(not c.done for c in unit.children):
            return
        with self.stats.phase("shard"):
            if self.into is not None:
                self._write_live(unit)
            elif self.read_mode == "sliced":
                self._shard(unit)  # on meta: no memory until the rows read are installed
                self._install(unit)
            else:
                self._install(unit)
                self._shard(unit)  # fully_shard chunks the full tensors; they are freed after
        unit.pending.clear()
        unit.done = True
        self.stats.units_sharded += 1
        self.stats.events.append(("shard", unit.name))
        if unit.parent is not None:
            self._complete(unit.parent)

    def _read_into_live(self, fd, path: str, name: str, info, start: int, stop: int) -> bool:
        """A live update's rows of ``name`` read straight into the shard that holds them (no buffer,
        no copy) where they are stored as held: the same dtype, a contiguous host tensor, no
        conversion; False where they must go through a buffer."""
        held = self.into[name][0]
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        if (name in self.on_load or held.dtype != info.dtype or held.device.type != "cpu"
                or not held.is_contiguous() or tuple(held.shape) != shape or self._prefetch is not None):
            return False
        self.stats.tensors_written += 1  # (from the first byte: a failed read leaves it part written)
        read_rows(fd, info, start, stop, path=path, concurrency=self.load_concurrency, out=held)
        self.stats.bytes_read += held.numel() * info.dtype.itemsize
        self.stats.tensors_read += 1
        unit = self.owner[name]
        unit.pending[name] = None  # in place already
        unit.remaining.discard(name)
        if not unit.remaining:
            self._complete(unit)
        return True

    def _write_live(self, unit: _Unit) -> None:
        """Copy the unit's rows read into the live model's own tensors (its shards, its whole ones)."""
        with torch.no_grad():
            for name, data in unit.pending.items():
                if data is None:  # read in place (_read_into_live)
                    continue
                held = self.into[name][0]
                if tuple(held.shape) != tuple(data.shape):
                    raise ShapeMismatchError(f"rows read {list(data.shape)} != rows held {list(held.shape)}",
                                             path=self.files.directory, tensor=name)
                held.copy_(data)
                self.stats.tensors_written += 1

    def _shard(self, unit: _Unit) -> None:
        if unit is self.root:
            finalize_hsdp_root(self.model, self.context)
        else:
            shard_hsdp_module(unit.module, self.context)

    def _install(self, unit: _Unit) -> None:
        """Put the tensors read into the unit's own modules (not its nested units').

        The tensors read become the parameters themselves, sharded ones as the local tensor of
        a DTensor, as ``load_state_dict(assign=True)`` does: no second allocation and copy.
        FSDP2 adopts a replaced sharded parameter at its lazy init (``reset_sharded_param``).
        """
        installed: dict[int, nn.Parameter] = {}  # keeps tied parameters tied
        for module, key, name in self.slots_of[unit]:
            old = module.get_parameter(key)  # (FSDP2's sharded one, where the unit was sharded first)
            if id(old) not in installed:
                installed[id(old)] = self._as_parameter(name, old, unit.pending[name])
            set_parameter(module, key, installed[id(old)])
        for fqn, module in self.modules_of[unit]:
            prefix = f"{fqn}." if fqn else ""
            for key, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                # persistent ones were read; the others were built real
                set_buffer(module, key, unit.pending.get(prefix + key, buf).to(self.context.target_device))

    def _as_parameter(self, name: str, old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
        if isinstance(old, DTensor):
            try:
                return parameter_like(old, data.to(self.local_device))
            except ValueError as e:
                raise ShapeMismatchError(f"rows read: {e}", path=self.files.directory, tensor=name) from e
        return nn.Parameter(data.to(self.context.target_device), requires_grad=False)


def _model_named_tensors(model: nn.Module, files) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                         dict[str, tuple[list[str], int]]]:
    """The checkpoint's tensors under the model's names (transformers' renamings, then the
    prefix mapping, as :class:`_StreamingLoad` maps them) -> (shape, dtype); and the model
    tensors conversions make -> (their sources' keys under the same prefix mapping, in the
    chain's order; the number of source patterns, the parts a concatenation joins)."""
    conversions = plan_conversions(model, files.tensors)
    renamed = conversions.renamed
    layout = describe_layout(model)
    keys = {renamed.get(key, key): info for key, (_, info) in files.tensors.items()}
    strip, add = match_key_prefix(model, set(keys) | conversions.model_keys, set(layout.expected))

    def model_key(key: str) -> str:
        return add + key[len(strip):]

    stored = {model_key(key): (info.shape, info.dtype) for key, info in keys.items() if key.startswith(strip)}
    targets = list(conversions.targets)
    # experts stored as quantized linears (compressed-tensors' ``weight_packed``, GPTQ's and AWQ's ``qweight``
    # under each expert's name) match no converter by those names: planned by their weights' names, as a
    # dense checkpoint stores them (loaders.quantization.experts.quantize_linear_experts takes the tensors)
    packed = [key.rpartition(".")[0] + ".weight" for key in files.tensors if key.endswith((".weight_packed", ".qweight"))]
    if packed:
        targets += plan_conversions(model, packed).targets
    fused = {model_key(t.name): ([model_key(k) for keys in t.sources.values() for k in keys], len(t.sources))
             for t in targets if t.name.startswith(strip)}
    return stored, fused


def _quantize_skeleton(model: nn.Module, plan, files) -> dict[str, int]:
    """The skeleton's linears that the checkpoint stores quantized become QuantizedLinear, its
    quantized experts their quantized forms (:mod:`loaders.quantization`); returns {format: layers}."""
    stored, fused = _model_named_tensors(model, files)
    counts, taken = quantize_skeleton(model, plan, stored, path=files.directory, fused=fused)
    check_nothing_else_quantized(model, stored, path=files.directory, taken=taken)
    if not counts:
        raise CheckpointError(f"quantization_config says {plan.method} but no layer's quantized tensors are in the "
                              "checkpoint", path=files.directory)
    if _is_rank_zero():
        logger.info("quantized checkpoint (%s): %s", plan.method,
                    ", ".join(f"{n} layer(s) {what}" for what, n in counts.items()))
    return counts


def _skeleton(config, files, model_class, dtype: torch.dtype, quantization, quantize: str | None, stats) -> nn.Module:
    """The meta skeleton of ``config`` in ``dtype``, its linears quantized as the checkpoint ships
    them (``quantization``) or as ``quantize`` asks."""
    model = build_skeleton(config, model_class, dtype)
    if quantization is not None:
        stats.quantized_layers = _quantize_skeleton(model, quantization, files)
        if quantize and _is_rank_zero():
            logger.info("--quantization %s ignored: the checkpoint ships quantized (%s)", quantize, quantization.method)
    elif quantize:
        names = set(_model_named_tensors(model, files)[0])
        stats.quantized_layers = quantize_skeleton_on_load(model, quantize, dtype, names)
    return model


def update_hsdp_model(loaded: LoadedModel, model_dir: str, *, dtype: torch.dtype | str | None = None,
                      model_class=None, quantize: str | None = None, load_concurrency: int = 8,
                      check_only: bool = False, map_files: bool = True) -> LoadStats:
    """Stream checkpoint ``model_dir`` into ``loaded.model`` in place: this rank reads only its rows
    of every sharded tensor (as :func:`load_hsdp_model` does, with the same ``dtype`` and
    ``quantize``) and copies each unit's rows into its shards as the unit completes: at most one
    unit's rows (and the reads in flight) beyond the model.

    Everything is checked from the config and headers before a byte is read: the model it makes
    must be the one served tensor for tensor (name, shape, dtype, sharding: ``ShapeMismatchError``
    naming the first that differs), every checkpoint tensor the model's, none missing.
    ``check_only`` stops there. No collective: every rank of the group calls it at the same step,
    and the caller refreshes what was built from the shards (private gathered copies, packed
    linears). A failure after the first write leaves the model part old, part new: the caller must
    not serve it. Returns the load's stats (``bytes_read``, ``tensors_written``)."""
    device = loaded.context.target_device
    stats = LoadStats(read_mode="sliced")
    with stats.phase("preflight"):
        config = load_config(model_dir)
        quantization = quantization_plan(config, path=os.path.join(model_dir, "config.json"))
        files = list_checkpoint_files(model_dir)
        stats.checkpoint_bytes = files.total_bytes
        skeleton_dtype, may_cast = _resolve_dtype(dtype, config, files, device)
        model = _skeleton(config, files, model_class or auto_model_class(config), skeleton_dtype, quantization,
                          quantize, stats)
        load = _StreamingLoad(model, loaded.context, files, read_mode="sliced", may_cast=may_cast, stats=stats,
                              progress=None, load_concurrency=load_concurrency, map_files=map_files)
        difference = manifest_difference(loaded.manifest, load.manifest(), sides=("served", "in the new checkpoint"))
        if difference is not None:
            raise ShapeMismatchError(f"the checkpoint makes another model than the one served: {difference}",
                                     path=model_dir)
        load.check_complete()
    if check_only:
        return stats
    with stats.phase("stream"):
        load.into = held_tensors(loaded.model)
        try:
            load.run()
        except Exception as e:
            if stats.tensors_written:
                raise PartialUpdateError(f"{stats.tensors_written} tensor(s) written before {type(e).__name__}: {e}",
                                         path=model_dir) from e
            raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return stats


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def load_hsdp_model(
    model_dir: str,
    hsdp_config: HSDPInferenceConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    model_class=None,
    read_mode: str = "sliced",
    progress: Callable[[int, int], None] | None = None,
    require_tokenizer: bool = False,
    load_concurrency: int = 8,
    quantize: str | None = None,
    peer: Callable[[dict], object] | None = None,
    map_files: bool = True,
) -> LoadedModel:
    """Load a safetensors checkpoint straight into an HSDP-sharded model: a local directory, or
    one an ``s3://`` URL resolved to (:mod:`loaders.sources.s3`), whose weights every rank then
    reads from the store, ``load_concurrency`` ranged GETs at once for a large read.

    Every rank calls this with the same arguments. ``dtype=None`` keeps the checkpoint's dtype
    (a tensor of another dtype is an error); ``"auto"`` keeps it where the device computes in it
    natively and loads float32 elsewhere; a ``dtype`` casts floating tensors to it.
    ``read_mode="sliced"`` reads only this rank's rows of each sharded tensor; ``"full"``
    reads whole tensors and lets ``fully_shard`` chunk them. ``progress(done, total)`` is called
    with checkpoint bytes processed as each tensor arrives. ``map_files``: on the host, a warm
    local file's rows are views of a private mapping of it, not copies (:func:`maps_rows`; such a
    file must not be rewritten in place while it is served). ``quantize`` (``"int8"``, ``"fp8"``)
    quantizes a plain checkpoint's linears by rows as they are read
    (:mod:`loaders.quantization.on_load`); a checkpoint that ships quantized is loaded as it ships.

    Everything cheap is checked on every rank before any weight is read: the config, the index
    and every file's header, the tokenizer and generation config (``require_tokenizer``: a
    checkpoint without tokenizer files is a :class:`MissingTokenizerError`), and the mesh.
    """
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    hsdp_config.resolve_mesh_shape(world_size)  # a mesh that does not fit fails before any read
    if not dist.is_initialized():
        raise RuntimeError("load_hsdp_model needs torch.distributed initialised (world size 1 is fine)")
    device = torch.device(device) if device is not None else default_device()
    stats = LoadStats(read_mode=read_mode, rss_before_bytes=read_proc_status("VmRSS"))
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    error = None
    try:
        with stats.phase("preflight"):
            config = load_config(model_dir)
            # an unsupported quantization is refused before the files are even listed
            quantization = quantization_plan(config, path=os.path.join(model_dir, "config.json"))
            if (quantization is not None or quantize) and hsdp_config.param_dtype is not None:
                # FSDP2 would cast FP8 weights to it in the all-gather, without their scales
                raise UnsupportedQuantizationError(
                    f"param_dtype {hsdp_config.param_dtype} with a quantized checkpoint (its weights are gathered as "
                    "stored and dequantized by their layers)", path=os.path.join(model_dir, "config.json"))
            files = list_checkpoint_files(model_dir)
            stats.checkpoint_bytes = files.total_bytes
            skeleton_dtype, may_cast = _resolve_dtype(dtype, config, files, device)
            tokenizer = load_tokenizer(model_dir, required=require_tokenizer)
            generation_config = load_generation_config(model_dir)
        with stats.phase("skeleton"):
            model = _skeleton(config, files, model_class or auto_model_class(config), skeleton_dtype, quantization,
                          quantize, stats)
            if generation_config is not None and hasattr(model, "generation_config"):
                model.generation_config = generation_config
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, see _agree
        error = e
    _agree(error, "preflight")

    with stats.phase("mesh"):
        context = prepare_hsdp_shard_context(model, hsdp_config, device)
    error = None
    try:
        with stats.phase("stream"):
            load = _StreamingLoad(
                model, context, files, read_mode=read_mode, may_cast=may_cast, stats=stats, progress=progress,
                load_concurrency=load_concurrency, map_files=map_files,
            )
            if peer is not None:
                from loaders.peer import receive_from_peer

                receive_from_peer(load, peer, files, hsdp_config.resolve_mesh_shape(world_size), device)
            else:
                load.run()
    except Exception as e:  # noqa: BLE001
        error = e
    _agree(error, "streaming" if peer is None else "the transfer from a peer")
    stats.phase_seconds["shard"] = stats.phase_seconds.get("shard", 0.0)
    stats.phase_seconds["total"] = sum(v for k, v in stats.phase_seconds.items() if k != "shard")
    stats.finish(device)
    if _is_rank_zero():
        logger.info(
            "loaded %s: %.1f MB %s by rank 0 of %.1f MB in %.2f s, %d units sharded",
            model_dir,
            (stats.bytes_read if peer is None else stats.bytes_received) / 1e6,
            "read" if peer is None else "received from a peer group",
            stats.checkpoint_bytes / 1e6,
            stats.phase_seconds["total"],
            stats.units_sharded,
        )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, stats=stats, context=context,
                       manifest=load.manifest(), files=files,
                       source="peer" if peer is not None else "storage")
