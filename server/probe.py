"""A probe for container health checks: ``python -m server.probe [/health|/ready]``.

Exits 0 when the server answers the path with 200, 1 otherwise (another status, refused,
timed out), printing one line either way. The port is ``$HSDP_PORT`` (default 8000) on
``$HSDP_PROBE_HOST`` (default 127.0.0.1), the address a probe inside the container reaches
whatever ``--host`` the server binds. Standard library only: it runs in a fresh interpreter
every few seconds, so it must not import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

PROBE_PATHS = ("/health", "/ready")


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200, f"{url}: {response.status}"
    except urllib.error.HTTPError as e:  # 503 while loading, draining or after a fault
        return False, f"{url}: {e.code} {e.read(512).decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.probe", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="/health", choices=PROBE_PATHS)
    parser.add_argument("--host", default=os.environ.get("HSDP_PROBE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("HSDP_PORT") or 8000))
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default 4)")
    args = parser.parse_args(argv)
    ok, line = probe(f"http://{args.host}:{args.port}{args.path}", args.timeout)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
