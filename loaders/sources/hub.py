"""Hugging Face Hub repo ids (``org/name``) as checkpoints: resolved to a local snapshot directory.

``huggingface_hub`` does the work, so its settings hold: ``HF_HOME`` / ``HF_HUB_CACHE`` (where
snapshots live), ``HF_HUB_OFFLINE=1`` (the local cache only), ``HF_TOKEN`` (gated and private
repos), ``HF_ENDPOINT`` (a mirror). Only what the loader reads is fetched: safetensors files, the
index, the config, the generation config and the tokenizer files. A repo without safetensors
weights is refused before anything is downloaded.
"""

from __future__ import annotations

import os
import re

ALLOW_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
]
# The Hub's own rule: one optional namespace, names of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class HubModelError(ValueError):
    """A repo id that cannot be served; the message is one line naming the repo."""


def looks_like_repo_id(spec: str) -> bool:
    """Whether ``spec`` reads as ``org/name`` (or a bare ``name``) and is not a local path."""
    return (bool(_REPO_ID.match(spec)) and ".." not in spec and not spec.endswith(".")
            and not os.path.exists(spec))


def _has_safetensors(names) -> bool:
    return any(n.endswith(".safetensors") for n in names)


def download_hub_model(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision``, downloading what is missing."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub import errors as hf_errors

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        if not constants.HF_HUB_OFFLINE:
            files = HfApi().list_repo_files(repo_id, revision=revision)
            if not _has_safetensors(files):
                raise HubModelError(f"{where}: the repo has no safetensors weights (hsdp-serve reads only "
                                    "safetensors, never pickle files)")
        path = snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except HubModelError:
        raise
    except hf_errors.GatedRepoError:
        raise HubModelError(f"{where}: gated repo: accept its terms on the Hub and set HF_TOKEN") from None
    except hf_errors.RepositoryNotFoundError:
        raise HubModelError(f"{where}: no such repo on the Hub (or private: set HF_TOKEN)") from None
    except hf_errors.RevisionNotFoundError:
        raise HubModelError(f"{where}: no such revision") from None
    except hf_errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub is not reachable"
        raise HubModelError(f"{where}: not in the local Hub cache ({constants.HF_HUB_CACHE}) and {why}") from None
    except (hf_errors.HfHubHTTPError, OSError) as e:
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HubModelError(f"{where}: cannot fetch from the Hub: {line}") from None
    if not _has_safetensors(os.listdir(path)):
        raise HubModelError(f"{where}: the snapshot {path} has no safetensors weights (hsdp-serve reads only "
                            "safetensors, never pickle files)")
    return path
