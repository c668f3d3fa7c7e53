"""Soak benchmark: one hsdp-serve group at twice its capacity for a long while, misbehaving clients
among the well-behaved ones (issue 23's acceptance).

    python -m benchmarks.soak [--duration 1200] [--baseline 120] [--capacity-levels 1,2,4,...,128]
                              [--capacity-step 10] [--max-new-tokens 32] [--slow-readers 3]
                              [--stalled-uploads 3] [--hold 300] [--settle S]
                              [--server-args "--body-timeout 10 --slow-reader-timeout 10"] [--out FILE]
                              [--records FILE]

One server, serve.py's `hsdp` (the bench Llama on 2 CPU ranks, float32 unless --dtype says), then:

  idle         after a warm-up: /metrics (running and waiting sequences, KV blocks used per rank)
               and each rank's PSS (/proc/PID/smaps_rollup, the pids from GET /info)
  capacity     closed loops of well-behaved streamed /v1/completions clients, --capacity-step
               seconds per concurrency level, stepping up until requests/s grows by less than 10%;
               capacity is the best requests/s seen
  baseline     the well-behaved mix alone, Poisson arrivals at --load-factor x capacity (twice)
  soak         --duration seconds at the same rate: of the arrivals, 10% disconnect after a few
               tokens, 5% send malformed bodies, the rest are well-behaved; beside them
               --slow-readers raw sockets that send a streamed request and never read (or read a
               byte every 3 s), and --stalled-uploads that send Content-Length: 1000000 and a few
               bytes, each held until the server closes it or --hold seconds pass
  recovery     once every client is gone: /metrics and PSS polled until back to idle, or 60 s

The well-behaved mix: /v1/completions and /v1/chat/completions, streamed and whole, TGI's
/generate_stream and /generate. A /health probe runs every 0.5 s on a thread of its own
throughout. Every request ends with an outcome: `finished`, `status_<code>` (an answer without a
finish: 4xx, 429, 5xx), `error_event` (in a stream), `own_disconnect` (the client left on
purpose), or `lost` (a client-side timeout, a broken connection, a stream that ended without
its finish). Raw clients are their own fault: for them it records whether and when the server
closed the connection, and whether the response had ended.

Above capacity the queue grows until running + queued requests reach the server's bounds (then
429s), so TTFT grows with a phase's length until then: TTFT is compared over the arrivals after
--settle seconds (default: that fill time, at most half the phase; a phase shorter than the fill
time is warned of). Exits 1 when an acceptance bound is missed: any 5xx, any lost request,
well-behaved (settled) TTFT p99 in the soak over the baseline's above 2, not back to idle within 60 s, /health slower than 1 s.
The JSON goes to benchmarks/results/soak-cpu-DATE.json unless --out says where.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import random
import re
import shlex
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import httpx

from benchmarks.models import bench_checkpoint, compute_dtype
from benchmarks.serve import CLIENT_KEEPALIVE_S, Outcome, build_server, closed_loop, make_prompts, openai_request, \
    percentile, poisson, summarize

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tgi_stream": "/generate_stream",
         "tgi": "/generate"}
WELL_BEHAVED_MIX = (("completions", True), ("completions", False), ("chat", True), ("chat", False),
                    ("tgi_stream", True), ("tgi", False))
STREAMED = ("completions", "chat", "tgi_stream")
RAW_KINDS = ("slow_reader_never", "slow_reader_trickle", "stalled_upload")
TCP_ESTABLISHED = 1
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# -- requests through httpx ------------------------------------------------------------------------
@dataclass
class Record:
    phase: str
    kind: str  # well_behaved | disconnect | malformed
    endpoint: str
    streamed: bool
    start: float
    end: float = 0.0
    first: float | None = None
    tokens: int = 0
    outcome: str = "lost"
    status: int | None = None
    detail: str | None = None
    what: str | None = None  # a malformed request's flaw
    queue_ms: int | None = None  # the server's own queue time (TGI's x-queue-time header, /generate only)


def build_body(endpoint: str, prompt: str, max_tokens: int, streamed: bool) -> dict:
    if endpoint == "completions":
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
    if endpoint == "chat":
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "stream": streamed}
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}


def _event_parts(event: dict) -> tuple[bool, bool]:
    """(carries a token, carries the finish) for an OpenAI chunk or a TGI stream event."""
    choices = event.get("choices")
    if choices is not None:
        token = any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)
        return token, any(c.get("finish_reason") for c in choices)
    return "token" in event, event.get("details") is not None or event.get("generated_text") is not None


def _whole_finished(body) -> bool:
    if isinstance(body, dict) and body.get("choices"):
        return all(c.get("finish_reason") for c in body["choices"])
    return isinstance(body, dict) and "generated_text" in body


async def _read_stream(client: httpx.AsyncClient, rec: Record, path: str, content: bytes, stop_after: int | None):
    async with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            rec.outcome, rec.detail = f"status_{r.status_code}", (await r.aread())[:200].decode("utf-8", "replace")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                rec.outcome, rec.detail = "error_event", str(event["error"])[:200]
                return
            token, finished = _event_parts(event)
            if token:
                rec.tokens += 1
                rec.first = rec.first or time.perf_counter()
            if finished:
                rec.outcome = "finished"
            elif stop_after is not None and rec.tokens >= stop_after:
                rec.outcome = "own_disconnect"  # leaving the block closes the connection mid-stream
                return
        if rec.outcome != "finished":
            rec.outcome, rec.detail = "lost", "stream ended without its finish"


async def _read_whole(client: httpx.AsyncClient, rec: Record, path: str, content: bytes):
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    rec.status = r.status_code
    if "x-queue-time" in r.headers:
        rec.queue_ms = int(r.headers["x-queue-time"])
    if r.status_code == 200:
        body = r.json()
        rec.outcome = "finished" if _whole_finished(body) else "status_200"
    else:
        rec.outcome, rec.detail = f"status_{r.status_code}", r.text[:200]


async def send(client: httpx.AsyncClient, rec: Record, content: bytes, timeout_s: float,
               stop_after: int | None = None) -> Record:
    """One request to ``rec.endpoint``, its outcome written into ``rec``; never longer than ``timeout_s``."""
    path = PATHS[rec.endpoint]
    try:
        read = _read_stream(client, rec, path, content, stop_after) if rec.streamed else \
            _read_whole(client, rec, path, content)
        await asyncio.wait_for(read, timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.outcome, rec.detail = "lost", "client timeout"
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        rec.outcome, rec.detail = "lost", f"{type(e).__name__}: {e}"[:200]
    rec.end = time.perf_counter()
    return rec


def malformed_bodies(max_body_bytes: int = 1 << 20) -> list[tuple[str, bytes, str]]:
    """(endpoint, body, what) for each malformed request, sent in turn."""
    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    long_prompt = " ".join(["the"] * 60_000)  # far beyond the bench model's 2048 positions, under the body limit
    return [
        ("completions", b'{"prompt": "the server", "max_tokens": 8', "truncated JSON"),
        ("chat", b"hello, not JSON", "not JSON"),
        ("tgi_stream", b'{"inputs": "a", "parameters": {"max_new_tokens": 4}}}}', "trailing garbage"),
        ("completions", b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 4}', "invalid UTF-8"),
        ("completions", b"[" * 100_000 + b"]" * 100_000, "100k-deep nesting"),
        ("completions", j({"prompt": 5, "max_tokens": "ten"}), "wrong types"),
        ("chat", j({"messages": "hi", "max_tokens": 4}), "messages not a list"),
        ("tgi", j({"inputs": ["a"], "parameters": {"max_new_tokens": "x"}}), "wrong types"),
        ("completions", j({"prompt": "the", "max_tokens": 4, "frobnicate": {"a": 1}, "stream": True}),
         "unknown field"),
        ("chat", j({"messages": [{"role": "wizard", "content": "hi", "mana": 3}], "max_tokens": 4}),
         "unknown role and field"),
        ("completions", j({"prompt": "the", "max_tokens": 10**12}), "max_tokens 1e12"),
        ("tgi_stream", j({"inputs": "the", "parameters": {"max_new_tokens": 10**9}}), "max_new_tokens 1e9"),
        ("chat", j({"messages": [{"role": "user", "content": "hi"}], "n": 10**6}), "n 1e6"),
        ("completions", b'{"prompt": "the", "max_tokens": 4, "temperature": NaN}', "temperature NaN"),
        ("completions", j({"prompt": long_prompt, "max_tokens": 4}), "prompt of 60k words"),
        ("tgi", j({"inputs": "x" * (max_body_bytes + 10), "parameters": {}}), "body over the limit"),
    ]


# -- raw sockets: slow readers and stalled uploads -------------------------------------------------
@dataclass
class RawRecord:
    kind: str
    endpoint: str
    start: float
    server_closed: bool = False
    closed_after_s: float | None = None
    bytes_read: int = 0
    status_line: str | None = None
    response_head: str | None = None  # the response's first bytes after its status line
    response_ended: bool | None = None  # the buffered response held its end ([DONE] or the finish)
    detail: str | None = None


def _tcp_state(sock: socket.socket) -> int:
    """The kernel's state of this end (1 established; 8 close-wait once the server sent its FIN;
    7 closed after a reset): seen without reading, so a client that never reads still sees it."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


async def raw_client(kind: str, port: int, endpoint: str, hold_s: float, max_tokens: int) -> RawRecord:
    loop = asyncio.get_running_loop()
    rec = RawRecord(kind, endpoint, time.perf_counter())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.setblocking(False)
    head_bytes, tail = b"", b""
    try:
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 10)
        head = f"POST {PATHS[endpoint]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        if kind == "stalled_upload":
            await loop.sock_sendall(sock, f"{head}Content-Length: 1000000\r\n\r\n".encode() + b'{"prompt": "th')
        else:
            body = build_body(endpoint, "the server shards the weights", max_tokens, True)
            # 5 alternatives a token: ~1 KB per event, so the socket buffers fill within tens of tokens
            body.update({"logprobs": 5} if endpoint == "completions" else {"logprobs": True, "top_logprobs": 5})
            body = json.dumps(body).encode()
            await loop.sock_sendall(sock, f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = rec.start + hold_s
        while time.perf_counter() < deadline and _tcp_state(sock) == TCP_ESTABLISHED:
            if kind == "slow_reader_trickle":
                try:
                    byte = await asyncio.wait_for(loop.sock_recv(sock, 1), 3.0)
                except asyncio.TimeoutError:
                    continue
                if not byte:
                    break
                rec.bytes_read += 1
                head_bytes, tail = (head_bytes + byte)[:800], (tail + byte)[-4096:]
                await asyncio.sleep(3.0)
            else:
                await asyncio.sleep(0.5)
        rec.server_closed = _tcp_state(sock) != TCP_ESTABLISHED
        if rec.server_closed:
            rec.closed_after_s = round(time.perf_counter() - rec.start, 2)
        # What the server had sent, read at once now (at most 2 s): its status line, and whether it ended.
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), max(0.01, end - time.perf_counter()))
            except (asyncio.TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            rec.bytes_read += len(chunk)
            head_bytes, tail = (head_bytes + chunk)[:800], (tail + chunk)[-4096:]
        if head_bytes.startswith(b"HTTP/"):
            rec.status_line, _, rest = head_bytes.decode("latin-1").partition("\r\n")
            rec.response_head = (rest.partition("\r\n\r\n")[2] or rest)[:200]
        rec.response_ended = b"[DONE]" in tail or b'"details":{' in tail
    except (OSError, asyncio.TimeoutError) as e:
        rec.detail = f"{type(e).__name__}: {e}"[:200]
    finally:
        sock.close()
    return rec


async def raw_slot(kind: str, port: int, until: float, hold_s: float, max_tokens: int, out: list) -> None:
    """One raw client after another until ``until``; each ``hold_s`` at most, a second apart."""
    for i in range(10_000):
        left = until - time.perf_counter()
        if left < 1:
            return
        endpoint = ("completions", "chat")[i % 2]
        out.append(await raw_client(kind, port, endpoint, min(hold_s, left), max_tokens))
        await asyncio.sleep(1.0)


# -- probes: /health, /metrics, PSS ----------------------------------------------------------------
class HealthProbe(threading.Thread):
    """GET /health every ``interval_s`` on a thread (and a connection) of its own, so that the
    load generator's event loop does not delay it; every ``gauge_every``-th probe also reads the
    running and waiting sequences from /metrics (a time series of the queue)."""

    def __init__(self, url: str, interval_s: float = 0.5, gauge_every: int = 4):
        super().__init__(name="health-probe", daemon=True)
        self.url, self.interval_s, self.gauge_every = url, interval_s, gauge_every
        self.samples: list[tuple[float, float, int | None]] = []  # (time, latency s, status or None)
        self.gauges: list[tuple[float, float | None, float | None]] = []  # (time, running, waiting)
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            for i in itertools.count():
                if self.halt.wait(self.interval_s):
                    return
                t0 = time.perf_counter()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError:
                    status = None
                self.samples.append((t0, time.perf_counter() - t0, status))
                if i % self.gauge_every == 0:
                    try:
                        m = read_metrics(self.url, client)
                        self.gauges.append((t0, m["running"], m["waiting"]))
                    except httpx.HTTPError:
                        pass

    def summary(self, t0: float = 0.0, t1: float = float("inf")) -> dict:
        picked = [(lat, status) for t, lat, status in self.samples if t0 <= t < t1]
        lat = [x for x, _ in picked]
        return {"probes": len(picked), "failed": sum(1 for _, s in picked if s != 200),
                "max_ms": round(max(lat) * 1000, 1) if lat else None,
                "p99_ms": round(percentile(lat, 99) * 1000, 1) if lat else None}


_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def read_metrics(url: str, client: httpx.Client | None = None) -> dict:
    """The gauges that must come back to idle, and the server's request and failure counters."""
    text = (client or httpx).get(f"{url}/metrics", timeout=10).text
    out: dict = {"running": None, "waiting": None, "kv_used": {}, "kv_cached": {}, "requests": {}, "failures": {}}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))
        if name == "hsdp_running_sequences":
            out["running"] = value
        elif name == "hsdp_waiting_sequences":
            out["waiting"] = value
        elif name == "hsdp_kv_blocks" and labels.get("state") in ("used", "cached"):
            out[f"kv_{labels['state']}"][labels["rank"]] = value
        elif name == "hsdp_requests_total":
            out["requests"][f"{labels['endpoint']} {labels['status']}"] = value
        elif name == "hsdp_failures_total":
            out["failures"][labels["reason"]] = value
    return out


def read_pss(pids: list[int]) -> dict[int, int | None]:
    """Each process's proportional set size in bytes (None where it cannot be read)."""
    out: dict[int, int | None] = {}
    for pid in pids:
        out[pid] = None
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        out[pid] = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return out


def is_idle(now: dict, pss: dict, idle: dict, idle_pss: dict, pss_tolerance: float) -> bool:
    if now["running"] or now["waiting"]:
        return False
    if any(v > idle["kv_used"].get(r, 0) for r, v in now["kv_used"].items()):
        return False
    return all(pss.get(pid) is not None and pss[pid] <= base * (1 + pss_tolerance)
               for pid, base in idle_pss.items() if base is not None)


def wait_for_idle(url: str, pids: list[int], idle: dict, idle_pss: dict, tolerance: float, limit_s: float) -> dict:
    t0 = time.perf_counter()
    trace = []
    while True:
        now, pss = read_metrics(url), read_pss(pids)
        elapsed = time.perf_counter() - t0
        trace.append({"t_s": round(elapsed, 1), "running": now["running"], "waiting": now["waiting"],
                      "kv_used": now["kv_used"], "pss_mib": {p: _mib(v) for p, v in pss.items()}})
        if is_idle(now, pss, idle, idle_pss, tolerance):
            return {"back_to_idle": True, "time_to_idle_s": round(elapsed, 1), "last": trace[-1], "metrics": now,
                    "trace": trace}
        if elapsed > limit_s:
            return {"back_to_idle": False, "time_to_idle_s": None, "last": trace[-1], "metrics": now, "trace": trace}
        time.sleep(1.0)


def _mib(v: int | None) -> float | None:
    return None if v is None else round(v / 2**20, 1)


# -- phases ----------------------------------------------------------------------------------------
async def find_capacity(url: str, levels: list[int], step_s: float, max_new_tokens: int) -> dict:
    """Closed loops of streamed /v1/completions clients, a level at a time, until requests/s
    grows by less than 10% over the best so far."""
    prompts = make_prompts(256, seed=1)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024, keepalive_expiry=CLIENT_KEEPALIVE_S)
    steps, best, plateau = [], 0.0, False
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        for c in levels:
            deadline = time.perf_counter() + step_s
            outcomes: list[Outcome] = []

            async def client_loop(offset: int) -> None:
                for i in range(offset, 100_000, c):
                    if time.perf_counter() >= deadline:
                        return
                    outcomes.append(await openai_request(client, None, prompts[i % len(prompts)], max_new_tokens))

            await asyncio.gather(*(client_loop(k) for k in range(c)))
            s = summarize(outcomes)
            rps = s.get("requests_per_s", 0.0)
            steps.append({"concurrency": c, "requests": s["requests"], "failures": s["failures"],
                          "requests_per_s": rps, "ttft_ms": s.get("ttft_ms")})
            log(f"capacity: {c} clients, {rps} req/s, TTFT {s.get('ttft_ms')}, {s['failures']} failures")
            if rps < best * 1.1:
                plateau, best = True, max(best, rps)
                break
            best = rps
    if not plateau:
        log(f"capacity: still growing at {levels[-1]} clients: capacity is at least {best} req/s")
    # no plateau: capacity is at least this; the last level may not have saturated the group
    return {"requests_per_s": best, "steps": steps, "plateau": plateau,
            "how": f"closed loops of streamed /v1/completions clients ({max_new_tokens} new tokens), {step_s:g} s "
                   f"per level, stepped up until requests/s grew by less than 10%: the best requests/s seen"}


async def run_load(url: str, port: int, phase: str, rate: float, duration_s: float, args,
                   records: list, raw_records: list) -> None:
    """Poisson arrivals for ``duration_s``; in the soak, misbehaving clients among them and raw
    ones beside them. Returns once every client has ended."""
    rng = random.Random(f"{phase}-kinds")
    prompts = make_prompts(512, seed=2)
    malformed = malformed_bodies()
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=CLIENT_KEEPALIVE_S)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def one(prompt: str) -> Record:
            u = rng.random() if phase == "soak" else 1.0
            if u < args.disconnect_fraction:
                rec = Record(phase, "disconnect", rng.choice(STREAMED), True, time.perf_counter())
                body = build_body(rec.endpoint, prompt, args.max_new_tokens, True)
                records.append(rec)
                return await send(client, rec, json.dumps(body).encode(), args.request_timeout,
                                  stop_after=rng.randint(1, 3))
            if u < args.disconnect_fraction + args.malformed_fraction:
                endpoint, content, what = malformed[next(counter) % len(malformed)]
                streamed = endpoint == "tgi_stream" or b'"stream": true' in content
                rec = Record(phase, "malformed", endpoint, streamed, time.perf_counter(), what=what)
                records.append(rec)
                return await send(client, rec, content, args.request_timeout)
            endpoint, streamed = rng.choice(WELL_BEHAVED_MIX)
            rec = Record(phase, "well_behaved", endpoint, streamed, time.perf_counter())
            records.append(rec)
            return await send(client, rec, json.dumps(build_body(endpoint, prompt, args.max_new_tokens, streamed))
                              .encode(), args.request_timeout)

        until = time.perf_counter() + duration_s
        raw = []
        if phase == "soak":
            for kind, n in (("slow_reader_never", args.slow_readers - args.slow_readers // 2),
                            ("slow_reader_trickle", args.slow_readers // 2), ("stalled_upload", args.stalled_uploads)):
                raw += [raw_slot(kind, port, until, args.hold, args.slow_max_tokens, raw_records) for _ in range(n)]
        await asyncio.gather(poisson(one, prompts, rate, duration_s, seed={"baseline": 1, "soak": 2}[phase]), *raw)


def latency_ms(records: list[Record], phase: str, streamed: bool, since: float = 0.0) -> dict:
    """The finished well-behaved requests' TTFT (streamed) or end-to-end latency (whole), p50 and
    p99, of those that arrived from ``since`` on."""
    mine = [r for r in records if r.phase == phase and r.kind == "well_behaved" and r.streamed == streamed
            and r.outcome == "finished" and r.start >= since]
    values = [r.first - r.start for r in mine if r.first] if streamed else [r.end - r.start for r in mine]
    q = {p: percentile(values, p) for p in (50, 99)}
    return {"n": len(values), **{f"p{p}": None if v is None else round(v * 1000, 1) for p, v in q.items()}}


def windows(records: list[Record], gauges: list, phase: str, t0: float, t1: float, width_s: float = 60.0) -> list:
    """The phase in ``width_s`` windows: by arrival, the well-behaved streamed TTFT (p50, p99) and
    whole requests' server queue time (p99); by end, well-behaved requests finished a second; the
    mean running and waiting sequences. Where a tail comes from: a stretch of the run, or all of it."""
    out = []
    start = t0
    while start < t1:
        end = start + width_s
        mine = [r for r in records if r.phase == phase and r.kind == "well_behaved" and start <= r.start < end]
        ttft = [r.first - r.start for r in mine if r.streamed and r.outcome == "finished" and r.first]
        queue = [r.queue_ms for r in mine if r.queue_ms is not None]
        done = sum(1 for r in records if r.phase == phase and r.kind == "well_behaved" and r.outcome == "finished"
                   and start <= r.end < end)
        g = [(run, wait) for t, run, wait in gauges if start <= t < end and run is not None]
        out.append({"from_s": round(start - t0), "arrived": len(mine), "ttft_n": len(ttft),
                    "ttft_p50_ms": round(percentile(ttft, 50) * 1000) if ttft else None,
                    "ttft_p99_ms": round(percentile(ttft, 99) * 1000) if ttft else None,
                    "queue_p99_ms": percentile(queue, 99) if queue else None,
                    "finished_per_s": round(done / width_s, 2),
                    "running": round(sum(x for x, _ in g) / len(g), 1) if g else None,
                    "waiting": round(sum(y for _, y in g) / len(g), 1) if g else None})
        start = end
    return out


def compact_records(records: list[Record], t0: float) -> dict:
    """Every request as one row (times in seconds from ``t0``), for analysis after the run."""
    def rel(t):
        return None if t is None else round(t - t0, 3)
    return {"columns": ["phase", "kind", "endpoint", "streamed", "start", "first", "end", "tokens", "outcome",
                        "status", "queue_ms"],
            "rows": [[r.phase, r.kind, r.endpoint, r.streamed, rel(r.start), rel(r.first), rel(r.end or None),
                      r.tokens, r.outcome, r.status, r.queue_ms] for r in records]}


def count_outcomes(records: list[Record]) -> dict:
    out: dict = {}
    for r in records:
        per = out.setdefault(r.phase, {}).setdefault(r.kind, {}).setdefault(r.endpoint + (" stream" if r.streamed
                                                                                          else ""), {})
        per[r.outcome] = per.get(r.outcome, 0) + 1
    return out


def count_raw(raw: list[RawRecord]) -> dict:
    out = {}
    for kind in RAW_KINDS:
        mine = [r for r in raw if r.kind == kind]
        closed = [r.closed_after_s for r in mine if r.server_closed]
        out[kind] = {"connections": len(mine), "closed_by_server": len(closed),
                     "close_after_s": {"min": min(closed), "max": max(closed)} if closed else None,
                     "response_ended": sum(1 for r in mine if r.response_ended),
                     "status_lines": sorted({r.status_line for r in mine if r.status_line}),
                     "errors": sorted({r.detail for r in mine if r.detail})[:3]}
    return out


def print_table(report: dict) -> None:
    d, a, t = report["dtype"], report["acceptance"], report["ttft_ms"]
    cap = report["capacity"]
    rows = [("capacity", f"{cap['requests_per_s']} req/s ({d}; {'plateau' if cap['plateau'] else 'no plateau'} "
                         f"at {cap['steps'][-1]['concurrency']} clients); load {report['rate_per_s']} req/s")]
    for phase in ("baseline", "soak"):
        for which in ("all", "settled"):
            m = t[phase][which]
            rows.append((f"TTFT {phase} ({which})", f"p50 {m['p50']} / p99 {m['p99']} ms ({d}, n={m['n']})"))
    rows += [(name, f"{v['value']}  (bound {v['bound']}) {'ok' if v['ok'] else 'MISSED'}") for name, v in a.items()]
    for phase, kinds in report["outcomes"].items():
        for kind, per in kinds.items():
            total: dict = {}
            for counts in per.values():
                for k, v in counts.items():
                    total[k] = total.get(k, 0) + v
            rows.append((f"{phase} {kind}", ", ".join(f"{k} {v}" for k, v in sorted(total.items()))))
    for kind, r in report["raw_clients"].items():
        rows.append((kind, f"{r['connections']} conns, {r['closed_by_server']} closed by the server "
                           f"{r['close_after_s'] or ''}, {r['response_ended']} ended, {r['status_lines']}"))
    for phase, ws in report["windows"].items():
        rows.append((f"{phase} TTFT p99 by minute", ", ".join(f"{w['ttft_p99_ms'] / 1000:.0f}" if w["ttft_p99_ms"]
                                                              else "-" for w in ws) + " s"))
    rec = report["recovery"]["last"]
    rows.append(("after the soak", f"running {rec['running']}, waiting {rec['waiting']}, KV used {rec['kv_used']}, "
                                   f"PSS MiB {rec['pss_mib']} (idle {report['idle']['pss_mib']})"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def check_acceptance(report: dict, records: list[Record], raw: list[RawRecord], args) -> dict:
    five_xx = sum(1 for r in records if r.status is not None and r.status >= 500)
    five_xx += sum(1 for r in raw if r.status_line and re.match(r"HTTP/\S+ 5", r.status_line))
    lost = sum(1 for r in records if r.outcome == "lost")
    base, soak = report["ttft_ms"]["baseline"]["settled"]["p99"], report["ttft_ms"]["soak"]["settled"]["p99"]
    ratio = round(soak / base, 2) if base and soak else None
    health = report["health"]["all"]
    return {
        "5xx": {"value": five_xx, "bound": 0, "ok": five_xx == 0},
        "lost": {"value": lost, "bound": 0, "ok": lost == 0},
        "ttft_p99_soak_over_baseline": {"value": ratio, "bound": 2, "ok": ratio is not None and ratio <= 2},
        "time_to_idle_s": {"value": report["recovery"]["time_to_idle_s"], "bound": args.recovery_limit,
                           "ok": report["recovery"]["back_to_idle"]},
        "health_max_ms": {"value": health["max_ms"], "bound": 1000,
                          "ok": health["max_ms"] is not None and health["max_ms"] <= 1000 and not health["failed"]},
    }


def run_phases(server, args, report: dict, records: list[Record], raw: list[RawRecord], probe: HealthProbe) -> dict:
    """Warm-up, idle, capacity, baseline, soak, recovery; the time each began."""
    dtype = report["dtype"]
    report["ready_s"] = round(server.start(), 2)
    asyncio.run(_warm_up(server.url, args.max_new_tokens))
    time.sleep(2.0)
    info = httpx.get(f"{server.url}/info", timeout=30).json()
    pids = [r["pid"] for r in info["ranks"] if r.get("pid")]
    idle, idle_pss = read_metrics(server.url), read_pss(pids)
    report["idle"] = {"metrics": idle, "pss_mib": {p: _mib(v) for p, v in idle_pss.items()}}
    log(f"idle: running {idle['running']}, waiting {idle['waiting']}, KV used {idle['kv_used']}, "
        f"PSS MiB {report['idle']['pss_mib']}")
    probe.start()
    marks = {"capacity": time.perf_counter()}
    levels = [int(c) for c in args.capacity_levels.split(",")]
    report["capacity"] = asyncio.run(find_capacity(server.url, levels, args.capacity_step, args.max_new_tokens))
    rate = report["rate_per_s"] = round(args.load_factor * report["capacity"]["requests_per_s"], 3)
    if rate <= 0:
        raise RuntimeError("capacity search found no throughput")
    # Above capacity the queue grows until running + queued reach their bounds (then 429s): TTFT
    # is compared over the arrivals after that, where it no longer depends on the phase's length.
    bound = info["max_concurrent_requests"] + info["max_queued_requests"]
    fill_s = bound / ((args.load_factor - 1) * report["capacity"]["requests_per_s"]) if args.load_factor > 1 else 0
    report["queue_fill_s"] = round(fill_s, 1)
    for phase, seconds in (("baseline", args.baseline), ("soak", args.duration)):
        settle = args.settle if args.settle is not None else min(fill_s, seconds / 2)
        if settle < fill_s:
            log(f"{phase}: {seconds:g} s is too short for the queue to fill (~{fill_s:.0f} s at this rate): "
                f"its TTFT still grows with the phase's length")
        marks[phase] = time.perf_counter()
        report.setdefault("settle_s", {})[phase] = round(settle, 1)
        log(f"{phase}: {seconds:g} s at {rate} req/s ({dtype}), TTFT compared after {settle:.0f} s")
        asyncio.run(run_load(server.url, server.port, phase, rate, seconds, args, records, raw))
        report[f"{phase}_drain_s"] = round(time.perf_counter() - marks[phase] - seconds, 1)
        log(f"{phase}: every client ended {report[f'{phase}_drain_s']} s after the last arrival; TTFT "
            f"{latency_ms(records, phase, True)} ms ({dtype})")
    marks["recovery"] = time.perf_counter()
    report["recovery"] = wait_for_idle(server.url, pids, idle, idle_pss, args.pss_tolerance, args.recovery_limit)
    marks["end"] = time.perf_counter()
    return marks


def run(args) -> int:
    model_dir = args.model or bench_checkpoint()
    dtype = compute_dtype(args.dtype)
    log(f"dtype {dtype}")
    server = build_server("hsdp", model_dir, tempfile.mkdtemp(prefix="soak-"), 128, dtype)
    server.argv += shlex.split(args.server_args)
    records: list[Record] = []
    raw: list[RawRecord] = []
    report: dict = {"model": model_dir, "dtype": dtype, "argv": server.argv, "cpu_count": os.cpu_count(),
                    "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    probe = HealthProbe(server.url)
    try:
        marks = run_phases(server, args, report, records, raw, probe)
    except Exception:
        log("failed; the server's log ends:\n" + open(server.log_path).read()[-3000:])
        raise
    finally:
        probe.halt.set()
        server.stop()
    with open(server.log_path) as f:
        lines = f.read().splitlines()
    report["server_log"] = {"path": server.log_path, "tail": lines[-15:],
                            "error_lines": sum(1 for x in lines if "ERROR" in x or "Traceback" in x)}
    spans = list(marks.items())
    report["health"] = {"all": probe.summary(),
                        **{name: probe.summary(t0, t1) for (name, t0), (_, t1) in zip(spans, spans[1:])}}
    report["ttft_ms"] = {p: {"all": latency_ms(records, p, True),
                             "settled": latency_ms(records, p, True, marks[p] + report["settle_s"][p])}
                         for p in ("baseline", "soak")}
    report["whole_e2e_ms"] = {p: latency_ms(records, p, False, marks[p] + report["settle_s"][p])
                              for p in ("baseline", "soak")}
    report["outcomes"] = count_outcomes(records)
    report["windows"] = {p: windows(records, probe.gauges, p, marks[p], t1)
                         for p, t1 in (("baseline", marks["soak"]), ("soak", marks["recovery"]))}
    report["malformed"] = {}
    for r in records:
        if r.kind == "malformed":
            per = report["malformed"].setdefault(f"{r.endpoint}: {r.what}", {})
            per[r.outcome] = per.get(r.outcome, 0) + 1
    report["raw_clients"] = count_raw(raw)
    report["acceptance"] = check_acceptance(report, records, raw, args)
    report["raw_connections"] = [asdict(r) for r in raw]
    report["lost_details"] = sorted({f"{r.kind} {r.endpoint}: {r.detail}" for r in records if r.outcome == "lost"})[:20]
    report["5xx_details"] = sorted({f"{r.kind} {r.endpoint} {r.what or ''} {r.status}: {r.detail}" for r in records
                                    if r.status and r.status >= 500})[:20]
    out = args.out or os.path.join(RESULTS, f"soak-cpu-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    log(f"wrote {out}")
    if args.records:
        with open(args.records, "w") as f:
            json.dump(compact_records(records, marks["capacity"]), f, separators=(",", ":"))
        log(f"wrote every request's row to {args.records}")
    print_table(report)
    return 0 if all(v["ok"] for v in report["acceptance"].values()) else 1


async def _warm_up(url: str, max_new_tokens: int) -> None:
    prompts = make_prompts(8, seed=3)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        outcomes = await closed_loop(lambda p: openai_request(client, None, p, max_new_tokens), prompts, 4, 2)
    if any(o.error for o in outcomes):
        raise RuntimeError(f"warm-up failed: {[o.error for o in outcomes if o.error][:2]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the 80M bench Llama, generated once)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="float32")
    parser.add_argument("--server-args", default="", help="more hsdp-serve flags, one string: '--x 1 --y 2'")
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of the soak (default 1200)")
    parser.add_argument("--baseline", type=float, default=120.0, help="seconds of the baseline (default 120)")
    parser.add_argument("--capacity-levels", default="1,2,4,8,16,32,64,128", help="closed-loop client counts to try")
    parser.add_argument("--capacity-step", type=float, default=10.0, help="seconds per capacity level (default 10)")
    parser.add_argument("--load-factor", type=float, default=2.0, help="arrival rate over capacity (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--disconnect-fraction", type=float, default=0.10)
    parser.add_argument("--malformed-fraction", type=float, default=0.05)
    parser.add_argument("--slow-readers", type=int, default=3, help="raw clients reading never or a byte in 3 s")
    parser.add_argument("--slow-max-tokens", type=int, default=1024, help="what a slow reader asks for")
    parser.add_argument("--stalled-uploads", type=int, default=3)
    parser.add_argument("--hold", type=float, default=300.0, help="seconds a raw client waits for the server to "
                        "close it before it gives up (default 300)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="a client's bound on one request")
    parser.add_argument("--settle", type=float, help="seconds into each phase before its TTFT counts (default: "
                        "the time the queue takes to fill at this rate, at most half the phase)")
    parser.add_argument("--recovery-limit", type=float, default=60.0, help="seconds to come back to idle")
    parser.add_argument("--pss-tolerance", type=float, default=0.05, help="PSS over idle still counted as idle")
    parser.add_argument("--out", help="the JSON report (default: benchmarks/results/soak-cpu-DATE.json)")
    parser.add_argument("--records", help="also write every request as one row (times from the capacity phase's "
                        "start) to this JSON file: tens of thousands of rows, kept out of the report")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
