"""Shards from one running group to another: each receiving rank gets exactly its rows from the
sending ranks that hold them, over a process group of both groups' ranks.

Both sides describe the model the same way, as a *manifest*: every tensor a load delivers
(:class:`Slot`: its name, global shape, dtype, and whether FSDP2 shards it by rows), in the order
the receiver completes its units. From the manifest and the two meshes each side computes the
same :func:`transfer_plan` independently (nothing but tensors crosses the group): a receiving
rank's rows of a sharded tensor come from the sending ranks whose shards intersect them (the
shard sizes may differ: a row-range plan; equal sizes: one sender per tensor), a whole tensor
from one sending rank; the receiving ranks are spread over the sending replicas. Sends are the
sender's own shard views (no copy); receives land in the tensors the receiver keeps. Every piece
carries a 64-bit XXH3 hash of its bytes (the ``xxhash`` package: 12.6 GB/s on one core of this
project's CPU, against 2.3 GB/s for zlib's CRC-32, which cost a 744 MB shard 0.3 s on each side),
sent after the pieces, so a receiver knows each unit's rows arrived as they were held.

Transfer-group ranks: the senders first (their global ranks in their own group), then the
receivers (offset by the senders' world size). The group is a process group of its own
(``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` between CUDA ranks) over a store the
sending group's rank 0 hosts: neither side's default group is touched, so the senders keep
serving on theirs while they send.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shard_engine.torch_private import (
    fsdp_params,
    gathered_shape,
    has_all_gather_extension,
    is_row_sharded,
    local_shard,
    nccl_backend,
    registered_as,
    shard_count,
    shard_rank,
)


def shard_rows(num_rows: int, shard_size: int, shard_rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that FSDP2 places on ``shard_rank`` (torch.chunk split)."""
    chunk = -(-num_rows // shard_size)
    start = min(shard_rank * chunk, num_rows)
    return start, min(start + chunk, num_rows)


@dataclass(frozen=True)
class Slot:
    """One tensor of a manifest."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch."
    sharded: bool  # by rows over the shard dimension (else every rank holds it whole)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def row_bytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype, self.sharded]

    @classmethod
    def from_json(cls, item) -> Slot:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
                and isinstance(item[1], list) and all(isinstance(d, int) and d >= 0 for d in item[1])
                and isinstance(item[2], str) and isinstance(getattr(torch, item[2], None), torch.dtype)
                and isinstance(item[3], bool)):
            raise ValueError(f"not a manifest entry: {str(item)[:120]}")
        return cls(item[0], tuple(item[1]), item[2], item[3])


def manifest_digest(slots: list[Slot]) -> str:
    """SHA-256 of the manifest, as both sides compare it first."""
    return hashlib.sha256(json.dumps([s.to_json() for s in slots]).encode()).hexdigest()


def manifest_difference(ours: list[Slot], theirs: list[Slot],
                        sides: tuple[str, str] = ("on the sender", "on the receiver")) -> str | None:
    """None where manifest ``ours`` equals ``theirs``, else the first difference in words
    (``sides``: how to name where each is)."""
    mine, other = sides
    for a, b in zip(ours, theirs):
        if a != b:
            if a.name != b.name:
                return f"tensor {theirs.index(b)} is {b.name!r} {other}, {a.name!r} {mine}"
            return (f"{a.name}: {list(b.shape)} {b.dtype}{' sharded' if b.sharded else ''} {other}, "
                    f"{list(a.shape)} {a.dtype}{' sharded' if a.sharded else ''} {mine}")
    if len(ours) != len(theirs):
        return f"{len(theirs)} tensors {other}, {len(ours)} {mine}"
    return None


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of manifest tensor ``index`` from transfer rank ``src`` to ``dst``;
    ``whole``: a scalar (no rows), sent entire."""

    index: int
    src: int
    dst: int
    start: int
    stop: int
    whole: bool


def transfer_plan(slots: list[Slot], senders: tuple[int, int], receivers: tuple[int, int],
                  sent_sharded: list[bool] | None = None) -> list[Piece]:
    """Every piece of a transfer from a (replicas, shard size) mesh of ``senders`` to one of
    ``receivers``, in manifest order per receiver. A slot's ``sharded`` is how the receivers hold
    it (their rows, or whole); ``sent_sharded`` how the senders do, where that differs (a trainer
    shards what a server keeps whole, say; default: the same). Receiving rank ``j`` reads from
    sending replica ``j % replicas``: its rows from each sending shard holding some of them, or,
    where the senders hold the tensor whole, from shard ``j % shard size``."""
    replicas, shards = senders
    offset = replicas * shards
    out = []
    for j in range(receivers[0] * receivers[1]):
        base = (j % replicas) * shards
        for i, slot in enumerate(slots):
            if not slot.shape:
                out.append(Piece(i, base + j % shards, offset + j, 0, 0, True))
                continue
            n = slot.shape[0]
            lo, hi = shard_rows(n, receivers[1], j % receivers[1]) if slot.sharded else (0, n)
            if not (slot.sharded if sent_sharded is None else sent_sharded[i]):
                if lo < hi:
                    out.append(Piece(i, base + j % shards, offset + j, lo, hi, False))
                continue
            for s in range(shards):
                a, b = shard_rows(n, shards, s)
                if max(a, lo) < min(b, hi):
                    out.append(Piece(i, base + s, offset + j, max(a, lo), min(b, hi), False))
    return out


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 of a host tensor's bytes (to 63 bits: it travels as an int64); of a device tensor, a
    sum of its bytes' 32-bit words weighted by position (computed where it lies), as a 32-bit value."""
    if t.numel() == 0:
        return 0
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    if t.device.type == "cpu":
        import xxhash

        return xxhash.xxh3_64_intdigest(flat.numpy()) & ((1 << 63) - 1)
    return device_checksum(flat)


def device_checksum(flat: torch.Tensor) -> int:
    """:func:`checksum`'s sum for a device tensor's bytes (``flat``, uint8), where it lies: its 32-bit
    words where the bytes number a multiple of 4, else each byte as one; the way chosen by the byte
    count alone, so that sender and receiver sum alike whatever their pieces' offsets in memory (a
    view at an offset not a multiple of 4 is copied first: a 32-bit view of it cannot be taken)."""
    if flat.numel() % 4 == 0:
        words = (flat if flat.storage_offset() % 4 == 0 else flat.clone()).view(torch.int32)
    else:
        words = flat.to(torch.int32)
    weights = torch.arange(1, words.numel() + 1, device=flat.device, dtype=torch.int64) % 65521
    return int(((words.to(torch.int64) * weights).sum() % (1 << 32)).item())


def held_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """What this rank holds of every parameter and buffer, by every name the model registers it
    under (tied ones too): (the tensor, the global row its first row is). A sharded parameter is
    FSDP2's local shard (whatever the unit's state: gathered or not, a view of a host's shared
    copy or not); anything else is held whole (row 0). Call it on the thread that steps the model:
    it reads the modules' registrations as they are between two steps."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for fp in fsdp_params(module):
            if not is_row_sharded(fp) or has_all_gather_extension(fp):
                raise ValueError("a parameter sharded other than by rows of a plain tensor cannot be transferred")
            local = local_shard(fp)
            shape = gathered_shape(fp)
            start = shard_rows(shape[0] if len(shape) else 0, shard_count(fp), shard_rank(fp))[0]
            for owner, attr in registered_as(fp):
                prefix = names[id(owner)]
                out[f"{prefix}.{attr}" if prefix else attr] = (local, start)
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(name, (p.detach(), 0))
    for name, b in model.named_buffers(remove_duplicate=False):
        out.setdefault(name, (b, 0))
    return out


def sharded_names(model: nn.Module) -> set[str]:
    """Every name under which the model registers a parameter FSDP2 shards (tied names too)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for fp in fsdp_params(module):
                for owner, attr in registered_as(fp):
                    prefix = names[id(owner)]
                    out.add(f"{prefix}.{attr}" if prefix else attr)
    return out


def open_transfer_group(store: dist.Store, key: str, rank: int, world_size: int, backend: str,
                        timeout_s: float, device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group of ``world_size`` ranks over ``store`` (keys under ``key``), apart from the
    default group; blocks until every rank has joined or ``timeout_s`` passes."""
    prefixed = dist.PrefixStore(f"hsdp-transfer/{key}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        group = nccl_backend(prefixed, rank, world_size, timeout)
        if device is not None:  # connect now, on this rank's device, not at the first send
            group.eager_connect_single_device(device)
        return group
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def send_pieces(group: dist.ProcessGroup, rank: int, slots: list[Slot], plan: list[Piece],
                held: dict[str, tuple[torch.Tensor, int]]) -> int:
    """Send this transfer rank's pieces of ``plan`` (views of what it holds: no copy), then each
    receiver its pieces' checksums; returns the bytes sent. Raises if the peer fails or the
    group's timeout passes."""
    works, sums = [], {}
    sent = 0
    for piece in (p for p in plan if p.src == rank):
        slot = slots[piece.index]
        tensor, first = held[slot.name]
        data = tensor if piece.whole else tensor[piece.start - first:piece.stop - first]
        if data.dtype != slot.torch_dtype:  # a trainer's float32 master weights for a bf16 server, say
            data = data.to(slot.torch_dtype)
        data = data.contiguous()
        works.append(group.send([data], piece.dst, piece.index))
        sums.setdefault(piece.dst, []).append(checksum(data))
        sent += data.numel() * data.element_size()
    device = next((t.device for t, _ in held.values()), torch.device("cpu"))
    for dst, values in sums.items():
        works.append(group.send([torch.tensor(values, dtype=torch.int64, device=device)], dst, len(slots)))
    for work in works:
        work.wait()
    if device.type == "cuda":  # (NCCL's wait orders the stream; the sends are done once it has run)
        torch.cuda.current_stream(device).synchronize()
    return sent


def receive_pieces(group: dist.ProcessGroup, rank: int, slots: list[Slot], plan: list[Piece],
                   device: torch.device, window_bytes: int = 256 << 20,
                   into: dict[str, tuple[torch.Tensor, int]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, this rank's rows of it) for every manifest tensor, in manifest order, as each
    arrives; receives are posted up to ``window_bytes`` ahead of the one yielded. ``into``: receive
    straight into these tensors (``held_tensors``' of a live model: its rows of each, in place)
    instead of new ones (a name it lacks: a new one). Once all are in, the senders' checksums are
    compared; a mismatch raises ValueError naming the tensor."""
    mine: dict[int, list[Piece]] = {}
    for piece in plan:
        if piece.dst == rank:
            mine.setdefault(piece.index, []).append(piece)
    pending: deque = deque()  # (index, tensor, [(piece, view, work)])
    posted_bytes = 0
    next_index = 0
    got: dict[int, list[tuple[Piece, int]]] = {}  # src -> its pieces' checksums here, in its order

    def target(slot: Slot, pieces: list[Piece]) -> tuple[torch.Tensor, int]:
        if slot.sharded and slot.shape:
            first = min((p.start for p in pieces), default=0)
            shape = (sum(p.stop - p.start for p in pieces), *slot.shape[1:])
        else:
            first, shape = 0, slot.shape
        if into is None or slot.name not in into:
            return torch.empty(shape, dtype=slot.torch_dtype, device=device), first
        tensor = into[slot.name][0]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != slot.torch_dtype or not tensor.is_contiguous():
            raise ValueError(f"{slot.name}: receiving {list(shape)} {slot.dtype} into {list(tensor.shape)} "
                             f"{tensor.dtype}")
        return tensor, first

    def post() -> None:
        nonlocal next_index, posted_bytes
        while next_index < len(slots) and (not pending or posted_bytes < window_bytes):
            i, slot = next_index, slots[next_index]
            pieces = mine.get(i, [])
            tensor, first = target(slot, pieces)
            views = [(p, tensor if p.whole else tensor[p.start - first:p.stop - first]) for p in pieces]
            pending.append((i, tensor, [(p, v, group.recv([v], p.src, i)) for p, v in views]))
            posted_bytes += tensor.numel() * tensor.element_size()
            next_index += 1

    post()
    while pending:
        i, tensor, parts = pending.popleft()
        for piece, view, work in parts:
            work.wait()
            got.setdefault(piece.src, []).append((piece, checksum(view)))
        posted_bytes -= tensor.numel() * tensor.element_size()
        post()
        yield slots[i].name, tensor
    for src, pieces in got.items():
        expected = torch.empty(len(pieces), dtype=torch.int64, device=device)
        group.recv([expected], src, len(slots)).wait()
        for (piece, value), want in zip(pieces, expected.tolist()):
            if value != want:
                name = slots[piece.index].name
                raise ValueError(f"{name}: rows {piece.start}-{piece.stop} from transfer rank {src} arrived with "
                                 f"checksum {value:#x}, sent as {want:#x}")


def plan_bytes(slots: list[Slot], plan: list[Piece], rank: int) -> int:
    """The bytes transfer rank ``rank`` receives under ``plan``."""
    total = 0
    for p in plan:
        if p.dst == rank:
            slot = slots[p.index]
            total += slot.torch_dtype.itemsize if p.whole else (p.stop - p.start) * slot.row_bytes
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def slots_as_json(slots: list[Slot]) -> list:
    return [s.to_json() for s in slots]


__all__ = ["Piece", "Slot", "checksum", "held_tensors", "manifest_difference", "manifest_digest",
           "open_transfer_group", "plan_bytes", "receive_pieces", "send_pieces", "shard_rows", "sharded_names", "slots_as_json",
           "transfer_plan"]
