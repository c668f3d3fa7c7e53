"""Errors raised while reading a checkpoint. Each names the file and, where known, the tensor."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be loaded as asked; ``path`` and ``tensor`` say where."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        where = ", ".join(part for part in (f"file {path}" if path else "", f"tensor {tensor!r}" if tensor else "") if part)
        super().__init__(f"{message} ({where})" if where else message)

    def __reduce__(self):
        # Keep the fields when the exception travels between ranks (all_gather_object pickles it).
        return (_rebuild, (type(self), self.args[0], self.path, self.tensor))


def _rebuild(cls, full_message, path, tensor):
    err = cls.__new__(cls)
    Exception.__init__(err, full_message)
    err.path, err.tensor = path, tensor
    return err


class MissingConfigError(CheckpointError):
    """The model directory has no readable ``config.json``."""


class MissingTokenizerError(CheckpointError):
    """The checkpoint has no tokenizer files, or they cannot be read, and one is needed."""


class CorruptFileError(CheckpointError):
    """A safetensors file is truncated, has a malformed header, or is missing."""


class MissingTensorError(CheckpointError):
    """The model expects a tensor that no checkpoint file provides."""


class UnexpectedTensorError(CheckpointError):
    """A checkpoint file provides a tensor the model has no place for."""


class ShapeMismatchError(CheckpointError):
    """A checkpoint tensor's shape differs from the model's parameter or buffer."""


class DTypeMismatchError(CheckpointError):
    """A checkpoint tensor's dtype differs from the model's and no ``dtype=`` asked for a cast."""


class RemoteRankError(CheckpointError):
    """Loading failed on another rank; this rank stops too instead of waiting in a collective."""
