"""A Hugging Face Hub cache written by hand, laid out exactly as huggingface_hub lays it out.

    HF_HOME/hub/models--ORG--NAME/blobs/<sha256 of the file>
                                 /refs/main                 (the commit hash)
                                 /snapshots/<commit>/<file> -> ../../blobs/<sha256>

Served with ``HF_HUB_OFFLINE=1`` and ``HF_HOME`` pointing here, no network is needed.
"""

from __future__ import annotations

import hashlib
import os


def write_hub_cache(hf_home, repo_id: str, files_dir: str, *, commit: str | None = None,
                    ref: str = "main", names: list[str] | None = None) -> str:
    """Put the files of ``files_dir`` (all, or ``names``) into the cache as ``repo_id`` at ``commit``
    (default: a hash of their contents), with ``ref`` pointing at it; returns the commit."""
    names = sorted(names if names is not None else os.listdir(files_dir))
    digests = {}
    for name in names:
        with open(os.path.join(files_dir, name), "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    commit = commit or hashlib.sha1("".join(digests.values()).encode()).hexdigest()
    repo = os.path.join(str(hf_home), "hub", "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    for name, digest in digests.items():
        blob = os.path.join(repo, "blobs", digest)
        if not os.path.exists(blob):
            with open(os.path.join(files_dir, name), "rb") as src, open(blob, "wb") as dst:
                dst.write(src.read())
        link = os.path.join(snapshot, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "blobs", digest), link)
    with open(os.path.join(repo, "refs", ref), "w") as f:
        f.write(commit)
    return commit
