"""The compiled decoder layers' graphs on disk (``--compile-region layer``), so that a second start
loads them instead of tracing again.

A graph traced ahead of time (:class:`shard_engine.torch_private.CompiledCall`) does not go
through inductor's caches: a start that traced again would generate and build its code again
(about 2.5 s a graph on these cores). The store keeps every graph of one warm-up entry (a graph,
static or open, at a thread count) beside which layer runs which, in a directory named by what
the code of those graphs depends on: torch's, transformers' and Python's versions, the sources of
the classes of the layers and their submodules (and their bases) and of :mod:`server.engine` (the
attention the graphs call), the model's configuration, the layers' parameters' and buffers' shapes
and dtypes, the forwards replaced on module instances (``--packed-linears``), inductor's and
dynamo's settings, the matmul precisions and ``TORCHINDUCTOR_*`` variables
(:func:`shard_engine.torch_private.compiler_settings`), the device (a CUDA device's index: its code
names it) and what inductor built for it (:func:`shard_engine.torch_private.compiler_target`),
the KV block size. Anything else changed is another directory; one nobody reads again is left for
the operator to delete with the rest of the cache (``TORCHINDUCTOR_CACHE_DIR``).

An entry is written whole or not at all (each file written aside and renamed; the layers' map
last). A loaded graph is checked against eager on its first layer's warm-up inputs before it
serves (:meth:`server.engine.compiled._CompiledLayers`): an entry that fails to load or to match
is deleted and traced again, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when what an entry holds changes."""


def store_key(model: nn.Module, layers: list[nn.Module], device: torch.device, block_size: int) -> str:
    """The directory name of the graphs of ``model``'s ``layers`` (a hash of what their code depends on)."""
    import transformers

    from shard_engine.torch_private import compiler_settings, compiler_target

    digest = hashlib.sha256()
    engine_dir = os.path.dirname(os.path.abspath(__file__))
    classes = {c for layer in layers for module in layer.modules() for c in type(module).__mro__ if c is not object}
    sources = ({path for path in map(_source_file, classes) if path} |
               {os.path.join(engine_dir, name) for name in os.listdir(engine_dir) if name.endswith(".py")})
    facts = {"format": FORMAT, "torch": torch.__version__, "transformers": transformers.__version__,
             "python": sys.version, "target": compiler_target(device.type), "settings": compiler_settings(),
             # a CUDA graph's code names its device's index
             "device": str(device) if device.type == "cuda" else device.type,
             "environment": sorted((k, v) for k, v in os.environ.items()
                                   if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE", "TORCHDYNAMO_"))
                                   and k != "TORCHINDUCTOR_CACHE_DIR"),
             "block_size": block_size, "config": model.config.to_json_string(use_diff=False),
             "tensors": [[(name, tuple(t.shape), str(t.dtype)) for name, t in
                          [*layer.named_parameters(), *layer.named_buffers()]] for layer in layers],
             # forwards replaced on instances (--packed-linears' linears): other code, the same classes
             "forwards": [[(name, _qualname(vars(m)["forward"])) for name, m in layer.named_modules()
                           if "forward" in vars(m)] for layer in layers]}
    digest.update(json.dumps(facts, sort_keys=True, default=str).encode())
    contents = []
    for path in sources:
        with open(path, "rb") as f:
            contents.append(hashlib.sha256(f.read()).digest())
    for content in sorted(contents):  # what the sources say, not where they are installed
        digest.update(content)
    return digest.hexdigest()[:32]


class GraphStore:
    """Entries under ``root/key``: ``{graph}-{threads}/`` (``graph``: a static size, ``8``, or the open
    one, ``8+``) holds ``graph-{n}.bin`` and ``layers.json`` (the graph number of each layer, in order)."""

    def __init__(self, root: str, key: str):
        self.dir = os.path.join(root, key)

    def _entry(self, graph: str, threads: int) -> str:
        return os.path.join(self.dir, f"{graph}-{threads}")

    def load(self, graph: str, threads: int, fn: Callable, layers: int):
        """Each layer's graph of the entry (CompiledCall; layers sharing one share the object), or
        None where there is no whole entry or it fails to load (then it is deleted)."""
        from shard_engine.torch_private import CompiledCall

        entry = self._entry(graph, threads)
        try:
            with open(os.path.join(entry, "layers.json")) as f:
                numbers = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.drop(graph, threads, f"its map does not read ({e})")
            return None
        try:
            if len(numbers) != layers:
                raise ValueError(f"{len(numbers)} layers mapped, the model has {layers}")
            graphs = {}
            for n in sorted(set(numbers)):
                with open(os.path.join(entry, f"graph-{n}.bin"), "rb") as f:
                    graphs[n] = CompiledCall.load(f.read(), fn)
        except Exception as e:  # noqa: BLE001 - a graph that does not load is traced again
            self.drop(graph, threads, f"it does not load ({type(e).__name__}: {e})")
            return None
        return [graphs[n] for n in numbers]

    def save(self, graph: str, threads: int, graphs: list) -> None:
        """Writes the entry of ``graphs`` (each layer's CompiledCall); a failure is logged, not raised
        (the next start traces again)."""
        entry = self._entry(graph, threads)
        numbers, unique = [], {}
        for compiled in graphs:
            numbers.append(unique.setdefault(id(compiled), (len(unique), compiled))[0])
        try:
            os.makedirs(entry, exist_ok=True)
            for n, compiled in unique.values():
                _write(os.path.join(entry, f"graph-{n}.bin"), compiled.save())
            _write(os.path.join(entry, "layers.json"), json.dumps(numbers).encode())
        except Exception as e:  # noqa: BLE001 - the graphs serve this start either way
            logger.warning("compiled decode: the layers' graphs at batch %s, %d threads not saved to %s (%s: %s)",
                           graph, threads, entry, type(e).__name__, e)

    def drop(self, graph: str, threads: int, why: str) -> None:
        entry = self._entry(graph, threads)
        logger.warning("compiled decode: the layers' saved graphs at batch %s, %d threads (%s) traced again: %s",
                       graph, threads, entry, why)
        shutil.rmtree(entry, ignore_errors=True)


def _qualname(forward) -> str:
    function = getattr(forward, "func", forward)  # a functools.partial's function
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', type(function).__name__)}"


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None


def _write(path: str, data: bytes) -> None:
    handle, aside = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".writing-")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.replace(aside, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(aside)
        raise
