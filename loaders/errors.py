"""Errors raised while reading a checkpoint. Each names the file and, where known, the tensor.

Between ranks an error travels as a record of plain data (:func:`error_to_record`), never
pickled: its class's name, one of :data:`ERROR_CLASSES`, and its fields; :func:`error_from_record`
builds it back, and a name outside that list becomes a :class:`RemoteRankError` with the text.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be loaded as asked; ``path`` and ``tensor`` say where."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        where = ", ".join(part for part in (f"file {path}" if path else "", f"tensor {tensor!r}" if tensor else "") if part)
        super().__init__(f"{message} ({where})" if where else message)

    def __reduce__(self):
        # Keep the fields where a process boundary pickles the exception (multiprocessing's results).
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


class UnsupportedQuantizationError(CheckpointError):
    """The checkpoint's ``quantization_config`` asks for a method or option the server does not compute
    (``loaders.quantization.formats`` lists what it does); raised before any weight is read."""


class PeerLoadError(CheckpointError):
    """Loading from a peer group (``loaders.peer``) failed or was refused; storage is the fallback."""


class PartialUpdateError(CheckpointError):
    """A live update (``update_hsdp_model``) failed after its first write: the model is part old,
    part new, and must not be served."""


class RemoteRankError(CheckpointError):
    """Loading failed on another rank; this rank stops too instead of waiting in a collective."""


ERROR_CLASSES = {cls.__name__: cls for cls in (
    CheckpointError, MissingConfigError, MissingTokenizerError, CorruptFileError, MissingTensorError,
    UnexpectedTensorError, ShapeMismatchError, DTypeMismatchError, UnsupportedQuantizationError, PeerLoadError, PartialUpdateError, RemoteRankError,
)}
"""The errors a rank may rebuild from another rank's record, by class name."""


def error_to_record(error: CheckpointError) -> dict:
    """``error`` as plain data for ``shard_engine.wire``: its class's name and its fields."""
    return {"type": type(error).__name__, "message": str(error.args[0]) if error.args else "",
            "path": error.path, "tensor": error.tensor}


def error_from_record(record) -> CheckpointError:
    """The error another rank sent as :func:`error_to_record`; a class outside
    :data:`ERROR_CLASSES`, or a record that is not one, becomes a RemoteRankError with its text."""
    if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str | None) for k in ("type", "message", "path", "tensor")):
        return RemoteRankError(f"a malformed error record from another rank: {str(record)[:200]}")
    cls = ERROR_CLASSES.get(record["type"])
    if cls is None:
        return RemoteRankError(f"{record['type']}: {record['message']}")
    return _rebuild(cls, record["message"] or "", record["path"], record["tensor"])
