"""``server.engine.cores``: a busy rank's plan gives it the cores of its host's idle ranks; no process."""

import pytest

from server.engine.cores import HostCores


def test_busy_ranks_share_their_hosts_cores():
    cores = HostCores(ranks_per_host=2, threads_per_rank=1, world_size=4)  # two hosts of two ranks
    assert cores.threads([0], [0]) == 2  # alone on host 0: both its cores
    assert cores.threads([1], [1]) == 1  # rank 0 still busy: one each
    assert cores.threads([0], [0]) == 1
    assert cores.threads([1], []) == 1  # rank 1 idle now: its plan has no work, its threads unused
    assert cores.threads([0], [0]) == 2  # and rank 0's next plan takes its core
    assert cores.threads([2], [2]) == 2  # host 1 counts apart
    assert cores.threads([2, 3], [2, 3]) == 1  # a group of two busy ranks on host 1
    assert cores.threads([0, 2], [0, 2]) == 1  # a group across hosts: the fewest its hosts give


def test_never_fewer_than_a_ranks_own_share():
    cores = HostCores(ranks_per_host=4, threads_per_rank=3, world_size=4)
    for rank in range(4):
        cores.threads([rank], [rank])
    assert cores.threads([0], [0]) == 3  # 12 cores over 4 busy ranks
    for rank in (1, 2, 3):
        cores.threads([rank], [])
    assert cores.threads([0], [0]) == 12
    with pytest.raises(ValueError):
        HostCores(ranks_per_host=0, threads_per_rank=1, world_size=1)


def test_cores_follow_the_work_of_cpu_ranks_with_weights_to_stream():
    """Cores follow the work on CPU, with several step groups, for a model of at least
    MIN_WEIGHT_BYTES; a rank alone with work gets its host's cores, and never fewer than its own."""
    from server.engine.cores import MIN_WEIGHT_BYTES, cores_follow_work

    assert cores_follow_work("cpu", MIN_WEIGHT_BYTES, 2)
    assert not cores_follow_work("cpu", MIN_WEIGHT_BYTES - 1, 2)
    assert not cores_follow_work("cpu", MIN_WEIGHT_BYTES, 1) and not cores_follow_work("cuda", MIN_WEIGHT_BYTES, 2)
    for ranks, own in ((2, 1), (4, 3)):
        cores = HostCores(ranks_per_host=ranks, threads_per_rank=own, world_size=ranks)
        assert cores.threads([0], [0]) == own * ranks  # rank 0 alone with work: the host's cores
        cores.threads([1], [1])
        assert cores.threads([0], [0]) in range(own, own * ranks + 1)


def test_the_scheduler_puts_the_threads_in_its_plans():
    from server.engine import BlockPool, RequestHandle, SamplingParams, Scheduler

    cores = HostCores(ranks_per_host=2, threads_per_rank=1, world_size=2)
    schedulers = [Scheduler(pools=[BlockPool(16, 4, prefix_caching=False)], replicas=[[0]], rank_ids=[rank],
                            max_running=4, max_total_tokens=32, eos_token_ids=set(), idle_wait_s=0.01, cores=cores)
                  for rank in (0, 1)]
    schedulers[0].submit(RequestHandle([5, 6, 7], SamplingParams(max_new_tokens=4), deliver=lambda e: None))
    idle = schedulers[1].next_plan()
    plan = schedulers[0].next_plan()
    assert plan.work[0] and plan.threads == 2, plan
    assert not idle.forward
    schedulers[1].submit(RequestHandle([8, 9], SamplingParams(max_new_tokens=4), deliver=lambda e: None))
    assert schedulers[1].next_plan().threads == 1  # rank 0 busy too: a core each


def test_a_compiled_steps_opaque_ops_take_the_plans_threads():
    """A graph compiled at one thread is entered at one thread (dynamo guards on the count); inside
    ``threads_inside``, the first opaque op it calls (a linear, the decode attention) switches to
    the plan's count, so the matmuls use the idle ranks' cores; the next call, entered at one
    thread again, runs the same graph: nothing recompiled, the products unchanged."""
    import torch
    import torch._dynamo.utils

    import server.engine.linears  # noqa: F401 - registers torch.ops.hsdp.linear
    from server.engine.cores import follow_threads, threads_inside

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        follow_threads()  # outside a compiled step: nothing changes
        assert torch.get_num_threads() == 1

        def two_linears(x, w):
            return torch.ops.hsdp.linear(torch.ops.hsdp.linear(x, w, None).relu(), w, None)

        compiled = torch.compile(two_linears, dynamic=False)
        x, w = torch.randn(3, 8), torch.randn(8, 8)
        want = two_linears(x, w)
        torch.testing.assert_close(compiled(x, w), want)  # compiles at one thread
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(2):
            torch.set_num_threads(1)
            with threads_inside(2), torch.compiler.set_stance("fail_on_recompile"):
                got = compiled(x, w)
            assert torch.get_num_threads() == 2  # the ops switched once inside
            torch.testing.assert_close(got, want)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    finally:
        torch.set_num_threads(before)
