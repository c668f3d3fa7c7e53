"""Read Hugging Face safetensors checkpoints straight into HSDP-sharded models.

Knows files, names, shapes and dtypes; the sharding itself is ``shard_engine``'s.
"""

from loaders.errors import (
    CheckpointError,
    CorruptFileError,
    DTypeMismatchError,
    MissingConfigError,
    MissingTensorError,
    MissingTokenizerError,
    RemoteRankError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedQuantizationError,
)
from loaders.stats import LoadStats
from loaders.streaming import READ_MODES, LoadedModel, load_hsdp_model, shard_rows, update_hsdp_model

__all__ = [
    "READ_MODES",
    "CheckpointError",
    "CorruptFileError",
    "DTypeMismatchError",
    "LoadStats",
    "LoadedModel",
    "MissingConfigError",
    "MissingTensorError",
    "MissingTokenizerError",
    "RemoteRankError",
    "ShapeMismatchError",
    "UnexpectedTensorError",
    "UnsupportedQuantizationError",
    "load_hsdp_model",
    "shard_rows",
    "update_hsdp_model",
]
