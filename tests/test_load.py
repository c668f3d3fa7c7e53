"""A bounded load test against the real server: 64 concurrent clients for 30 s, mixed lengths,
some streams abandoned. Nothing unexpected fails, every completed greedy answer equals the
reference, and rank memory is flat between the first and the last 10 s."""

import random
import threading
import time

import httpx
import pytest
import torch

from tests.checkpoints import tokenizer, write_checkpoint
from tests.server_process import ServerProcess, rank_pids

CONCURRENCY, DURATION_S = 64, 30.0
PROMPTS = ["The quick brown fox", "Once upon a time", "hsdp", "0123456789", "every rank runs", "The lazy dog",
           "zero", "Rank zero answers HTTP requests"]
LENGTHS = (4, 8, 16, 32)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.timeout(400)
def test_bounded_load(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(tmp_path / "llama", "llama")
    tok = tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = {}
    for prompt in PROMPTS:  # greedy: a shorter request's answer is a prefix of the longest one
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(LENGTHS),
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        reference[prompt] = out[0, ids.shape[1]:].tolist()
    eos = tok.eos_token_id

    def expected(prompt, n):
        ids = reference[prompt][:n]
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    server = ServerProcess(path, log_path=tmp_path / "log")
    try:
        server.poll_ready()
        pids = rank_pids(server.client)
        memory: list[tuple[float, list[int]]] = []
        counts = {"done": 0, "abandoned": 0}
        failures: list[str] = []
        lock = threading.Lock()
        start = time.monotonic()
        stop_at = start + DURATION_S

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=server.url, timeout=60) as c:
                while time.monotonic() < stop_at:
                    prompt, n = rng.choice(PROMPTS), rng.choice(LENGTHS)
                    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
                    try:
                        if rng.random() < 0.15:  # a stream its client abandons after the first token
                            with c.stream("POST", "/generate_stream", json=body) as r:
                                next(r.iter_lines())
                            with lock:
                                counts["abandoned"] += 1
                            continue
                        r = c.post("/generate", json=body)
                        got = [t["id"] for t in r.json()["details"]["tokens"]] if r.status_code == 200 else None
                        if got != expected(prompt, n):
                            with lock:
                                failures.append(f"{r.status_code} {prompt!r} {n}: {r.text[:200]}")
                        else:
                            with lock:
                                counts["done"] += 1
                    except httpx.HTTPError as e:
                        with lock:
                            failures.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CONCURRENCY)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            memory.append((time.monotonic() - start, [_rss(p) for p in pids.values()]))
            time.sleep(1.0)
        for t in threads:
            t.join(60)

        mib = [[round(m[r] / 2**20) for m in (memory[0][1], memory[-1][1])] for r in range(len(pids))]
        print(f"load: {counts} in {DURATION_S:g} s at concurrency {CONCURRENCY}; rank RSS first/last MiB {mib}")
        assert not failures, failures[:5]
        assert counts["done"] > 200 and counts["abandoned"] > 20, counts
        first = [m for t, m in memory if t <= 10]
        last = [m for t, m in memory if t >= DURATION_S - 10]
        for rank in range(len(pids)):
            early = max(m[rank] for m in first)
            late = max(m[rank] for m in last)
            assert late <= early * 1.05 + 32 * 2**20, (rank, early, late)
        assert "hsdp_running_sequences 0.0" in server.client.get("/metrics").text
    finally:
        server.stop()
