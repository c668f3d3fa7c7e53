"""Read Hugging Face safetensors checkpoints straight into HSDP-sharded models.

Knows files, names, shapes and dtypes; the sharding itself is ``shard_engine``'s.

Its names are imported at their first use (PEP 562), not with the package: ``server.config``
reads the read modes from ``loaders.modes`` without importing torch, so that ``hsdp-serve --help``
and a mistyped flag answer at once.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "READ_MODES": "loaders.modes",
    "CheckpointError": "loaders.errors",
    "CorruptFileError": "loaders.errors",
    "DTypeMismatchError": "loaders.errors",
    "LoadStats": "loaders.stats",
    "LoadedModel": "loaders.streaming",
    "MissingConfigError": "loaders.errors",
    "MissingTensorError": "loaders.errors",
    "MissingTokenizerError": "loaders.errors",
    "RemoteRankError": "loaders.errors",
    "ShapeMismatchError": "loaders.errors",
    "UnexpectedTensorError": "loaders.errors",
    "UnsupportedQuantizationError": "loaders.errors",
    "load_hsdp_model": "loaders.streaming",
    "shard_rows": "loaders.streaming",
    "update_hsdp_model": "loaders.streaming",
}
"""Each name this package exports -> the module that declares it (imported at its first use)."""

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
