"""A Hugging Face checkpoint directory: its config, its safetensors files and what they hold."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from loaders.errors import CheckpointError, CorruptFileError, MissingConfigError, MissingTokenizerError
from loaders.safetensors_io import TensorInfo, read_header, read_remote_header

GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 64, 4096
"""How many tensors' first bytes, and how many of each, :meth:`CheckpointFiles.fingerprint` reads."""


@dataclass
class CheckpointFiles:
    """The files of a checkpoint, in the order the index lists them, with their headers."""

    directory: str
    files: list[str]  # absolute paths
    tensors: dict[str, tuple[str, TensorInfo]]  # checkpoint key -> (file, info)
    remote: dict = field(default_factory=dict)  # url -> loaders.remote.RemoteFile, for s3:// files
    _fingerprint: str | None = field(default=None, repr=False, compare=False)  # fingerprint()'s, once read

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors.values())

    def fingerprint(self) -> str:
        """SHA-256 of what identifies the checkpoint wherever it is mounted: config.json's bytes,
        every tensor's key, dtype, shape and place in its file (by the file's name, not its path),
        and the first :data:`FINGERPRINT_SAMPLE_BYTES` of :data:`FINGERPRINT_SAMPLES` tensors
        spread over the keys (a fine-tune
        saved like its base has the same headers, not the same values). Two copies of one
        checkpoint agree; a few small reads, never the weights (a peer's rows are checked by
        their checksums as they arrive: ``shard_engine.transfer``). Read once per listing."""
        if self._fingerprint is None:
            self._fingerprint = self._read_fingerprint()
        return self._fingerprint

    def _read_fingerprint(self) -> str:
        import hashlib

        from loaders.safetensors_io import read_bytes

        digest = hashlib.sha256()
        config = os.path.join(self.directory, "config.json")
        if os.path.isfile(config):
            with open(config, "rb") as f:
                digest.update(f.read())
        keys = sorted(self.tensors)
        for key in keys:
            path, info = self.tensors[key]
            digest.update(f"{key}|{os.path.basename(path)}|{info.dtype}|{list(info.shape)}|{info.start}|"
                          f"{info.nbytes}\n".encode())
        picked = keys[::max(1, -(-len(keys) // FINGERPRINT_SAMPLES))]
        for key in picked:
            path, info = self.tensors[key]
            nbytes = min(info.nbytes, FINGERPRINT_SAMPLE_BYTES)
            if not nbytes:
                continue
            remote = self.remote.get(path)
            if remote is not None:
                digest.update(read_bytes(remote, info.start, nbytes, path=path))
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                digest.update(read_bytes(fd, info.start, nbytes, path=path))
            finally:
                os.close(fd)
        return digest.hexdigest()

    def dominant_dtype(self) -> torch.dtype | None:
        counts: dict[torch.dtype, int] = {}
        for _, info in self.tensors.values():
            if info.dtype.is_floating_point and info.dtype.itemsize > 1:  # (fp8: quantized weights, not the model's)
                counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
        return max(counts, key=counts.get) if counts else None


def load_config(model_dir: str):
    """The transformers config of ``model_dir``, from local files only."""
    from transformers import AutoConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise MissingConfigError("model directory does not exist or is not a directory", path=model_dir)
    if not os.path.isfile(path):
        raise MissingConfigError("model directory has no config.json", path=path)
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise MissingConfigError(f"cannot read config.json: {e}", path=path) from e


def list_checkpoint_files(model_dir: str) -> CheckpointFiles:
    """Read the index (or the single file) and every header; validate that they agree."""
    from loaders.remote import remote_files

    remote = remote_files(model_dir)  # an s3:// checkpoint: the weights stay in the store
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"malformed index: {e}", path=index_path) from e
        names = list(dict.fromkeys(weight_map.values()))  # first-appearance order
    elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)) or SINGLE_FILE in (remote or {}):
        weight_map, names = None, [SINGLE_FILE]
    else:
        if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(model_dir)):
            raise CheckpointError("only safetensors checkpoints are loaded, never pickle files", path=model_dir)
        raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE}", path=model_dir)
    files: list[str] = []
    tensors: dict[str, tuple[str, TensorInfo]] = {}
    for name in names:
        if remote is not None:
            if name not in remote:
                with open(os.path.join(model_dir, "remote.json")) as f:
                    source = json.load(f).get("source", model_dir)
                raise CorruptFileError("file listed in the index is missing from the store",
                                       path=f"{source.rstrip('/')}/{name}")
            path, header = remote[name].url, read_remote_header(remote[name])
        else:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                raise CorruptFileError("file listed in the index is missing", path=path)
            header = read_header(path)
        files.append(path)
        for key, info in header.items():
            if weight_map is not None and weight_map.get(key) != name:
                # The index is authoritative; a stray copy elsewhere is not read.
                continue
            if key in tensors:
                raise CheckpointError(f"tensor also stored in {tensors[key][0]}", path=path, tensor=key)
            tensors[key] = (path, info)
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in tensors:
                where = remote[name].url if remote is not None and name in remote else os.path.join(model_dir, name)
                raise CorruptFileError("tensor listed in the index is not in its file", path=where, tensor=key)
    return CheckpointFiles(model_dir, files, tensors, remote={f.url: f for f in remote.values()} if remote else {})


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES)


def load_tokenizer(model_dir: str, *, required: bool = False):
    """The checkpoint's tokenizer, or None without tokenizer files (an error when ``required``)."""
    if not has_tokenizer(model_dir):
        if required:
            raise MissingTokenizerError(
                f"no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): a tokenizer is needed to serve text",
                path=model_dir,
            )
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MissingTokenizerError(f"cannot load the tokenizer: {e}", path=model_dir) from e


def load_generation_config(model_dir: str):
    """The checkpoint's ``generation_config.json`` (transformers' GenerationConfig), or None without one."""
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read the generation config: {e}", path=path) from e
