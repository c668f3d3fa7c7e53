"""Weights from a running group (``--load-from-peer``, ``--share-weights``; ``loaders.peer``,
``shard_engine.transfer``): the row plan between any two meshes, checksums that catch a piece that
changed on the way, and servers that receive their rows from a serving peer (tokens exact, nothing
read from storage), or are refused (another checkpoint with the same headers, another dtype, a
server that does not share) and read storage instead."""

from __future__ import annotations

import itertools

import pytest
import torch

from shard_engine.transfer import Slot, manifest_difference, shard_rows, transfer_plan
from tests.checkpoints import assert_greedy_tokens, reference_generate, write_checkpoint
from tests.dist import run_ranks, values
from tests.server_process import ServerProcess

MESHES = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1)]
SLOTS = [Slot(f"t{n}", (n, 3), "float32", True) for n in (0, 1, 2, 5, 7, 64)] + [
    Slot("scalar", (), "float32", False), Slot("whole", (4, 2), "bfloat16", False)]


def test_rows_sharded_on_one_side_only():
    """A trainer shards what the server keeps whole (and the reverse): each receiving rank still gets
    each of its rows once, from the senders that hold them."""
    slots = [Slot("w", (7, 2), "float32", False), Slot("v", (5, 2), "float32", True)]
    plan = transfer_plan(slots, (1, 3), (1, 2), sent_sharded=[True, False])
    for j in range(2):
        w = sorted((p.start, p.stop, p.src) for p in plan if p.dst == 3 + j and p.index == 0)
        assert w == [(0, 3, 0), (3, 6, 1), (6, 7, 2)], "the whole of w, from the three shards that hold it"
        v = [(p.start, p.stop) for p in plan if p.dst == 3 + j and p.index == 1]
        assert v == [shard_rows(5, 2, j)], "its rows of v, from the one sender holding v whole"


@pytest.mark.parametrize("senders,receivers", list(itertools.product(MESHES, MESHES)))
def test_every_receiving_rank_gets_each_of_its_rows_once_from_a_sender_that_holds_it(senders, receivers):
    plan = transfer_plan(SLOTS, senders, receivers)
    offset = senders[0] * senders[1]
    for j in range(receivers[0] * receivers[1]):
        replica = j % senders[0]
        for i, slot in enumerate(SLOTS):
            pieces = [p for p in plan if p.dst == offset + j and p.index == i]
            assert all(p.src // senders[1] == replica for p in pieces), "from its sending replica"
            if not slot.shape:
                assert len(pieces) == 1 and pieces[0].whole
                continue
            if not slot.sharded:
                assert [(p.start, p.stop) for p in pieces] == [(0, slot.shape[0])], "a whole one from one sender"
                continue
            lo, hi = shard_rows(slot.shape[0], receivers[1], j % receivers[1])
            rows = sorted(r for p in pieces for r in range(p.start, p.stop))
            assert rows == list(range(lo, hi)), "each of its rows once"
            for p in pieces:
                a, b = shard_rows(slot.shape[0], senders[1], p.src % senders[1])
                assert a <= p.start < p.stop <= b, "a sender sends only rows it holds"


def test_a_manifest_difference_names_the_tensor():
    ours = [Slot("a", (4, 2), "float32", True), Slot("b", (2,), "float32", False)]
    assert manifest_difference(ours, list(ours)) is None
    changed = [ours[0], Slot("b", (2,), "bfloat16", False)]
    assert manifest_difference(ours, changed) == "b: [2] bfloat16 on the receiver, [2] float32 on the sender"
    assert manifest_difference(ours, ours[:1]) == "1 tensors on the receiver, 2 on the sender"
    for bad in (["a", [4, -1], "float32", True], ["a", [4], "no_such_dtype", True], ["a", [4], "float32"], "a"):
        with pytest.raises(ValueError):
            Slot.from_json(bad)
    assert Slot.from_json(ours[0].to_json()) == ours[0]


def _send_and_receive(rank, world_size, corrupt):
    from shard_engine import transfer
    from shard_engine.torch_private import default_store

    slots = [Slot("w", (6, 4), "float32", True), Slot("b", (3,), "float32", False)]
    held = {"w": (torch.arange(24, dtype=torch.float32).view(6, 4), 0), "b": (torch.ones(3), 0)}
    group = transfer.open_transfer_group(default_store(), "test", rank, 2, "gloo", 30)
    plan = transfer.transfer_plan(slots, (1, 1), (1, 1))
    if rank == 0:
        if corrupt:  # the checksum of what was sent no longer matches it
            real = transfer.checksum
            transfer.checksum = lambda t: real(t) ^ (1 if t.shape == (3,) else 0)
        return transfer.send_pieces(group, 0, slots, plan, held)
    got = dict(transfer.receive_pieces(group, 1, slots, plan, torch.device("cpu")))
    return {name: t.tolist() for name, t in got.items()}


def test_pieces_arrive_whole_and_a_changed_checksum_names_the_tensor(tmp_path):
    sent, got = values(run_ranks(_send_and_receive, 2, tmp_path, False, timeout=60))
    assert sent == 24 * 4 + 3 * 4
    assert got == {"w": torch.arange(24.0).view(6, 4).tolist(), "b": [1.0, 1.0, 1.0]}
    results = run_ranks(_send_and_receive, 2, tmp_path, True, timeout=60)
    assert results[0].ok
    assert results[1].error_type == "ValueError" and "b: rows 0-3 from transfer rank 0" in str(results[1].error)


# -- servers -------------------------------------------------------------------------------------

TOKENS = 8
KV = ("--kv-cache-memory", "8MiB")


@pytest.fixture(scope="module")
def sender(tmp_path_factory):
    """A 2-rank server that shares its weights, with its checkpoint and transformers' tokens."""
    root = tmp_path_factory.mktemp("peer")
    path = write_checkpoint(root / "llama", "llama")
    server = ServerProcess(path, extra_args=("--share-weights", *KV), log_path=root / "sender.log")
    server.path, server.root = path, root
    server.reference = reference_generate(path, max_new_tokens=TOKENS)
    with server:
        yield server


def _receiver(sender, name: str, path=None, nproc: int = 2, extra=()) -> ServerProcess:
    return ServerProcess(path or sender.path, nproc=nproc, log_path=sender.root / f"{name}.log",
                         extra_args=("--load-from-peer", sender.url, *KV, *extra))


def _sent(sender) -> list[dict]:
    return sender.client.get("/info").json()["weights"]["sharing"]["transfers"]


@pytest.mark.parametrize("nproc", [2, 1], ids=["same-mesh", "other-shard-size"])
def test_a_group_loads_its_rows_from_a_serving_peer(sender, nproc):
    before = len(_sent(sender))
    with _receiver(sender, f"receiver{nproc}", nproc=nproc) as receiver:
        assert_greedy_tokens(receiver, sender.reference, TOKENS)
        info = receiver.client.get("/info").json()
        weights = info["weights"]
        assert weights["source"] == "peer" and weights["peer"] == sender.url, weights
        assert [r["load_bytes_read"] for r in info["ranks"]] == [0] * nproc, "nothing read from storage"
        checkpoint = sum(p.stat().st_size for p in sender.root.joinpath("llama").glob("*.safetensors"))
        received = weights["bytes_received_per_rank"]
        assert len(received) == nproc and checkpoint / nproc * 0.9 < received[0] < checkpoint / nproc * 1.05
        assert weights["fingerprint"] == sender.client.get("/info").json()["weights"]["fingerprint"]
        assert 'hsdp_peer_transfers_total{outcome="ok",role="received"} 1.0' in receiver.client.get("/metrics").text
    transfers = _sent(sender)
    assert len(transfers) == before + 1 and transfers[-1]["error"] is None, transfers
    assert transfers[-1]["receivers"] == [1, nproc]
    assert_greedy_tokens(sender, sender.reference, TOKENS)  # the sender served on, unchanged


def test_another_checkpoint_with_the_same_headers_is_refused_and_read_from_storage(sender):
    other = write_checkpoint(sender.root / "other", "llama", seed=1)  # same config and headers, other values
    with _receiver(sender, "other", path=other) as receiver:
        weights = receiver.client.get("/info").json()["weights"]
        assert weights["source"] == "storage" and "serves another checkpoint" in weights["peer_error"], weights
        assert_greedy_tokens(receiver, reference_generate(other, max_new_tokens=TOKENS), TOKENS)


def test_a_peer_that_loads_the_model_otherwise_or_does_not_share_refuses_in_words(sender):
    with _receiver(sender, "bf16", extra=("--dtype", "bfloat16")) as receiver:
        weights = receiver.client.get("/info").json()["weights"]
        assert weights["source"] == "storage", weights
        assert "(409)" in weights["peer_error"] and "bfloat16 sharded on the receiver" in weights["peer_error"], weights
        r = receiver.client.post("/admin/peer-load", json={})  # this one does not share
        assert r.status_code == 403 and "--share-weights" in r.json()["error"]
    for body, param in [({"mesh": [1]}, "mesh"), ({"mesh": [1, 2], "manifest": "x"}, "manifest")]:
        r = sender.client.post("/admin/peer-load", json=body)
        assert r.status_code == 422 and param in r.json()["error"], r.text
    r = sender.client.post("/admin/peer-load", content=b"{not json")
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_the_device_checksum_takes_pieces_at_any_offset():
    """A GPU piece's sum (``device_checksum``, run here on CPU tensors): a bf16 shard of rows that
    starts at an odd element (rows 683.. of 2048 over 3 ranks) cannot be viewed as 32-bit words in
    place; its sum is that of the same bytes anywhere, and another byte changes it."""
    import torch

    from shard_engine.transfer import device_checksum

    whole = torch.randn(2048, 3, dtype=torch.bfloat16)
    piece = whole.view(-1)[683 * 3:]  # 1365 rows of 3: an odd element offset
    flat = piece.view(torch.uint8)
    assert flat.storage_offset() % 4 != 0 and flat.numel() % 4 == 2
    assert device_checksum(flat) == device_checksum(flat.clone())
    even = whole.view(-1)[2047:2047 + 4096].view(torch.uint8)  # a multiple of 4 bytes at an offset of 2 mod 4
    assert even.numel() % 4 == 0 and even.storage_offset() % 4 == 2
    assert device_checksum(even) == device_checksum(even.clone())
    changed = even.clone()
    changed[100] ^= 1
    assert device_checksum(changed) != device_checksum(even)
