"""The control plane executes nothing it receives: plans and results cross as plain data.

A pickle sent where a plan is expected (one that would create a file when unpickled) is refused
with WireError on the receiving rank, and the file never appears; a realistic plan and result
cross a real control channel (gloo, 2 ranks) unchanged; unknown fields and wrong types are
refused by name; errors between loading ranks are records rebuilt from an allowlist; a rank with
a wrong group secret stops the whole group at once, every rank naming it. Multi-rank tests run on
CPU ranks (tests/dist.py) with hard timeouts far below the group's own, so a wait fails them.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from server.engine.plan import PromptLogprobs, SequenceAdd, StepPlan, StepResult, TokenResult, Work
from server.engine.plan_wire import from_wire, to_wire
from server.engine.sampling import SamplingParams
from shard_engine import wire
from shard_engine.wire import WireError
from tests.dist import run_ranks, values

pytestmark = pytest.mark.timeout(300)


class CreatesFile:
    """Unpickling this creates the file at ``path``: a stand-in for any code a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def realistic_plan() -> StepPlan:
    params = SamplingParams(
        max_new_tokens=64, do_sample=True, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        seed=1234, top_logprobs=5, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={13: -100.0, 42: 2.5},
        typical_p=0.95, stop_token_ids=(2, 7), ignore_eos=True, grammar='{"type": "object"}', prompt_logprobs=3,
    )
    return StepPlan(
        add=[SequenceAdd(seq_id=11, rank=1, tokens=[1, 15043, 3186, 29991], params=params, blocks=[3, 4]),
             SequenceAdd(seq_id=12, rank=0, tokens=list(range(100, 300)), params=SamplingParams(max_new_tokens=8),
                         blocks=[0, 1, 2], num_generated=5)],
        remove=[7, 9],
        work={0: [Work(12, 0, 200, new_blocks=[5, 6])], 1: [Work(11, 0, 4), Work(10, 31, 1)]},
        forward=True,
    )


def realistic_result(rank: int) -> StepResult:
    return StepResult(
        rank=rank,
        tokens=[TokenResult(11, 450, -0.125, top=[(450, -0.125), (278, -2.5), (13, -3.0)]),
                TokenResult(10, -1, 0.0, error="GrammarError: no token allowed"),
                TokenResult(9, 2, -1e-06, stop=True)],
        active=3, sequences_started=17, tokens_computed=4096, pid=4242,
        memory={"shards": 1 << 30, "kv_pool": 123456, "runtime": 0, "rss": 5 << 20},
        prompt_logprobs=[PromptLogprobs(11, 1, [-1.5, -0.25, -3.75], [[(15043, -1.5)], [(3186, -0.25)], []])],
        forwards=99,
    )


def _pickle_as_plan(rank, world_size, target):
    from server.group.control import control_channels

    channel = control_channels(60, [[0, 1]])[0]
    if rank == 0:
        # a link's framing, by hand: the length (8 bytes, little endian), then the bytes
        channel.links[0].send_bytes(pickle.dumps(CreatesFile(target)))
        return None
    return channel.broadcast_plan(None)  # raises: what arrived is no plan


def test_a_pickle_sent_as_a_plan_is_refused_and_runs_nothing(tmp_path):
    target = tmp_path / "created-by-the-payload"
    probe = tmp_path / "the-payload-is-live"
    pickle.loads(pickle.dumps(CreatesFile(str(probe))))  # unpickled, the payload does create its file
    assert probe.exists()
    sender, receiver = run_ranks(_pickle_as_plan, 2, tmp_path, str(target), timeout=120)
    assert sender.ok, sender.traceback
    assert receiver.error_type == "WireError", receiver.traceback
    assert "not a msgpack value" in str(receiver.error)
    assert not target.exists()


def test_a_pickle_or_foreign_data_is_no_plan():
    target = "/nonexistent-dir/never"
    with pytest.raises(WireError, match="not a msgpack value"):
        wire.decode(pickle.dumps(CreatesFile(target)))
    with pytest.raises(WireError, match="extension type"):
        wire.decode(b"\xd4\x05\x00")  # a msgpack extension value
    def received():  # the plan as a peer decodes it (from_wire consumes the dicts it is given)
        return wire.decode(wire.encode(to_wire(realistic_plan())))

    with pytest.raises(WireError, match="StepPlan has no field 'evil'"):
        from_wire(StepPlan, {**received(), "evil": 1})
    with pytest.raises(WireError, match=r"Work\.count: expected int, got str"):
        from_wire(StepPlan, {**received(), "work": {0: [{"seq_id": 1, "start": 0, "count": "1"}]}})
    with pytest.raises(WireError, match=r"SequenceAdd\.tokens: expected a list of int"):
        from_wire(StepPlan, {"add": [{**received()["add"][0], "tokens": [1, True]}]})  # a bool is no token id
    with pytest.raises(WireError, match="field 'max_new_tokens' is missing"):
        from_wire(StepPlan, {"add": [{**received()["add"][0], "params": {"seed": 1}}]})
    with pytest.raises(WireError, match=r"StepPlan\.work key: expected int, got str"):
        from_wire(StepPlan, {"work": {"0": []}})
    with pytest.raises(WireError, match=r"TokenResult\.top: expected a list of 2"):
        from_wire(TokenResult, {"seq_id": 1, "token_id": 2, "logprob": 0.0, "top": [[1, "x"]]})
    with pytest.raises(WireError, match="not plain data"):
        wire.encode({"plan": CreatesFile(target)})
    with pytest.raises(TypeError):
        from_wire(CreatesFile, {})  # only the control channel's records are ever built


def test_records_round_trip_in_process():
    for record in (realistic_plan(), realistic_result(3), StepPlan(shutdown=True), SamplingParams(max_new_tokens=1)):
        back = from_wire(type(record), wire.decode(wire.encode(to_wire(record))))
        assert back == record and type(back) is type(record)
    back = from_wire(StepPlan, wire.decode(wire.encode(to_wire(realistic_plan()))))
    assert back.add[0].params.stop_token_ids == (2, 7) and isinstance(back.add[0].params.stop_token_ids, tuple)
    assert back.work[1][0] == Work(11, 0, 4)  # dict keyed by int rank


def _plan_results_and_collectives(rank, world_size):
    from server.group.control import control_channels

    channel = control_channels(60, [[0, 1, 2]])[0]
    plan = channel.broadcast_plan(realistic_plan() if rank == 0 else None)
    results = channel.gather_results(realistic_result(rank) if rank else None)  # rank 0: not in the replica
    shutdown = channel.broadcast_plan(StepPlan(shutdown=True) if rank == 0 else None).shutdown
    by_rank = {0: None, 1: "x" * 5000, 2: {"rank": 2, "nested": [1.5, b"\x00\xff", None, True]}}
    gathered = wire.all_gather(by_rank[rank])
    at_one = wire.gather(by_rank[rank], dst=1)
    pair = dist.new_group([1, 2], backend="gloo")
    from_two = wire.broadcast(("stamp", rank), src=2, group=pair) if rank in (1, 2) else None
    # values longer than a frame: a second collective, entered by every rank
    big = {0: "y" * 40000, 1: 1, 2: ["z" * 20000]}
    big_gathered = wire.all_gather(big[rank])
    big_at_two = wire.gather(big[rank], dst=2)
    big_from_zero = wire.broadcast(big[0] if rank == 0 else None, src=0)
    big_ok = big_gathered == [big[0], big[1], big[2]] and big_from_zero == big[0] and (
        big_at_two == [big[0], big[1], big[2]] if rank == 2 else big_at_two is None)
    try:  # rank 1's value is not plain data: every rank still enters the same collectives, and raises
        wire.all_gather(CreatesFile("/nonexistent-dir/never") if rank == 1 else rank)
        refused = None
    except WireError as e:
        refused = str(e)
    return plan, results, shutdown, gathered, at_one, from_two, refused, big_ok


def test_a_realistic_plan_and_results_cross_the_channel_unchanged(tmp_path):
    """And the wire's collectives carry plain values of any size, from any source rank; a value
    that is not plain data fails on every rank, none left waiting."""
    ranks = values(run_ranks(_plan_results_and_collectives, 3, tmp_path, timeout=120))
    for plan, results, shutdown, *_ in ranks:
        assert plan == realistic_plan() and isinstance(plan.add[0].params, SamplingParams) and shutdown
    results = ranks[0][1]
    assert results == [realistic_result(1), realistic_result(2)]
    assert results[0].tokens[0].top[0] == (450, -0.125)
    assert ranks[1][1] is None and ranks[2][1] is None
    expected = [None, "x" * 5000, {"rank": 2, "nested": [1.5, b"\x00\xff", None, True]}]
    assert all(r[3] == expected for r in ranks)
    assert [r[4] for r in ranks] == [None, expected, None]
    assert ranks[1][5] == ["stamp", 2]  # a tuple crosses as a list
    assert ranks[2][5] == ("stamp", 2)  # the sender keeps its own object
    assert "not plain data" in ranks[1][6]
    assert all("rank 1 could not encode its value" in r[6] for r in (ranks[0], ranks[2]))
    assert all(r[7] for r in ranks)  # values longer than a frame, each way


def test_errors_cross_as_records_of_an_allowlist():
    from loaders.errors import RemoteRankError, ShapeMismatchError, error_from_record, error_to_record

    error = ShapeMismatchError("shape (4, 8) != (8, 4)", path="/m/model.safetensors", tensor="lm_head.weight")
    record = wire.decode(wire.encode(error_to_record(error)))
    back = error_from_record(record)
    assert type(back) is ShapeMismatchError and str(back) == str(error)
    assert (back.path, back.tensor) == (error.path, error.tensor)
    foreign = error_from_record({**record, "type": "posix.system"})
    assert type(foreign) is RemoteRankError and "posix.system: shape (4, 8)" in str(foreign)
    assert type(error_from_record(["not", "a", "record"])) is RemoteRankError


def _authenticate(rank, world_size, secrets_by_rank):
    from server.group.process_group import authenticate_group

    authenticate_group(secrets_by_rank[rank])
    return "started"


def test_a_rank_with_a_wrong_secret_stops_the_group_at_once_naming_it(tmp_path):
    # the group's own timeout (its store's waits) is 300 s: the hard 120 s limit fails a wait on it
    results = run_ranks(_authenticate, 3, tmp_path, [b"s3cret", b"wrong", b"s3cret"], timeout=120, pg_timeout_s=300)
    for r in results:
        assert r.error_type == "GroupAuthError", (r.rank, r.traceback)
        assert r.error.rank == 1, r.rank
        assert "rank 1 does not know the group's secret" in str(r.error) and "refuses to start" in str(r.error)
    tracebacks = "".join(r.traceback for r in results)
    assert "wrong" not in tracebacks and "s3cret" not in tracebacks  # no secret in an error


def test_the_group_starts_with_one_secret_everywhere_and_refuses_a_rank_without(tmp_path):
    assert values(run_ranks(_authenticate, 2, tmp_path, [b"k", b"k"], timeout=120)) == ["started", "started"]
    results = run_ranks(_authenticate, 2, tmp_path, [b"k", None], timeout=120, pg_timeout_s=300)
    assert [r.error_type for r in results] == ["GroupAuthError", "GroupAuthError"]
    assert all(r.error.rank == 1 and "rank 1 has no group secret" in str(r.error) for r in results)


def test_the_secret_is_read_from_the_variable_or_its_file(tmp_path):
    from server.group.process_group import read_group_secret

    assert read_group_secret({}) is None
    assert read_group_secret({"HSDP_GROUP_SECRET": "abc"}) == b"abc"
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    assert read_group_secret({"HSDP_GROUP_SECRET_FILE": str(path)}) == b"from-a-file"
    with pytest.raises(ValueError, match="not both"):
        read_group_secret({"HSDP_GROUP_SECRET": "a", "HSDP_GROUP_SECRET_FILE": str(path)})
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_group_secret({"HSDP_GROUP_SECRET_FILE": str(path)})
    with pytest.raises(ValueError, match="HSDP_GROUP_SECRET_FILE"):
        read_group_secret({"HSDP_GROUP_SECRET_FILE": os.fspath(tmp_path / "absent")})


def test_a_stranger_on_the_control_port_is_refused_and_the_ranks_still_join():
    """Rank 0's listener takes a rank only with the group's token: a connection without it (or
    with a wrong one, or saying nothing) is closed, and the real ranks' links form all the same."""
    import socket
    import threading

    from server.group.links import Link, LinkError, _accept, _dial

    listener = socket.create_server(("127.0.0.1", 0))
    address = {"host": "127.0.0.1", "port": listener.getsockname()[1], "token": "t" * 64}
    strangers, knocked = [], threading.Semaphore(0)

    def stranger(hello) -> None:
        sock = socket.create_connection(("127.0.0.1", address["port"]), timeout=30)
        link = Link(sock, 0, 30)
        if hello is not None:
            link.send(hello)
        knocked.release()
        try:
            strangers.append(link.recv())
        except LinkError as e:
            strangers.append(e)

    dialed = {}

    def rank(r: int) -> None:
        dialed[r] = _dial(address, r, 30)

    hellos = ({"rank": 1, "token": "x" * 64}, {"rank": 9}, {"rank": 2, "token": "y" * 5000})  # the last: too long
    threads = [threading.Thread(target=stranger, args=(h,)) for h in hellos]
    for t in threads:
        t.start()
    for _ in hellos:  # every stranger queued before the ranks dial: the listener meets them all first
        assert knocked.acquire(timeout=30)
    threads += [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads[len(hellos):]:
        t.start()
    links = _accept(listener, address["token"], world=3, timeout_s=30)
    for t in threads:
        t.join(30)
    listener.close()
    assert sorted(links) == [1, 2] and sorted(dialed) == [1, 2]
    # closed on them (reset where what they sent was left unread)
    assert len(strangers) == 3 and all(isinstance(s, LinkError) for s in strangers), strangers
    links[2].send({"plan": [1, 2]})
    assert dialed[2].recv() == {"plan": [1, 2]}
    dialed[1].send(None)
    assert links[1].recv() is None


def test_a_link_whose_peer_is_gone_fails_at_once_and_a_value_it_cannot_carry_fails_both_ends():
    import socket
    import time

    from server.group.links import Link, LinkError

    a, b = socket.socketpair()
    mine, theirs = Link(a, 1, timeout_s=60), Link(b, 0, timeout_s=60)
    with pytest.raises(WireError, match="not plain data"):
        theirs.send({"x": CreatesFile("/nonexistent-dir/never")})
    with pytest.raises(WireError, match="rank 1 could not encode its value"):
        mine.recv()
    theirs.close()
    start = time.monotonic()
    with pytest.raises(LinkError, match="rank 1 closed its link"):
        mine.recv()
    assert time.monotonic() - start < 5  # not the link's 60 s timeout
    a2, b2 = socket.socketpair()
    with pytest.raises(LinkError, match="nothing from rank 3 for 0.2 s"):
        Link(a2, 3, timeout_s=0.2).recv()
    b2.close()


def test_the_control_host_is_loopback_on_one_node_and_named_or_routed_across_nodes():
    from server.group.links import control_host

    assert control_host(2, {}) == "127.0.0.1"
    assert control_host(4, {"LOCAL_WORLD_SIZE": "4"}) == "127.0.0.1"
    assert control_host(4, {"LOCAL_WORLD_SIZE": "2", "HSDP_CONTROL_HOST": "10.1.2.3"}) == "10.1.2.3"
    assert control_host(4, {"LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert control_host(4, {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "127.0.0.1"
    with pytest.raises(ValueError, match="HSDP_CONTROL_HOST"):
        control_host(4, {"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=nonexistent0"):
        control_host(4, {"LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "nonexistent0"})
