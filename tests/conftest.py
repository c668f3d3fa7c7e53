import os
import time

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
