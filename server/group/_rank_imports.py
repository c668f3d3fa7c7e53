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

import server.group.rank_modules  # noqa: E402,F401
