"""Each process's log stream (``[rankN]`` or ``[launch]``) and its name in ``ps``."""

from __future__ import annotations

import logging
import os
import sys

from server.config import LOG_LEVELS
from server.group.process_group import is_under_torchrun

# Torch's own launcher loggers: at INFO and on failure they print a wall of configuration and
# tracebacks that GroupError already sums up in one line.
_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def configure_logging(log_level: str | None, *, rank: int | None = None) -> None:
    """One log stream per process, prefixed ``[rankN]`` (or ``[launch]`` for the launcher).

    ``rank=None`` means this process's rank under torchrun, else the launcher. ``log_level=None``
    logs rank 0 and the launcher at INFO, the other ranks at WARNING, so that N ranks do not
    print N copies of the same progress.
    """
    if log_level is not None and log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {log_level!r}")
    if rank is None and is_under_torchrun():
        rank = int(os.environ["RANK"])
    level = log_level.upper() if log_level else ("INFO" if not rank else "WARNING")
    prefix = "[launch]" if rank is None else f"[rank{rank}]"
    logging.basicConfig(
        level=level,
        format=f"{prefix} %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    _quiet_torch_loggers(log_level)


def _quiet_torch_loggers(log_level: str | None) -> None:
    # Some of these loggers carry their own level, so each existing one is set, not the parents.
    quiet = logging.WARNING if log_level == "debug" else logging.CRITICAL
    for name in [*_QUIET_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(_QUIET_LOGGERS):
            logging.getLogger(name).setLevel(quiet)


def set_process_title(title: str) -> None:
    """What ``ps`` shows for this process (where setproctitle is installed)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)

