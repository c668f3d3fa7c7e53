import inspect
import os
import time
import types

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each rank's KV pool in every server and rank the tests start (they inherit the environment),
# unless a test says otherwise: ``auto`` commits a fifth of the host's memory, 2.4 GB a rank on
# the 2-core machine, which took ~10 s of a tiny model's ~19 s start, about 600 s of the suite,
# for tests that use a few MB of it; 512 MiB still took ~1.9 s of an 8 s start on an AVX2 host
# (two ranks faulting their pools in at once). 64 MiB holds ~1,450 tokens a rank of the largest
# model served in the tests (SmolLM2-135M in float32, 46 KB a token). test_engine checks what auto sizes.
os.environ.setdefault("HSDP_KV_CACHE_MEMORY", "64MiB")

SUITE_BUDGET_S = float(os.environ.get("HSDP_TEST_BUDGET_S", 30 * 60))
"""The whole suite must finish within this on a 2-core machine (CI allows 90 minutes): a run
over it fails, so that the suite's growth is noticed when it happens, not at CI's limit."""

_START = pytest.StashKey[float]()
_ELAPSED = pytest.StashKey[float]()


def pytest_sessionstart(session):
    session.config.stash[_START] = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    elapsed = time.monotonic() - session.config.stash[_START]
    session.config.stash[_ELAPSED] = elapsed
    if elapsed > SUITE_BUDGET_S and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    elapsed = config.stash.get(_ELAPSED, None)
    if elapsed is not None:
        over = " -- OVER BUDGET: the run fails" if elapsed > SUITE_BUDGET_S else ""
        terminalreporter.write_line(f"suite time {elapsed:.0f} s of a {SUITE_BUDGET_S:.0f} s budget{over}")


SPAWNS = ("ServerProcess(", "run_ranks(", "launch_group(", "subprocess.", "Popen(", "mp.spawn(", "multiprocessing.")
"""What in a test (or a fixture or module function it uses) starts processes: a server, ranks."""


def _spawns(fn, seen: set) -> bool:
    """Whether ``fn``, or a module-level function or fixture of its module it names, starts processes."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not isinstance(fn, (types.FunctionType, type)) or fn in seen or not fn.__module__.startswith("tests"):
        return False
    seen.add(fn)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(s in source for s in SPAWNS):
        return True
    functions = [fn] if isinstance(fn, types.FunctionType) else [
        f for f in vars(fn).values() if isinstance(f, types.FunctionType)]
    for f in functions:
        codes = [f.__code__, *(k for k in f.__code__.co_consts if isinstance(k, types.CodeType))]
        if any(_spawns(f.__globals__.get(name), seen) for code in codes for name in code.co_names):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """``server``: the test starts processes (a server or ranks), itself or through a fixture; the
    fast lane is ``pytest -m "not server"``."""
    for item in items:
        seen: set = set()
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(_spawns(fn, seen) for fn in [getattr(item, "function", None), *fixtures] if fn is not None):
            item.add_marker(pytest.mark.server)


ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: directory} of small fp32 checkpoints whose layers straddle files."""
    from tests.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: write_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def references(checkpoints):
    """{arch: greedy token ids per prompt} from transformers' own unsharded model."""
    from tests.checkpoints import reference_generate

    return {arch: reference_generate(path) for arch, path in checkpoints.items()}
