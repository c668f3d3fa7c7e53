"""Read rows of tensors from a safetensors file: positioned reads, or views of a private mapping.

We parse the header ourselves and either ``pread`` exactly the bytes of the rows a rank owns into
memory we allocate (:func:`read_rows`), or hand out those rows as views of a private,
copy-on-write mapping of the file (:func:`map_file`, :func:`mapped_rows`): the rows then are the
page cache's own pages, mapped into the process once (nothing zeroed, nothing copied), and they
stay only as long as a tensor holds them. ``safe_open(...).get_slice`` maps too, but copies the
rows out of its map and keeps the touched pages mapped until the file is closed: a rank reading
its half of a large file would count that half twice.
Format: 8-byte little-endian header length, a JSON header, then the raw data.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass

import torch

from loaders.errors import CorruptFileError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.nbytes


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate the header of ``path``; CorruptFileError names what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError("file too short for a safetensors header", path=path)
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CorruptFileError(f"header length {header_len} exceeds the file", path=path)
            raw = f.read(header_len)
    except OSError as e:
        raise CorruptFileError(f"cannot read safetensors file: {e.strerror or e}", path=path) from e
    return parse_header(raw, size, path)


def read_remote_header(remote) -> dict[str, TensorInfo]:
    """The header of a :class:`loaders.remote.RemoteFile`: one ranged GET of its first 64 KiB,
    a second for the rest of a longer header."""
    from loaders.remote import HEADER_PROBE_BYTES

    path, size = remote.url, remote.size
    if size < 8:
        raise CorruptFileError("object too short for a safetensors header", path=path)
    head = remote.read(0, min(size, HEADER_PROBE_BYTES))
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > min(_MAX_HEADER_BYTES, size - 8):
        raise CorruptFileError(f"header length {header_len} exceeds the object", path=path)
    raw = head[8:8 + header_len]
    if len(raw) < header_len:
        raw += remote.read(len(head), header_len - len(raw))
    return parse_header(raw, size, path)


def parse_header(raw: bytes, size: int, path: str) -> dict[str, TensorInfo]:
    """The tensors a header describes, checked against a file of ``size`` bytes."""
    header_len = len(raw)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"malformed safetensors header: {e}", path=path) from e
    if not isinstance(header, dict):
        raise CorruptFileError("malformed safetensors header: not a JSON object", path=path)
    data_start = 8 + header_len
    data_len = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptFileError(f"malformed header entry: {e!r}", path=path, tensor=name) from e
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise CorruptFileError("invalid shape or offsets in header", path=path, tensor=name)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CorruptFileError(
                f"header gives {end - begin} bytes for shape {list(shape)} {dtype}", path=path, tensor=name
            )
        if end > data_len:
            raise CorruptFileError(
                f"file is truncated: tensor data ends at byte {data_start + end} of {size}",
                path=path,
                tensor=name,
            )
        infos[name] = TensorInfo(name, dtype, shape, data_start + begin, end - begin)
    return infos


def read_bytes(source, offset: int, nbytes: int, *, path: str) -> bytes:
    """``nbytes`` bytes of a file from ``offset``: ``source`` a file descriptor or a RemoteFile."""
    out = bytearray(nbytes)
    if not isinstance(source, int):
        source.readinto(memoryview(out), offset, 1)
        return bytes(out)
    done = 0
    while done < nbytes:
        n = os.preadv(source, [memoryview(out)[done:]], offset + done)
        if n <= 0:
            raise CorruptFileError("unexpected end of file while reading", path=path)
        done += n
    return bytes(out)


def row_span(info: TensorInfo, start: int, stop: int) -> tuple[tuple[int, ...], int, int]:
    """Rows ``[start, stop)`` of ``info`` along dim 0 (the whole tensor when it has no dims):
    their shape, absolute byte offset in the file and byte count."""
    if info.shape:
        return (stop - start, *info.shape[1:]), info.start + start * info.row_bytes, (stop - start) * info.row_bytes
    return (), info.start, info.nbytes


def read_rows(source, info: TensorInfo, start: int, stop: int, *, path: str, pin_memory: bool = False,
              concurrency: int = 8, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``info`` along dim 0 (the whole tensor when it has no dims), into
    page-locked memory with ``pin_memory`` (so a copy to a GPU can run asynchronously). ``source``:
    a file descriptor (positioned reads) or a :class:`loaders.remote.RemoteFile` (ranged GETs,
    ``concurrency`` at once for a large read). ``out``: read into this contiguous host tensor of
    the rows' shape and dtype instead of a new one."""
    shape, offset, nbytes = row_span(info, start, stop)
    if out is None:
        out = torch.empty(shape, dtype=info.dtype, pin_memory=pin_memory)
    if nbytes and not isinstance(source, int):
        source.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()), offset, concurrency)
    elif nbytes:
        fd = source
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptFileError("unexpected end of file while reading", path=path, tensor=info.name)
            done += n
    return out


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux 5.14+: map a range's pages as reads would fault them, in one call (Python 3.11 lacks the name)."""


def map_file(fd: int) -> mmap.mmap | None:
    """A private mapping of the whole open file ``fd``, for :func:`mapped_rows`; None for an empty
    file or where the file cannot be mapped (a pipe, a file system without mmap: read it instead).

    Private and writable: a write into a tensor made from it (a live update of its shard) copies
    that page for this process and never reaches the file. Pages no tensor was made from are never
    touched. The file must not be truncated or rewritten in place while the mapping lives (a
    truncated page is SIGBUS at its next touch; a rewritten one not yet written here reads the new
    bytes): write a new file and rename it over the old, as ``save_pretrained`` into a new
    directory, the Hub cache and ``POST /admin/weights`` do."""
    try:
        if os.fstat(fd).st_size == 0:
            return None
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None


def mapped_rows(mapping: mmap.mmap, info: TensorInfo, start: int, stop: int, *, path: str) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of ``info`` as a view of ``mapping`` (:func:`map_file`), its pages
    mapped now (the load's time holds their faults, not the first step's); None where the rows
    cannot be a view (none of them, or an offset not a multiple of the dtype's size): read them."""
    shape, offset, nbytes = row_span(info, start, stop)
    itemsize = info.dtype.itemsize
    if not nbytes or offset % itemsize or offset + nbytes > len(mapping):
        return None
    rows = torch.frombuffer(mapping, dtype=info.dtype, count=nbytes // itemsize, offset=offset).view(shape)
    populate(mapping, offset, nbytes, rows, path=path, tensor=info.name)
    return rows


def populate(mapping: mmap.mmap, offset: int, nbytes: int, rows: torch.Tensor, *, path: str, tensor: str) -> None:
    """Map the pages of ``[offset, offset + nbytes)`` of ``mapping`` now: one madvise where the
    kernel has MADV_POPULATE_READ; else a read of one byte a page (a fault each, with the kernel's
    fault-around)."""
    page = mmap.PAGESIZE
    begin = offset // page * page
    try:
        mapping.madvise(MADV_POPULATE_READ, begin, offset + nbytes - begin)
        return
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise CorruptFileError(f"cannot map the file's pages: {e.strerror or e}", path=path, tensor=tensor) from e
    flat = rows.reshape(-1).view(torch.uint8)
    flat[::page].max()  # (a read of every page: each faults in)


@functools.cache
def _libc():
    """The C library's ``mmap``, ``mincore`` and ``munmap`` through ctypes, or None where it has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LOW_BIT = bytes(i & 1 for i in range(256))
RESIDENCY_PAGES = 1 << 18
RESIDENCY_WINDOW = 256
""":func:`resident_fraction` asks about every page of a rank's rows of a file up to this many (1 GiB of
4 KiB pages: mincore takes ~60 ns a page on a 2-core VM, 15 ms), and beyond it about this many in
windows of ``RESIDENCY_WINDOW`` pages evenly spaced through them (a 5 GB shard of a large
checkpoint: ~20 ms a file a rank, where all of its pages would take 75 ms)."""


def _may_ask_mincore(fd: int, stat: os.stat_result) -> bool:
    """Whether mincore tells this process the truth about ``fd``'s pages: since Linux 5.0 only for a
    file it owns or may write (else every page reads as resident), as the kernel's own test does
    (the owner or a capable process, else write permission: none on a read-only mount)."""
    if os.geteuid() in (0, stat.st_uid):
        return True
    effective = os.access in os.supports_effective_ids
    return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=effective)


def resident_fraction(fd: int, spans: list[tuple[int, int]]) -> float | None:
    """The fraction of the pages holding ``spans`` ([(offset, bytes)] of the open file ``fd``)
    that are in the page cache, from the kernel's own account (``mincore`` over a mapping of the
    file made for the question and unmapped after it: nothing is read or faulted in; beyond
    :data:`RESIDENCY_PAGES` pages, windows of them evenly spaced); None where it cannot say (no such
    call, a file that cannot be mapped, a file this process neither owns nor may write: mincore then
    calls every page resident, :func:`_may_ask_mincore`)."""
    libc = _libc()
    stat = os.fstat(fd)
    size = stat.st_size
    if libc is None or not size or not _may_ask_mincore(fd, stat):
        return None
    base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        page = mmap.PAGESIZE
        runs: list[list[int]] = []  # the spans' pages, as merged runs [first, end)
        for offset, nbytes in sorted(spans):
            end = min(offset + nbytes, size)
            if nbytes <= 0 or end <= offset:
                continue
            first, last = offset // page, -(-end // page)
            if runs and first <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], last)
            else:
                runs.append([first, last])
        if not runs:
            return 1.0
        total = sum(end - first for first, end in runs)
        if total <= RESIDENCY_PAGES:  # every page asked about (a call costs its range's pages, asked or not)
            low, span = runs[0][0], runs[-1][1] - runs[0][0]
            if span <= RESIDENCY_PAGES:  # one call over the runs' range, then each run's share of it
                vector = bytearray(span)
                if libc.mincore(base + low * page, span * page, (ctypes.c_ubyte * span).from_buffer(vector)) != 0:
                    return None
                resident_bits = vector.translate(_LOW_BIT)  # (a byte's other bits are undefined)
                absent = sum(resident_bits.count(0, first - low, end - low) for first, end in runs)
            else:  # a call a run
                vector = bytearray(max(end - first for first, end in runs))
                absent = 0
                for first, end in runs:
                    count = end - first
                    if libc.mincore(base + first * page, count * page,
                                    (ctypes.c_ubyte * count).from_buffer(vector)) != 0:
                        return None
                    absent += vector[:count].translate(_LOW_BIT).count(0)
            return (total - absent) / total
        # windows of the runs' pages evenly spaced through them, a call each
        stride = total // (RESIDENCY_PAGES // RESIDENCY_WINDOW)
        vector = bytearray(RESIDENCY_WINDOW)
        window = (ctypes.c_ubyte * RESIDENCY_WINDOW).from_buffer(vector)
        asked = absent = at = before = 0  # at: the next window's page among the runs' pages, before: this run's first
        for first, end in runs:
            while at < before + end - first:
                index = first + at - before
                count = min(RESIDENCY_WINDOW, end - index)
                if libc.mincore(base + index * page, count * page, window) != 0:
                    return None
                asked += count
                absent += vector.translate(_LOW_BIT).count(0, 0, count)
                at += stride
            before += end - first
        return (asked - absent) / asked
    finally:
        libc.munmap(base, size)
