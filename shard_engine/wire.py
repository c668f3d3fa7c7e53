"""Object collectives without pickle: broadcast, gather and all-gather of plain data.

torch's ``*_object`` collectives pickle, so whoever reaches a group's store or gloo ports can run
code on every rank that receives. These carry only plain data (None, bool, int, float, str,
bytes, lists and dicts of them; a tuple is sent as a list) encoded with msgpack, whose decoder
builds nothing else and runs no code: an extension type is refused, a timestamp arrives as an int.
Whatever arrives is plain data and nothing more; turning it into the project's own types, and
refusing what does not fit them, is the receiver's (``server.engine.wire`` for the plans, a
record per error in ``loaders.errors``). A value that is not plain data, or bytes that are not
msgpack, raise :class:`WireError`.

On the wire a value is two tensors: its length (int64, shape [1]), then its bytes (uint8; the
gathers pad each rank's to the longest). They go over ``group`` on its own device: the CPU for
gloo, this rank's GPU for NCCL (the default group under ``--device cuda``). Every function is a
collective: every rank of ``group`` calls it, in the same order, whatever its value. Symmetry is
kept inside too: a value that cannot be encoded is sent as length 0, so every rank enters the
same collectives and every rank raises (the lengths go first, and every rank sees them all).
"""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist

MAX_BYTES = 1 << 30
"""The largest value received (a length above it is refused before anything is allocated)."""


class WireError(ValueError):
    """A value that is not plain data, or bytes that are not one msgpack value of plain data."""


def _refuse_ext(code: int, data: bytes):
    raise WireError(f"msgpack extension type {code} refused: only plain data crosses the wire")


def encode(value) -> bytes:
    """``value`` as one msgpack value; WireError where it is not plain data."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"not plain data: {e}") from None


def decode(data) -> object:
    """``data`` (bytes or a buffer) as the one plain value it encodes."""
    try:
        # strict_map_key=False: dicts keyed by int (a plan's rank -> work); timestamp=2: an int
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_refuse_ext, timestamp=2)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's errors (ExtraData, FormatError, ...) are all "not ours"
        raise WireError(f"not a msgpack value: {type(e).__name__}: {e}") from None


def _device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:  # an NCCL group moves only GPU tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """``data`` as ``size`` uint8s (zero-padded) on ``device``."""
    buf_N = torch.frombuffer(bytearray(data).ljust(size, b"\0"), dtype=torch.uint8)
    return buf_N.to(device)


def _decode_tensor(buf_N: torch.Tensor, length: int) -> object:
    return decode(memoryview(buf_N[:length].cpu().numpy()))


def _encode_for_wire(value) -> tuple[bytes, WireError | None]:
    # A value that cannot be encoded goes as length 0, and its rank raises once the lengths are
    # out: every rank still enters the same collectives, and every rank raises.
    try:
        return encode(value), None
    except WireError as e:
        return b"", e


def _check_length(length: int, rank) -> None:
    if length == 0:
        raise WireError(f"rank {rank} could not encode its value (not plain data): see its log")
    if length > MAX_BYTES:
        raise WireError(f"rank {rank} sent a value of {length} bytes (at most {MAX_BYTES} are taken)")


def broadcast(value, src: int, group=None):
    """``value`` of rank ``src`` (a global rank) on every rank of ``group``; the others' ``value``
    is ignored. ``src`` gets its own object back, the others its decoded copy."""
    device = _device(group)
    mine = dist.get_rank() == src
    data, error = _encode_for_wire(value) if mine else (b"", None)
    length_1 = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length_1, src=src, group=group)
    length = int(length_1.item())
    if error is not None:
        raise error
    _check_length(length, src)  # before allocating what a peer announced; every rank sees the same
    buf_N = _as_tensor(data, length, device) if mine else torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(buf_N, src=src, group=group)
    return value if mine else _decode_tensor(buf_N, length)


def _lengths(value, group, device: torch.device) -> tuple[bytes, list[int]]:
    """This rank's bytes and every rank's length (one all-gather); raises on every rank alike
    where a rank could not encode its value or sent too much."""
    data, error = _encode_for_wire(value)
    world = dist.get_world_size(group)
    mine_1 = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, mine_1, group=group)
    out = [int(t.item()) for t in lengths]
    if error is not None:
        raise error
    if not all(0 < n <= MAX_BYTES for n in out):
        ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
        for rank, length in zip(ranks, out):
            _check_length(length, rank)
    return data, out


def all_gather(value, group=None) -> list:
    """Every rank's ``value``, in ``group``'s rank order, on every rank (decoded, its own too)."""
    device = _device(group)
    data, lengths = _lengths(value, group, device)
    size = max(lengths)
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(bufs, _as_tensor(data, size, device), group=group)
    return [_decode_tensor(buf_N, n) for buf_N, n in zip(bufs, lengths)]


def gather(value, dst: int, group=None) -> list | None:
    """On rank ``dst`` (a global rank): every rank's ``value`` in ``group``'s rank order (decoded,
    its own too); None on the others. Two collectives: the lengths (all-gathered, so every rank
    pads to the longest), then the bytes."""
    device = _device(group)
    data, lengths = _lengths(value, group, device)
    size = max(lengths)
    mine = dist.get_rank() == dst
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in lengths] if mine else None
    dist.gather(_as_tensor(data, size, device), bufs, dst=dst, group=group)
    return [_decode_tensor(buf_N, n) for buf_N, n in zip(bufs, lengths)] if mine else None
