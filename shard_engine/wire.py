"""Object collectives without pickle: broadcast, gather and all-gather of plain data.

torch's ``*_object`` collectives pickle, so whoever reaches a group's store or gloo ports can run
code on every rank that receives. These carry only plain data (None, bool, int, float, str,
bytes, lists and dicts of them; a tuple is sent as a list) encoded with msgpack, whose decoder
builds nothing else and runs no code: an extension type is refused, a timestamp arrives as an int.
Whatever arrives is plain data and nothing more; turning it into the project's own types, and
refusing what does not fit them, is the receiver's (``server.engine.wire`` for the plans, a
record per error in ``loaders.errors``). A value that is not plain data, or bytes that are not
msgpack, raise :class:`WireError`.

On the wire a value is one frame of :data:`FRAME_BYTES` uint8s: its length (8 bytes, little
endian), then as much of its bytes as fit. A value longer than that follows in a second
collective of its own (the gathers pad each rank's to the longest), which every rank enters
because every rank has seen the lengths. A step's plan and results nearly always fit: one
collective each way, not two (a length, then the bytes), which cost a control channel four gloo
round trips a step. Frames go over ``group`` on its own device: the CPU for gloo, this rank's GPU
for NCCL (the default group under ``--device cuda``). Every function is a collective: every rank
of ``group`` calls it, in the same order, whatever its value. Symmetry is kept inside too: a
value that cannot be encoded is sent as length 0, so every rank enters the same collectives and
every rank raises (the gathers all-gather their frames, so every rank sees every length).
"""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist

MAX_BYTES = 1 << 30
"""The largest value received (a length above it is refused before anything is allocated)."""
FRAME_BYTES = 16 << 10
"""One collective's frame: an 8-byte length and up to FRAME_BYTES - 8 bytes of the value."""
_HEADER = 8
_INLINE = FRAME_BYTES - _HEADER


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


def _decode_tensor(buf_N: torch.Tensor, length: int, offset: int = 0) -> object:
    return decode(memoryview(buf_N[offset:offset + length].cpu().numpy()))


def _frame(data: bytes, device: torch.device) -> torch.Tensor:
    """``data``'s frame: its length, then its first :data:`_INLINE` bytes, zero-padded."""
    frame = bytearray(FRAME_BYTES)
    frame[:_HEADER] = len(data).to_bytes(_HEADER, "little")
    frame[_HEADER:_HEADER + min(len(data), _INLINE)] = data[:_INLINE]
    return torch.frombuffer(frame, dtype=torch.uint8).to(device)


def _frame_length(frame_F: torch.Tensor) -> int:
    return int.from_bytes(frame_F[:_HEADER].cpu().numpy().tobytes(), "little")


def _empty_frame(device: torch.device) -> torch.Tensor:
    return torch.empty(FRAME_BYTES, dtype=torch.uint8, device=device)


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
    frame_F = _frame(data, device) if mine else _empty_frame(device)
    dist.broadcast(frame_F, src=src, group=group)
    length = _frame_length(frame_F)
    if error is not None:
        raise error
    _check_length(length, src)  # before allocating what a peer announced; every rank sees the same
    if length <= _INLINE:
        return value if mine else _decode_tensor(frame_F, length, _HEADER)
    buf_N = _as_tensor(data, length, device) if mine else torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(buf_N, src=src, group=group)
    return value if mine else _decode_tensor(buf_N, length)


def _frames(value, group, device: torch.device) -> tuple[bytes, list[torch.Tensor], list[int]]:
    """This rank's bytes, every rank's frame and length (one all-gather); raises on every rank
    alike where a rank could not encode its value or sent too much."""
    data, error = _encode_for_wire(value)
    world = dist.get_world_size(group)
    frames = [_empty_frame(device) for _ in range(world)]
    dist.all_gather(frames, _frame(data, device), group=group)
    lengths = [_frame_length(frame_F) for frame_F in frames]
    if error is not None:
        raise error
    if not all(0 < n <= MAX_BYTES for n in lengths):
        ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
        for rank, length in zip(ranks, lengths):
            _check_length(length, rank)
    return data, frames, lengths


def _padded(data: bytes, lengths: list[int], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's bytes padded to the longest value, and a buffer per rank for the values."""
    size = max(lengths)
    return _as_tensor(data, size, device), [torch.empty(size, dtype=torch.uint8, device=device) for _ in lengths]


def all_gather(value, group=None) -> list:
    """Every rank's ``value``, in ``group``'s rank order, on every rank (decoded, its own too)."""
    device = _device(group)
    data, frames, lengths = _frames(value, group, device)
    if max(lengths) <= _INLINE:
        return [_decode_tensor(frame_F, n, _HEADER) for frame_F, n in zip(frames, lengths)]
    mine_N, bufs = _padded(data, lengths, device)
    dist.all_gather(bufs, mine_N, group=group)
    return [_decode_tensor(buf_N, n) for buf_N, n in zip(bufs, lengths)]


def gather(value, dst: int, group=None) -> list | None:
    """On rank ``dst`` (a global rank): every rank's ``value`` in ``group``'s rank order (decoded,
    its own too); None on the others. One all-gather of the frames (every rank sees every length),
    then a gather of the whole values only where one did not fit its frame."""
    device = _device(group)
    data, frames, lengths = _frames(value, group, device)
    mine = dist.get_rank() == dst
    if max(lengths) <= _INLINE:
        return [_decode_tensor(frame_F, n, _HEADER) for frame_F, n in zip(frames, lengths)] if mine else None
    mine_N, bufs = _padded(data, lengths, device)
    dist.gather(mine_N, bufs if mine else None, dst=dst, group=group)
    return [_decode_tensor(buf_N, n) for buf_N, n in zip(bufs, lengths)] if mine else None
