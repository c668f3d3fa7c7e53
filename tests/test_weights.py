"""New weights into a running server (``POST /admin/weights``; ``server.weights``,
``loaders.update_hsdp_model``): while streams run, each mode does what it says (``wait``: they
finish on the old weights; ``abort``: they end with an error event; ``keep``: they go on), the
greedy tokens afterwards are transformers' on the new checkpoint, each rank reads about half of it,
and a missing source, a checkpoint of another shape and a truncated file are each a 4xx naming
what is wrong while the old weights keep serving exactly; a 3-rank FSDP2 trainer pushes its
shards into the 2-rank server (``server.trainer.push``); SGLang's route with SGLang's body; vLLM's
``/pause`` (keep, abort; pause, update, resume) and ``/resume``."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from tests.checkpoints import PROMPTS, assert_greedy_tokens, reference_generate, write_checkpoint
from tests.dist import run_ranks, values
from tests.server_process import ServerProcess

TOKENS = 8
STREAM_TOKENS = 24
# one step group of both ranks (nothing resident: every forward gathers), each step 50 ms longer:
# a stream of 24 tokens runs over a second, long enough to be running when an update comes
ARGS = ("--kv-cache-memory", "8MiB", "--resident-units", "0")
ENV = {"HSDP_INJECT_FORWARD_DELAY": "0:0.05"}


HUB_REPO = "acme/llama-b"
"""Checkpoint b again, as a Hugging Face repo in an offline Hub cache the server is started with."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.hub_cache import write_hub_cache

    root = tmp_path_factory.mktemp("weights")
    a = write_checkpoint(root / "a", "llama", seed=0)
    b = write_checkpoint(root / "b", "llama", seed=1)
    commit = write_hub_cache(root / "hf", HUB_REPO, b)
    env = {**ENV, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
    server = ServerProcess(a, extra_args=ARGS, env=env, log_path=root / "server.log")
    server.root, server.paths, server.hub_commit = root, {"a": a, "b": b}, commit
    server.references = {name: reference_generate(path, max_new_tokens=TOKENS) for name, path in server.paths.items()}
    with server:
        yield server


def _update(server, name: str, **body) -> dict:
    r = server.client.post("/admin/weights", json={"source": server.paths[name], "version": name, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, out: list) -> threading.Thread:
    def run():
        with server.client.stream("POST", "/generate_stream", json={
                "inputs": PROMPTS[1], "parameters": {"max_new_tokens": STREAM_TOKENS, "stop": []}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out.append(json.loads(line[5:]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _running_streams(server, n: int) -> tuple[list[threading.Thread], list[list]]:
    outs = [[] for _ in range(n)]
    threads = [_stream(server, out) for out in outs]
    from tests.waiting import wait_until

    wait_until(lambda: all(outs), 30, "every stream's first token")
    return threads, outs


def test_wait_lets_running_streams_finish_on_the_old_weights_then_serves_the_new(served):
    _update(served, "a")  # (the fixture's own; a no-op when it already serves a)
    old_stream = reference_generate(served.paths["a"], PROMPTS[1:2], STREAM_TOKENS)[0]
    threads, outs = _running_streams(served, 2)
    outcome = _update(served, "b", mode="wait")
    for thread, out in zip(threads, outs):
        thread.join(30)
        assert not thread.is_alive() and len(out) == STREAM_TOKENS
        assert [e["token"]["id"] for e in out] == old_stream, "a running stream finished on the old weights"
        assert out[-1]["details"]["weights_version"] == "a"  # and says so
    assert_greedy_tokens(served, served.references["b"], TOKENS)
    r = served.client.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 2,
                                                                                    "details": True}})
    assert r.headers["x-weights-version"] == "b" and r.json()["details"]["weights_version"] == "b"
    r = served.client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-weights-version"] == "b", r.text
    assert r.json()["system_fingerprint"] == "b"  # OpenAI's backend fingerprint: the weights' version
    chunks = [json.loads(line[5:]) for line in served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 2, "stream": True}).text.splitlines()
        if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert chunks[0]["system_fingerprint"] is None and {c["system_fingerprint"] for c in chunks[1:]} == {"b"}
    checkpoint = sum(os.path.getsize(os.path.join(served.paths["b"], n))
                     for n in os.listdir(served.paths["b"]) if n.endswith(".safetensors"))
    assert all(0.4 * checkpoint < read < 0.6 * checkpoint for read in outcome["bytes_read_per_rank"]), outcome
    state = served.client.get("/admin/weights").json()
    assert state["version"] == "b" and state["source"] == served.paths["b"] and state["in_progress"] is None
    metrics = served.client.get("/metrics").text
    assert 'hsdp_weights_version{version="b"} 1.0' in metrics and 'hsdp_weight_updates_total{outcome="ok"}' in metrics


def test_abort_ends_running_streams_with_an_error_event(served):
    threads, outs = _running_streams(served, 1)
    _update(served, "a", mode="abort")
    threads[0].join(30)
    assert "error" in outs[0][-1] and "aborted" in outs[0][-1]["error"], outs[0][-1]
    assert len(outs[0]) < STREAM_TOKENS + 1
    assert_greedy_tokens(served, served.references["a"], TOKENS)


def test_keep_goes_on_with_the_running_streams(served):
    threads, outs = _running_streams(served, 1)
    _update(served, "b", mode="keep")
    threads[0].join(30)
    assert len(outs[0]) == STREAM_TOKENS and outs[0][-1]["details"]["finish_reason"] == "length"
    assert outs[0][-1]["details"]["weights_version"] == "b"  # its last tokens came from the new weights
    assert_greedy_tokens(served, served.references["b"], TOKENS)


def test_a_version_label_must_be_printable_ascii(served):
    r = served.client.post("/admin/weights", json={"source": served.paths["a"], "version": "v\u00e9\n"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "ASCII" in r.json()["error"], r.text


def test_a_wrong_checkpoint_is_refused_naming_it_and_the_old_weights_serve_on(served, tmp_path):
    _update(served, "a")
    other_shape = write_checkpoint(tmp_path / "gpt2", "gpt2")
    truncated = tmp_path / "truncated"
    shutil.copytree(served.paths["b"], truncated)
    shard = sorted(p for p in truncated.iterdir() if p.suffix == ".safetensors")[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    cases = [({"source": str(tmp_path / "missing")}, "no such directory"),
             ({"source": other_shape}, "another model than the one served"),
             ({"source": str(truncated)}, shard.name),
             ({"source": served.paths["b"], "mode": "later"}, "mode"),
             ({"source": "gs://bucket/x"}, "not implemented"),
             ({"source": served.paths["b"], "extra": 1}, "extra")]
    for body, words in cases:
        r = served.client.post("/admin/weights", json=body)
        assert r.status_code == 422 and words in r.json()["error"], (body, r.text)
    assert served.client.get("/admin/weights").json()["version"] == "a"
    assert_greedy_tokens(served, served.references["a"], TOKENS)


def test_a_hugging_face_repo_id_updates_from_the_hosts_hub_cache(served):
    """``source: org/name`` (and ``revision``): the repo's snapshot found in the host's Hub cache
    (offline here, as HF_HUB_OFFLINE=1 has it), every rank reading its rows of that commit; the
    version defaults to ``repo@commit``. A repo the cache lacks, a revision it lacks, and a
    revision beside a directory are 422s naming them, the old weights serving on."""
    _update(served, "a")
    commit = served.hub_commit
    for body, words in (({"source": "acme/absent"}, "not in the local Hub cache"),
                        ({"source": HUB_REPO, "revision": "f" * 40}, "acme/llama-b@" + "f" * 40),
                        ({"source": served.paths["b"], "revision": "main"}, "revision")):
        r = served.client.post("/admin/weights", json=body)
        assert r.status_code == 422 and words in r.json()["error"], (body, r.text)
    assert_greedy_tokens(served, served.references["a"], TOKENS)
    r = served.client.post("/admin/weights", json={"source": HUB_REPO, "revision": "main"})
    assert r.status_code == 200, r.text
    outcome = r.json()
    assert outcome["version"] == f"{HUB_REPO}@{commit[:12]}" and outcome["source"] == f"{HUB_REPO}@{commit}"
    size = sum(os.path.getsize(os.path.join(served.paths["b"], n)) for n in os.listdir(served.paths["b"])
               if n.endswith(".safetensors"))
    assert all(0 < n < 0.65 * size for n in outcome["bytes_read_per_rank"]), outcome
    assert served.client.get("/admin/weights").json()["source"] == f"{HUB_REPO}@{commit}"
    assert_greedy_tokens(served, served.references["b"], TOKENS)
    _update(served, "a")


def test_sglangs_route_updates_with_sglangs_request_body(served):
    _update(served, "a")
    r = served.client.post("/update_weights_from_disk", json={
        "model_path": served.paths["b"], "weight_version": "b-sglang", "abort_all_requests": False, "flush_cache": True})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert served.client.get("/get_model_info").json()["weight_version"] == "b-sglang"
    assert_greedy_tokens(served, served.references["b"], TOKENS)
    r = served.client.post("/update_weights_from_disk", json={"model_path": served.paths["b"] + "-missing"})
    assert r.status_code == 400 and r.json()["success"] is False and "no such directory" in r.json()["message"]
    r = served.client.post("/update_weights_from_disk", json={"model_path": served.paths["a"], "is_async": True})
    assert r.status_code == 400 and "is_async" in r.json()["message"]


def test_vllms_pause_keep_freezes_the_running_and_queues_the_new_until_resume(served):
    """``POST /pause?mode=keep&clear_cache=false``: a running stream stops where it is, a new request
    waits; ``/resume``: both go on, the stream's tokens those of an unpaused run."""
    import time

    _update(served, "a")
    want = reference_generate(served.paths["a"], PROMPTS[1:2], STREAM_TOKENS)[0]
    threads, outs = _running_streams(served, 1)
    r = served.client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert r.status_code == 200 and r.json() == {"status": "paused", "mode": "keep"}, r.text
    assert served.client.get("/is_paused").json() == {"is_paused": True}
    held = len(outs[0])
    answered = {}
    waiting = threading.Thread(target=lambda: answered.update(r=served.client.post("/generate", json={
        "inputs": PROMPTS[0], "parameters": {"max_new_tokens": 2}})), daemon=True)
    waiting.start()
    time.sleep(1.0)
    assert len(outs[0]) == held < STREAM_TOKENS and not answered, (held, answered)  # frozen; queued
    assert served.client.post("/resume").json() == {"status": "resumed"}
    threads[0].join(30)
    waiting.join(30)
    assert [e["token"]["id"] for e in outs[0]] == want
    assert answered["r"].status_code == 200
    assert served.client.get("/is_paused").json() == {"is_paused": False}


def test_vllms_pause_update_resume_recomputes_the_kept_on_the_new_weights(served):
    """An RL step as vLLM's clients run it: pause (keep, cache cleared), new weights, resume. The kept
    stream gave its blocks back; it is recomputed and finishes on the new weights."""
    _update(served, "a")
    threads, outs = _running_streams(served, 1)
    assert served.client.post("/pause", params={"mode": "keep"}).status_code == 200
    _update(served, "b", mode="wait")  # nothing runs: the update does not wait for the kept stream
    assert served.client.get("/is_paused").json() == {"is_paused": True}
    served.client.post("/resume")
    threads[0].join(30)
    assert len(outs[0]) == STREAM_TOKENS and outs[0][-1]["details"]["weights_version"] == "b", outs[0][-1]
    assert_greedy_tokens(served, served.references["b"], TOKENS)


def test_vllms_pause_resumed_before_it_took_answers_409_and_a_second_pause_changes_nothing(served):
    """A ``wait`` pause waits for the running stream; a resume before then answers the pause with
    409 (it never took) and the stream finishes. A pause while paused answers at once, as it was."""
    from tests.waiting import wait_until

    threads, outs = _running_streams(served, 1)
    answered = {}
    pausing = threading.Thread(target=lambda: answered.update(r=served.client.post(
        "/pause", params={"mode": "wait"})), daemon=True)
    pausing.start()
    wait_until(lambda: served.client.get("/is_paused").json()["is_paused"], 30, "the pause under way")
    assert served.client.post("/resume").status_code == 200
    pausing.join(30)
    assert answered["r"].status_code == 409 and "resumed" in answered["r"].json()["error"], answered["r"].text
    threads[0].join(30)
    assert len(outs[0]) == STREAM_TOKENS
    assert served.client.post("/pause", params={"mode": "keep"}).status_code == 200
    r = served.client.post("/pause", params={"mode": "abort"})  # already paused: nothing aborted, still keep
    assert r.status_code == 200 and served.client.get("/is_paused").json() == {"is_paused": True}
    served.client.post("/resume")
    assert_greedy_tokens(served, served.references["b"], TOKENS)


def test_vllms_pause_abort_ends_the_running_and_bad_modes_are_refused(served):
    threads, outs = _running_streams(served, 1)
    assert served.client.post("/pause").status_code == 200  # vLLM's default: abort
    threads[0].join(30)
    assert "error" in outs[0][-1] and "paused" in outs[0][-1]["error"], outs[0][-1]
    served.client.post("/resume")
    r = served.client.post("/pause", params={"mode": "later"})
    assert r.status_code == 422 and "mode" in r.json()["error"], r.text
    assert served.client.get("/is_paused").json() == {"is_paused": False}
    assert_greedy_tokens(served, served.references["b"], TOKENS)


def _train_and_push(rank, world_size, path, url, version):
    """A trainer rank: the model of ``path`` sharded by FSDP2 over the trainer's 3 ranks (its
    "trained" weights), pushed into the server."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from server.trainer import push

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return push(model, url, version=version)


def test_an_fsdp2_trainer_pushes_its_shards_into_the_server(served, tmp_path):
    _update(served, "a")
    outcomes = values(run_ranks(_train_and_push, 3, tmp_path, served.paths["b"], served.url, "trained", timeout=180))
    assert [o["version"] for o in outcomes] == ["trained"] * 3 and not outcomes[0].get("error"), outcomes[0]
    assert_greedy_tokens(served, served.references["b"], TOKENS)
    checkpoint = sum(os.path.getsize(os.path.join(served.paths["b"], n))
                     for n in os.listdir(served.paths["b"]) if n.endswith(".safetensors"))
    received = outcomes[0]["bytes_received_per_rank"]
    assert len(received) == 2 and all(0.4 * checkpoint < r < 0.6 * checkpoint for r in received), received
    sent = [o["bytes_sent_by_this_rank"] for o in outcomes]
    assert 0.9 * checkpoint < sum(sent) < 1.1 * checkpoint, sent  # each row once, none gathered
    assert served.client.get("/admin/weights").json()["version"] == "trained"


def _greedy(server) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = server.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": TOKENS,
                                                                                   "details": True}})
        assert r.status_code == 200, r.text
        out.append([t["id"] for t in r.json()["details"]["tokens"]])
    return out


def test_a_trainer_pushes_dense_rows_into_a_server_that_quantizes_on_load(served, tmp_path):
    """``--quantization int8``: the trainer sends each quantized linear's dense rows and every
    serving rank quantizes its own as they arrive (server.weights.trainer_manifest): the tokens
    equal those of an update from a directory of the same weights, quantized as at load; each
    serving rank receives its half of the dense rows and nothing else."""
    args = (*ARGS, "--quantization", "int8")
    with ServerProcess(served.paths["a"], extra_args=args, env=ENV, log_path=served.root / "int8.log") as server:
        before = _greedy(server)
        assert server.client.post("/admin/weights", json={"source": served.paths["b"]}).status_code == 200
        from_disk = _greedy(server)
        assert server.client.post("/admin/weights", json={"source": served.paths["a"]}).status_code == 200
        assert _greedy(server) == before != from_disk
        outcomes = values(run_ranks(_train_and_push, 3, tmp_path, served.paths["b"], server.url, "trained-int8",
                                    timeout=180))
        assert not outcomes[0].get("error"), outcomes[0]
        assert _greedy(server) == from_disk
        checkpoint = sum(os.path.getsize(os.path.join(served.paths["b"], n))
                         for n in os.listdir(served.paths["b"]) if n.endswith(".safetensors"))
        received = outcomes[0]["bytes_received_per_rank"]
        assert len(received) == 2 and all(0.4 * checkpoint < r < 0.6 * checkpoint for r in received), received


def test_separate_groups_roll_one_at_a_time_each_drained_while_it_updates(served, tmp_path):
    """``python -m server.roll`` over two groups (the module's 2-rank server and a 1-rank one),
    behind no balancer: each updates with ``drain``, so its /ready answers 503 while it updates
    (a running stream on the first keeps it updating for a second) and never both at once; both
    end on the new weights; a refused checkpoint stops the roll at the first group, exit 1."""
    import subprocess
    import sys

    from tests.server_process import REPO

    _update(served, "a")
    with ServerProcess(served.paths["a"], extra_args=("--kv-cache-memory", "8MiB"), env=ENV,
                       log_path=served.root / "second-group.log") as second:
        groups = [served, second]
        states: list[list[int]] = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                states.append([g.client.get("/ready").status_code for g in groups])

        threads, outs = _running_streams(served, 1)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        proc = subprocess.run([sys.executable, "-m", "server.roll", "--source", served.paths["b"], "--version", "b",
                               served.url, second.url], cwd=REPO, capture_output=True, text=True, timeout=300)
        stop.set()
        watcher.join(10)
        threads[0].join(30)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [r["status"] for r in records] == ["updated", "updated"], records
        assert all(codes != [503, 503] for codes in states), "both groups out at once"
        assert [503, 200] in states, "the first group's /ready never said it was updating"
        assert len(outs[0]) == STREAM_TOKENS  # mode wait: its stream finished on the old weights
        for group in groups:
            assert group.client.get("/admin/weights").json()["version"] == "b"
            assert group.client.get("/ready").status_code == 200
            assert_greedy_tokens(group, served.references["b"], TOKENS)
        other_shape = write_checkpoint(tmp_path / "gpt2", "gpt2")
        proc = subprocess.run([sys.executable, "-m", "server.roll", "--source", other_shape, served.url, second.url],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "roll stopped at" in proc.stderr, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(records) == 1 and records[0]["status"] == "refused" and records[0]["http_status"] == 422, records
        for group in groups:
            assert group.client.get("/admin/weights").json()["version"] == "b"
    _update(served, "a")


def test_two_replicas_roll_one_always_serving(served):
    """Replicas update one at a time (they share no weights): while replica 0 waits for its stream
    to finish on the old weights, replica 1 answers every new request; then it updates in turn."""
    from tests.waiting import wait_until

    args = ("--kv-cache-memory", "8MiB", "--replicate-size", "2", "--shard-size", "1")
    with ServerProcess(served.paths["a"], extra_args=args, env=ENV, log_path=served.root / "replicas.log") as server:
        threads, outs = _running_streams(server, 1)  # both idle: replica 0 takes it, slowly (rank 0's delay)
        result = {}
        updater = threading.Thread(target=lambda: result.update(r=server.client.post(
            "/admin/weights", json={"source": served.paths["b"], "version": "b"})), daemon=True)
        updater.start()
        wait_until(lambda: server.client.get("/admin/weights").json()["in_progress"] is not None, 30,
                   "the update under way")
        answered, seen = [], []
        while updater.is_alive() and len(answered) < 20:
            r = server.client.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 2}})
            answered.append(r.status_code)
            seen.append(server.client.get("/admin/weights").json()["replicas"])
        updater.join(60)
        threads[0].join(30)
        # answered while the update ran (all groups paused at once would have held them to its end)
        assert len(answered) >= 3 and set(answered) == {200}, answered
        assert result["r"].status_code == 200, result["r"].text
        assert len(outs[0]) == STREAM_TOKENS  # finished on the old weights, not cut
        for _ in range(2):  # both replicas, placed in turn
            assert_greedy_tokens(server, served.references["b"], TOKENS)
        # /admin/weights said each replica's version as it rolled: never both updating at once
        assert all(sum(r["updating"] for r in replicas) <= 1 for replicas in seen), seen
        assert any(r["updating"] for replicas in seen for r in replicas), seen
        final = server.client.get("/admin/weights").json()["replicas"]
        assert final == [{"replica": 0, "version": "b", "updating": False},
                         {"replica": 1, "version": "b", "updating": False}], final
