"""The real server under a KV cache far smaller than its load: requests wait, sequences are
preempted and recomputed, prompts are chunked, and every answer is still exactly transformers'."""

import concurrent.futures

import pytest
import torch

from tests.checkpoints import tokenizer, write_checkpoint
from tests.server_process import ServerProcess

# the test Llama: 3 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes = 768 bytes per token;
# 8 blocks of 16 tokens per rank: 128 tokens, room for one or two of these sequences at a time
KV = str(8 * 16 * 768)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    path = write_checkpoint(root / "llama", "llama")
    with ServerProcess(path, extra_args=("--kv-cache-memory", KV, "--max-batch-prefill-tokens", "8"),
                       log_path=root / "server.log") as server:
        yield server, path


@pytest.mark.timeout(300)
def test_every_request_is_answered_exactly_under_pressure(served):
    from transformers import AutoModelForCausalLM

    server, path = served
    tok = tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (20, 35, 12, 40, 28, 17, 33, 25)]
    texts = [tok.decode(p) for p in prompts]
    prompt_ids = [tok(t).input_ids for t in texts]

    def ask(i: int) -> dict:
        r = server.client.post("/generate", json={"inputs": texts[i], "parameters": {
            "max_new_tokens": 40, "details": True}})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    for ids, answer in zip(prompt_ids, answers):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False,
                                 pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        assert [t["id"] for t in answer["details"]["tokens"]] == expected
    info = server.client.get("/info").json()
    assert all(r["kv_blocks"]["total"] == 8 for r in info["ranks"])
    assert info["kv_cache"]["max_batch_prefill_tokens"] == 8


def test_a_request_that_can_never_fit_is_refused_at_once(served):
    server, _ = served
    long_prompt = " ".join(["fox"] * 30)  # ~90 tokens: + 100 new fits the model (256), not the cache (128)
    r = server.client.post("/generate", json={"inputs": long_prompt, "parameters": {"max_new_tokens": 100}})
    assert r.status_code == 422 and "KV cache" in r.json()["error"]
    r = server.client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens"
    assert server.client.get("/health").status_code == 200
