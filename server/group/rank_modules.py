"""What every rank imports before its first tensor, and nothing else: importing this module computes
nothing (no CUDA, no OpenMP threads, no process group), so a process that has imported it and done
nothing since is as good a parent for a rank as a fresh interpreter that has (the fork server,
``server.group._rank_imports``; a warm parent, ``server.group.forkserver.fork_from_this_process``)."""

# What a rank imports before its first tensor, heaviest first: torch, the config and the loaders
# (server.main); transformers' models (the masking utilities bring torch._dynamo); the HTTP stack
# rank 0 serves with; the engine and the group's control.
import server.main  # noqa: F401
import transformers  # noqa: F401
import transformers.masking_utils  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import loaders.peer  # noqa: F401
import loaders.streaming  # noqa: F401  (the packages' inits import nothing: PEP 562, their modules here)
import server.engine  # noqa: F401
import server.group.control  # noqa: F401
import server.group.lifecycle  # noqa: F401
import server.http.app  # noqa: F401
import server.http.listener  # noqa: F401
import shard_engine.overlap  # noqa: F401
import shard_engine.sharding  # noqa: F401
import shard_engine.shm_all_gather  # noqa: F401
import shard_engine.units  # noqa: F401
