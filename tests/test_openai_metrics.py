"""OpenAI-compatible API, TGI compat route, metrics and access control, through real client libraries."""

import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import tokenizer, write_checkpoint
from tests.sampling_reference import sample_reference
from tests.server_process import ServerProcess

KEY = "test-key-123"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    path = write_checkpoint(root / "llama", "llama")
    with ServerProcess(path, extra_args=("--api-key", KEY, "--served-model-name", "m"),
                       log_path=root / "server.log") as server:
        server.client.headers["Authorization"] = f"Bearer {KEY}"
        yield server, path


@pytest.fixture(scope="module")
def reference_model(served):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(reference_model):
    tok = tokenizer()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           do_sample=False, pad_token_id=tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    return generate


def _text(ids):
    return tokenizer().decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def openai_client(served):
    import openai

    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def test_openai_completions(served, reference, openai_client):
    expected = _text(reference(tokenizer()(PROMPT).input_ids, 12))
    out = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(tokenizer()(PROMPT).input_ids) and out.usage.completion_tokens == 12
    assert len(out.choices[0].logprobs.token_logprobs) == 12
    assert all(len(top) == 2 for top in out.choices[0].logprobs.top_logprobs)
    streamed = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_openai_chat_completions(served, reference, reference_model, openai_client):
    from server.api.openai.chat import FALLBACK_CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt = tokenizer().apply_chat_template(messages, chat_template=FALLBACK_CHAT_TEMPLATE,
                                             add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer()(prompt, add_special_tokens=False).input_ids
    expected = _text(reference(prompt_ids, 10))
    out = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage.completion_tokens == 10
    chunks = list(openai_client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 10
    # seeded, at OpenAI's default temperature 1: the reference draw, which another seed changes
    seeded = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=8, seed=7)
    drawn = [_text(sample_reference(reference_model, prompt_ids, 8, seed=seed)) for seed in (7, 8)]
    assert seeded.choices[0].message.content == drawn[0] != drawn[1]


def test_stream_ends_with_done_and_models_listed(served, openai_client):
    server, path = served
    with server.client.stream("POST", "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert [m.id for m in openai_client.models.list().data] == ["m"]  # --served-model-name


def test_the_model_must_be_a_served_name(served, openai_client):
    import openai

    server, _ = served
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = server.client.post("/v1/chat/completions", json={"model": "llama", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    for body in ({"prompt": PROMPT, "max_tokens": 2}, {"model": "m", "prompt": PROMPT, "max_tokens": 2}):
        assert server.client.post("/v1/completions", json=body).status_code == 200  # absent, or served
    r = server.client.post("/generate", json={"inputs": PROMPT, "model": "anything", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200  # TGI routes ignore the field, as TGI does


def test_openai_stop_sequence_is_not_returned(served, reference, openai_client):
    full = _text(reference(tokenizer()(PROMPT).input_ids, 16))
    stop = full[5:8]
    out = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_openai_errors_use_the_envelope(served):
    server, _ = served
    for body in ({"prompt": PROMPT, "n": 65}, {"prompt": PROMPT, "temperature": 5},
                 {"prompt": ""}, {"messages": []}, {"prompt": PROMPT, "max_tokens": 10**6}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = server.client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert set(error) == {"message", "type", "param", "code"}


def test_huggingface_inference_client(served, reference):
    from huggingface_hub import InferenceClient

    server, _ = served
    client = InferenceClient(model=server.url, token=KEY, timeout=60)
    expected = reference(tokenizer()(PROMPT).input_ids, 12)
    out = client.text_generation(PROMPT, max_new_tokens=12, details=True)
    assert [t.id for t in out.details.tokens] == expected
    assert out.generated_text == _text(expected)
    streamed = list(client.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert [s.token.id for s in streamed] == expected
    assert streamed[-1].generated_text == _text(expected)


def _samples(server) -> dict:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_move_by_the_right_amounts(served):
    server, _ = served
    before = _samples(server)
    prompt_tokens = len(tokenizer()(PROMPT).input_ids)
    for _ in range(3):
        r = server.client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 200
    assert server.client.post("/generate", json={"inputs": ""}).status_code == 422
    after = _samples(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("hsdp_requests_total", endpoint="/generate", status="200") == 3
    assert delta("hsdp_requests_total", endpoint="/generate", status="422") == 1
    assert delta("hsdp_generated_tokens_total") == 15
    assert delta("hsdp_prompt_tokens_total") == 3 * prompt_tokens
    assert delta("hsdp_time_to_first_token_seconds_count") == 3
    assert delta("hsdp_inter_token_latency_seconds_count") == 12
    assert delta("hsdp_queue_time_seconds_count") == 3
    assert delta("hsdp_request_duration_seconds_count", endpoint="/generate") == 4
    assert after[("hsdp_running_sequences", ())] == 0
    loaded = [after[("hsdp_loaded_bytes", (("rank", str(r)),))] for r in (0, 1)]
    assert all(b > 0 for b in loaded) and after[("hsdp_load_seconds", ())] > 0


def test_timing_headers(served):
    server, _ = served
    start = time.monotonic()
    r = server.client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}})
    client_ms = (time.monotonic() - start) * 1000
    assert r.status_code == 200, r.text
    ms = {h: int(r.headers[f"x-{h}-time"]) for h in ("validation", "queue", "inference", "total")}
    # the server's times (rounded to milliseconds) nest inside what the client waited
    assert ms["queue"] + ms["inference"] + ms["validation"] <= ms["total"] + 2, ms
    assert 0 < ms["inference"] <= ms["total"] <= client_ms + 1, (ms, client_ms)
    tokens = len(r.json()["details"]["tokens"])
    assert int(r.headers["x-generated-tokens"]) == tokens == 4
    assert abs(int(r.headers["x-time-per-token"]) * tokens - ms["inference"]) <= tokens, r.headers
    assert int(r.headers["x-prompt-tokens"]) == len(tokenizer()(PROMPT).input_ids)


def test_api_key_is_required_except_on_probes(served):
    server, _ = served
    bare = httpx.Client(base_url=server.url, timeout=10)
    for path in ("/health", "/ready"):
        assert bare.get(path).status_code == 200
    assert bare.get("/metrics").status_code == 401  # its counters tell tenants apart: keyed (--open-metrics opens it)
    r = bare.post("/generate", json={"inputs": PROMPT})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    assert bare.get("/info").status_code == 401
    r = bare.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_oversized_body_gets_413(served):
    server, _ = served
    big = {"inputs": "x" * (1024 * 1024 + 10)}
    r = server.client.post("/generate", json=big)
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"
    r = server.client.post("/v1/completions", json={"prompt": "y" * (1024 * 1024 + 10)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.json()["error"]["param"] == "--max-body-bytes"  # the option to raise (an image's data: URL, say)
    assert server.client.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 2}}).status_code == 200


def _prompt_logprobs(path, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    return lp[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()


def test_echo_with_logprobs_scores_the_prompt_as_harnesses_ask(served, openai_client):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, one new token."""
    server, path = served
    ids = tokenizer()(PROMPT + " jumps over the lazy dog").input_ids
    expected = _prompt_logprobs(path, ids)
    out = openai_client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert out.choices[0].text.startswith(tokenizer().decode(ids))
    streamed = list(openai_client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                                     logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert streamed[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_tgi_decoder_input_details_and_best_of(served, reference_model):
    server, path = served
    ids = tokenizer()(PROMPT).input_ids
    r = server.client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    prefill = r.json()["details"]["prefill"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(_prompt_logprobs(path, ids), abs=1e-4)
    best = server.client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "details": True, "best_of": 3, "do_sample": True, "seed": 4}})
    assert best.status_code == 200, best.text
    details = best.json()["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2 and {details["seed"], *(o["seed"] for o in others)} == {4, 5, 6}
    likeliest = sum(t["logprob"] for t in details["tokens"])
    assert all(likeliest >= sum(t["logprob"] for t in o["tokens"]) for o in others)
    # seeded: the sequence of seed s is the reference draw for s
    for sequence in (details, *others):
        drawn = sample_reference(reference_model, ids, 6, seed=sequence["seed"])
        assert [t["id"] for t in sequence["tokens"]] == drawn, sequence["seed"]
    for parameters, path_, param in [({"best_of": 2}, "/generate", "best_of"),  # greedy
                                     ({"best_of": 2, "do_sample": True}, "/generate_stream", "best_of"),
                                     ({"decoder_input_details": True}, "/generate_stream", "decoder_input_details")]:
        r = server.client.post(path_, json={"inputs": PROMPT, "parameters": parameters})
        assert r.status_code == 422 and param in r.json()["error"], (parameters, r.text)


def test_the_group_listens_on_loopback_only(served):
    """The launcher's rendezvous stores, the ranks' gloo sockets and HTTP (the default --host): all
    on 127.0.0.1. (Given a host name, a TCPStore listens on every interface, unauthenticated.)"""
    from tests.server_process import listening_addresses, session_pids

    server, _ = served
    addresses = listening_addresses(session_pids(server.proc.pid))
    assert (("127.0.0.1", server.port)) in addresses and len(addresses) >= 4, addresses
    assert {address for address, _ in addresses} == {"127.0.0.1"}, addresses
