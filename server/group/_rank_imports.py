"""Imported by the ranks' fork server before it forks any rank (``server.group.forkserver``): the
fork server records its pid and environment, names itself, ignores SIGTERM (a launcher's SIGTERM
drains the ranks, whose parent this is), dies with the launcher, then imports what every rank imports.
Nothing here computes: no CUDA, no OpenMP threads, no process group."""

import signal

from server.group.forkserver import die_with_parent, record_fork_server

record_fork_server()

try:
    import setproctitle

    setproctitle.setproctitle("hsdp-serve fork server (ranks start here)")
except ImportError:
    pass
signal.signal(signal.SIGTERM, signal.SIG_IGN)
die_with_parent()

# What a rank imports before its first tensor, heaviest first: torch, the config and the loaders
# (server.main); transformers' models (the masking utilities bring torch._dynamo); the HTTP stack
# rank 0 serves with; the engine and the group's control.
import server.main  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.masking_utils  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402,F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402,F401

import loaders  # noqa: E402,F401
import server.engine  # noqa: E402,F401
import server.group.control  # noqa: E402,F401
import server.group.lifecycle  # noqa: E402,F401
import server.http.app  # noqa: E402,F401
import server.http.listener  # noqa: E402,F401
import shard_engine  # noqa: E402,F401
