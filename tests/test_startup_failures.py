"""Startup failures: one clear error line, a non-zero exit within 60 s, no process left behind."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import REPO, free_port, wait_session_gone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("startup") / "llama", "llama")


def _start_and_wait(args, timeout=60):
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--device", "cpu", *args], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    start = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    elapsed = time.monotonic() - start
    assert not wait_session_gone(proc.pid), "orphaned processes"
    errors = [line for line in stderr.splitlines() if line.startswith("hsdp-serve: ")]
    return proc.returncode, errors, elapsed, stderr


def _broken(model_dir, tmp_path, how):
    path = tmp_path / how
    shutil.copytree(model_dir, path)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[3]
    if how == "truncated":
        with open(path / shard, "r+b") as f:
            f.truncate(os.path.getsize(path / shard) // 2)
    else:
        os.remove(path / shard)
    return str(path), shard


@pytest.mark.parametrize("how", ["truncated", "incomplete"])
def test_bad_checkpoint(model_dir, tmp_path, how):
    path, shard = _broken(model_dir, tmp_path, how)
    code, errors, elapsed, stderr = _start_and_wait(["--model", path, "--port", str(free_port())])
    assert code != 0 and elapsed < 60
    assert len(errors) == 1, stderr[-2000:]
    assert "CorruptFileError" in errors[0] and shard in errors[0]


def test_mesh_that_does_not_fit(model_dir):
    code, errors, elapsed, stderr = _start_and_wait(
        ["--model", model_dir, "--nproc-per-node", "2", "--replicate-size", "3"])
    assert code == 2 and len(errors) == 1 and "replicate_size=3" in errors[0], stderr[-2000:]


def test_missing_model_directory(tmp_path):
    code, errors, elapsed, stderr = _start_and_wait(["--model", str(tmp_path / "nowhere")])
    assert code == 2 and len(errors) == 1 and "no such directory" in errors[0], stderr[-2000:]


def test_port_in_use(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, errors, elapsed, stderr = _start_and_wait(["--model", model_dir, "--port", str(port)])
    assert code != 0 and elapsed < 60
    assert len(errors) == 1 and "cannot listen" in errors[0], stderr[-2000:]


def test_checkpoint_without_a_tokenizer(model_dir, tmp_path):
    path = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, path)
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(path / name)
    code, errors, elapsed, stderr = _start_and_wait(["--model", str(path), "--port", str(free_port())])
    assert code != 0 and len(errors) == 1, stderr[-2000:]
    assert "MissingTokenizerError" in errors[0] and "no tokenizer files" in errors[0] and str(path) in errors[0]
    assert "loaded" not in stderr  # refused before the weights were read


def test_neither_a_directory_nor_a_repo_id(tmp_path):
    code, errors, elapsed, stderr = _start_and_wait(["--model", str(tmp_path / "no" / "such" / "thing")])
    assert code == 2 and len(errors) == 1 and "no such directory" in errors[0], stderr[-2000:]
