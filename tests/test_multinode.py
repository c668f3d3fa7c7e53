"""Two nodes, on one host: two torchrun agents (``--nnodes 2``, one rank each, static rendezvous on
127.0.0.1) form one group whose weights are sharded across the nodes (``--shard-size 2``); node 0
serves HTTP. Losing node 1 (its agent and worker SIGKILLed together, as when a machine dies, or
its agent alone) ends the in-flight request with an error and takes node 0 down, non-zero."""

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.checkpoints import tokenizer, write_checkpoint
from tests.server_process import REPO, free_port, rank_pids

PROMPTS = ["The two nodes", "Sharded across machines, the model"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("nodes") / "llama", "llama")


class TwoNodes:
    def __init__(self, model_dir, log_dir):
        self.http = free_port()
        master = free_port()
        self.logs = [open(log_dir / f"node{n}.log", "w") for n in (0, 1)]
        self.agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
                 "-m", "server", "--model", str(model_dir), "--device", "cpu", "--port", str(self.http),
                 "--shard-size", "2"],
                cwd=REPO, stdout=self.logs[n], stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
                         HSDP_GROUP_SECRET="two-nodes-one-secret"),  # each rank proves it before the group starts
            )
            for n in (0, 1)
        ]
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.http}", timeout=60)

    def log(self, n: int) -> str:
        self.logs[n].flush()
        return open(self.logs[n].name).read()[-4000:]

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n, agent in enumerate(self.agents):
                assert agent.poll() is None, f"node {n} exited {agent.returncode}: {self.log(n)}"
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/ready").status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(self.log(0))

    def close(self) -> None:
        workers = []
        with contextlib.suppress(Exception):
            workers = list(rank_pids(self.client).values())
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
        for pid in workers:  # torchrun's workers live in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.wait(10)
        for log in self.logs:
            log.close()
        self.client.close()


def _reference(model_dir, prompt: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer()(prompt).input_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _stream(client, out: dict) -> threading.Thread:
    """A long streamed request on a thread; ``out`` collects its events."""
    def run():
        with client.stream("POST", "/generate_stream", json={
                "inputs": "in flight", "parameters": {"max_new_tokens": 200, "stop": []}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out.setdefault("events", []).append(json.loads(line[5:]))
                    out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not out.get("events") and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_nodes_serve_exactly_and_a_lost_node_takes_the_group_down(model_dir, tmp_path):
    nodes = TwoNodes(model_dir, tmp_path)
    try:
        nodes.wait_ready()
        info = nodes.client.get("/info").json()
        assert info["world_size"] == 2 and info["mesh_shape"] == {"replicate": 1, "shard": 2}
        # sharded across nodes: nothing shared through one host's memory, the gathers go over gloo
        assert "spans 2 nodes" in nodes.log(0)
        def generate(prompt: str, n: int) -> list[int]:
            r = nodes.client.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": n, "details": True}})
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        for prompt in PROMPTS:
            assert generate(prompt, 12) == _reference(model_dir, prompt, 12), prompt
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # both at once, batched
            together = [pool.submit(generate, p, 8) for p in PROMPTS]
            for prompt, future in zip(PROMPTS, together):
                assert future.result(timeout=60) == _reference(model_dir, prompt, 8), prompt
        ranks = {r["rank"]: r for r in nodes.client.get("/info").json()["ranks"]}
        assert all(ranks[r]["tokens_computed"] > 0 and ranks[r]["forwards"] > 0 for r in (0, 1)), ranks
        # a forward gathers across the nodes: the shard group steps as one
        assert [ranks[r]["step_group"] for r in (0, 1)] == [0, 0], ranks
        # node 1 dies, agent and worker together, while a request streams
        worker1 = ranks[1]["pid"]
        out: dict = {}
        stream = _stream(nodes.client, out)
        killed_at = time.monotonic()
        os.killpg(nodes.agents[1].pid, signal.SIGKILL)
        os.kill(worker1, signal.SIGKILL)
        stream.join(30)
        assert not stream.is_alive() and "error" in out["events"][-1], out.get("events", [])[-3:]
        assert out["at"] - killed_at < 15, out["at"] - killed_at
        assert nodes.agents[0].wait(60) != 0, nodes.log(0)
    finally:
        nodes.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_worker_whose_agent_died_exits(model_dir, tmp_path):
    nodes = TwoNodes(model_dir, tmp_path)
    try:
        nodes.wait_ready()
        worker1 = rank_pids(nodes.client)[1]
        out: dict = {}
        stream = _stream(nodes.client, out)
        os.killpg(nodes.agents[1].pid, signal.SIGKILL)  # the agent alone: its worker is in another session
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{worker1}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker1}"), "the orphaned worker went on"
        assert "torchrun agent" in nodes.log(1) and "is gone" in nodes.log(1)
        stream.join(30)
        assert "error" in out["events"][-1]
        assert nodes.agents[0].wait(60) != 0
    finally:
        nodes.close()
