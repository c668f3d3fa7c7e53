"""Roll new weights across separate hsdp-serve groups behind one load balancer, one group at a time.

    python -m server.roll --source DIR|s3://...|org/name [--revision R] [--version V] [--mode wait]
                          [--api-key KEY] [--ready-timeout S] URL [URL ...]

A group's own replicas already roll (``server.weights``); groups started apart (a Kubernetes
Deployment's pods, hosts behind a proxy) know nothing of each other. This updates them in turn:
each gets ``POST /admin/weights`` with ``"drain": true``, so its ``/ready`` answers 503 while it
updates and a load balancer's readiness check sends it nothing meanwhile while the others serve;
once it has answered, the next group waits until this one's ``/ready`` is 200 again (the load
balancer sees it back) before it starts. At most one group is out at a time.

A group that refuses the update (a 4xx: the checkpoint is not its model) or fails stops the roll:
the groups before it serve the new weights, it and the rest the old ones (a refused update
changes nothing), and the command exits 1 naming it. One JSON line per group on stdout: its URL,
status, seconds, and the server's record of the update. The API key is read from ``--api-key`` or
``HSDP_API_KEY``, as the server's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def roll(urls: list[str], body: dict, *, api_key: str | None = None, ready_timeout_s: float = 600.0,
         update_timeout_s: float = 3600.0, poll_s: float = 0.1) -> list[dict]:
    """Update each group of ``urls`` in turn with ``body`` (``POST /admin/weights``'s, drained);
    returns each group's record, stopping after the first that is not updated (its record says why)."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    records = []
    for i, url in enumerate(u.rstrip("/") for u in urls):
        with httpx.Client(base_url=url, headers=headers, timeout=update_timeout_s) as client:
            if i:  # the group before is back in the load balancer's set before this one leaves it
                previous = records[-1]["url"]
                if not _ready(client, previous, ready_timeout_s, poll_s):
                    records.append({"url": url, "status": "not_started",
                                    "error": f"{previous} was not ready again within {ready_timeout_s:g} s"})
                    return records
            began = time.perf_counter()
            try:
                r = client.post("/admin/weights", json={**body, "drain": True})
            except httpx.HTTPError as e:
                records.append({"url": url, "status": "failed", "error": f"{type(e).__name__}: {e}"})
                return records
            seconds = round(time.perf_counter() - began, 3)
            if r.status_code != 200:
                records.append({"url": url, "status": "refused" if r.status_code < 500 else "failed",
                                "http_status": r.status_code, "seconds": seconds, "error": _error(r)})
                return records
            records.append({"url": url, "status": "updated", "seconds": seconds, "update": r.json()})
    return records


def _ready(client, url: str, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get(url + "/ready", timeout=10).status_code == 200:
                return True
        except Exception:  # noqa: BLE001 - not answering yet: try again until the deadline
            pass
        time.sleep(poll_s)
    return False


def _error(response) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text[:500]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.roll", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("urls", nargs="+", metavar="URL", help="each group's base URL, in the order to update them")
    parser.add_argument("--source", required=True, help="a checkpoint directory, an s3:// prefix or a Hub repo id")
    parser.add_argument("--revision", help="the Hub repo's branch, tag or commit")
    parser.add_argument("--version", help="the version label (default: the server's, from the source)")
    parser.add_argument("--mode", choices=("wait", "abort", "keep"), default="wait")
    parser.add_argument("--api-key", default=os.environ.get("HSDP_API_KEY"))
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds a group may take to be ready again before the next one starts")
    args = parser.parse_args(argv)
    body = {"source": args.source, "mode": args.mode}
    for name in ("revision", "version"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    records = roll(args.urls, body, api_key=args.api_key, ready_timeout_s=args.ready_timeout)
    for record in records:
        print(json.dumps(record), flush=True)
    ok = len(records) == len(args.urls) and all(r["status"] == "updated" for r in records)
    if not ok:
        print(f"roll stopped at {records[-1]['url']}: {records[-1].get('error')}; the groups before it serve the "
              "new weights, it and the rest the old ones", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
