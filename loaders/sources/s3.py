"""``--model s3://bucket/prefix``: a checkpoint in object storage, its weights left there.

Once per node (the launcher, or local rank 0 under torchrun) the objects under the prefix are
listed; the small files (config, index, tokenizer, generation config) are fetched into a local
directory under the cache, and the safetensors objects are named in its ``remote.json`` with
their sizes. The loader then reads from the store itself, each rank only its rows
(:mod:`loaders.remote`). A fetch that stops half way leaves no directory behind: it is written
aside and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from loaders.remote import REMOTE_FILE, client, describe_client_error, parse_s3_url

SMALL_FILE_LIMIT = 512 << 20
"""A non-safetensors object larger than this under the prefix is not fetched (pickled weights,
optimizer states: never read)."""


def resolve_s3(url: str, cache_dir: str | None = None) -> str:
    """The local directory for ``url`` (fetched now): small files, and remote.json naming the weights."""
    from botocore.exceptions import BotoCoreError, ClientError

    from loaders.sources.default_model import cache_root

    bucket, prefix = parse_s3_url(url)
    root = os.path.join(cache_dir or cache_root(), "s3")
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, f"{bucket}-{hashlib.sha256(url.encode()).hexdigest()[:16]}")
    s3 = client()
    objects = []
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
        for page in pages:
            objects += page.get("Contents", [])
    except ClientError as e:
        raise ValueError(f"--model {url}: {describe_client_error(e, url)}") from e
    except BotoCoreError as e:
        raise ValueError(f"--model {url}: cannot reach the store: {e}") from e
    base = f"{prefix}/" if prefix else ""
    remote, small = {}, []
    for obj in objects:
        name = obj["Key"][len(base):]
        if not name or "/" in name:  # the checkpoint's own files only, not subfolders
            continue
        if name.endswith(".safetensors"):
            remote[name] = {"url": f"s3://{bucket}/{obj['Key']}", "size": obj["Size"], "etag": obj.get("ETag")}
        elif obj["Size"] <= SMALL_FILE_LIMIT:
            small.append((name, obj["Key"]))
    if not remote and not small:
        raise ValueError(f"--model {url}: no objects under this prefix")
    staging = tempfile.mkdtemp(prefix=".fetch-", dir=root)
    try:
        for name, key in small:
            try:
                s3.download_file(bucket, key, os.path.join(staging, name))
            except ClientError as e:
                raise ValueError(f"--model {url}: {describe_client_error(e, f's3://{bucket}/{key}')}") from e
        with open(os.path.join(staging, REMOTE_FILE), "w") as f:
            json.dump({"source": url, "files": remote}, f, indent=1)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
