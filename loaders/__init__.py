"""Read Hugging Face safetensors checkpoints straight into HSDP-sharded models.

Knows files, names, shapes and dtypes; the sharding itself is ``shard_engine``'s.

Every name below is imported from its module at its first use (``shard_engine.lazy``): the
read modes' names come from ``loaders.modes`` alone, without torch.
"""

from __future__ import annotations

from shard_engine.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
