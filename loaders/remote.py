"""Checkpoint files in object storage (S3 and S3-compatible stores), read by ranged GETs.

A remote checkpoint is a local directory (config, index, tokenizer: fetched once per node by
:mod:`loaders.sources.s3`) whose ``remote.json`` names the safetensors objects. Every rank reads
each file's header with at most two ranged GETs (the first 64 KiB, then the rest of a longer
header) and then only the rows its shards own: one ranged GET per tensor's rows, a large one
split into ``--load-concurrency`` GETs that run at once, into the rank's own buffer.

boto3 (botocore) is the client: it finds credentials as every AWS tool does (the AWS_* variables,
profiles, instance and container roles), takes ``AWS_ENDPOINT_URL`` for S3-compatible stores
(MinIO, Ceph, R2), and retries throttling, 5xx answers and dropped connections with exponential
backoff and jitter ("standard" mode, :data:`MAX_ATTEMPTS` attempts). What retrying cannot mend (a
missing object, a refused request, an object shorter than its header says) is one
:class:`~loaders.errors.CheckpointError` naming the object.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loaders.errors import CheckpointError, CorruptFileError

REMOTE_FILE = "remote.json"
"""In a remote checkpoint's local directory: the URL of each safetensors file and its size."""
HEADER_PROBE_BYTES = 64 * 1024
MAX_ATTEMPTS = 10
SPLIT_BYTES = 8 << 20
"""Reads larger than this are split into ranged GETs that run concurrently."""
DEFAULT_CONCURRENCY = 8

_client = None
_client_lock = threading.Lock()


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix without slashes at its ends)."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url}")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise ValueError(f"{url}: no bucket")
    return bucket, prefix.strip("/")


def client():
    """The process's S3 client, shared by every thread: boto3 clients are thread-safe, but creating
    one costs tens of milliseconds (one per reading thread made a 56-file load 10x slower) and is
    not thread-safe, hence the lock."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as e:  # pragma: no cover - boto3 is a dependency
                raise CheckpointError("s3:// checkpoints need boto3 (pip install boto3)") from e
            config = Config(retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                            max_pool_connections=64, connect_timeout=10, read_timeout=60)
            _client = boto3.session.Session().client("s3", config=config)
        return _client


def describe_client_error(e: Exception, url: str) -> CheckpointError:
    """botocore's error as one line naming the object: missing, refused, or what the store said."""
    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
    status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return CorruptFileError("the object does not exist", path=url)
    if code in ("NoSuchBucket",):
        return CheckpointError("the bucket does not exist", path=url)
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken") or status == 403:
        return CheckpointError(f"access refused by the store ({code or status}): check the credentials", path=url)
    return CheckpointError(f"the store answered {code or status or type(e).__name__}: {e}", path=url)


@dataclass(frozen=True)
class RemoteFile:
    """One safetensors object, read by ranged GETs."""

    url: str
    size: int
    etag: str | None = None  # as listed: every GET asks for this version (If-Match)

    @property
    def bucket_key(self) -> tuple[str, str]:
        bucket, key = parse_s3_url(self.url)
        return bucket, key

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self._get_into(memoryview(out), offset)
        return bytes(out)

    def readinto(self, view: memoryview, offset: int, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        """Fill ``view`` with the object's bytes from ``offset``, large reads as concurrent GETs."""
        n = len(view)
        if n <= SPLIT_BYTES or concurrency <= 1:
            self._get_into(view, offset)
            return
        parts = min(concurrency, -(-n // SPLIT_BYTES))
        step = -(-n // parts)
        with ThreadPoolExecutor(parts, thread_name_prefix="hsdp-s3") as pool:
            futures = [pool.submit(self._get_into, view[a:a + step], offset + a) for a in range(0, n, step)]
            for future in futures:
                future.result()

    def _get_into(self, view: memoryview, offset: int) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        n = len(view)
        if n == 0:
            return
        if offset + n > self.size:
            raise CorruptFileError(f"the object is truncated: bytes {offset}-{offset + n - 1} asked of {self.size}",
                                   path=self.url)
        bucket, key = self.bucket_key
        extra = {"IfMatch": self.etag} if self.etag else {}
        try:
            response = client().get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + n - 1}", **extra)
            body = response["Body"]
            done = 0
            try:
                while done < n:
                    chunk = body.read(min(n - done, 1 << 20))
                    if not chunk:
                        break
                    view[done:done + len(chunk)] = chunk
                    done += len(chunk)
            finally:
                body.close()
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code == "PreconditionFailed":
                raise CheckpointError("the object changed while loading (its ETag is not the one listed)",
                                      path=self.url) from e
            if code == "InvalidRange":
                raise CorruptFileError(f"the object is truncated: bytes {offset}-{offset + n - 1} are past its end",
                                       path=self.url) from e
            raise describe_client_error(e, self.url) from e
        except BotoCoreError as e:
            raise CheckpointError(f"cannot reach the store: {e}", path=self.url) from e
        if done != n:
            raise CorruptFileError(f"the object is truncated: {done} of {n} bytes at offset {offset}", path=self.url)


def remote_files(model_dir: str) -> dict[str, RemoteFile] | None:
    """The remote safetensors files of a checkpoint directory ({file name: RemoteFile}), or None
    for a local checkpoint."""
    path = os.path.join(model_dir, REMOTE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            entries = json.load(f)["files"]
        return {name: RemoteFile(entry["url"], int(entry["size"]), entry.get("etag"))
                for name, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"malformed {REMOTE_FILE}: {e}", path=path) from e
