"""Names a rank the moment its interpreter starts (``ps``: ``hsdp-serve rank (starting)``).

The launcher puts this folder on ``PYTHONPATH`` for the ranks it spawns (``server.group.launch``):
Python imports ``sitecustomize`` before anything else, so a rank is named before it spends
seconds importing torch (until then ``ps`` showed ``python3 -c from multiprocessing.spawn ...``).
Only a multiprocessing child (``--multiprocessing-fork``) of a launcher that set
``HSDP_SPAWN_TITLE`` is named; the rank's own title, with its number, follows in
``server.group.launch._run_rank``. The ``sitecustomize`` this one shadows, if any, runs after it.
"""

import os
import sys

_title = os.environ.get("HSDP_SPAWN_TITLE")
if _title and "--multiprocessing-fork" in sys.argv:
    try:
        import setproctitle

        setproctitle.setproctitle(_title)
    except ImportError:
        pass


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed()
