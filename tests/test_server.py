"""The real server (2 CPU ranks) over HTTP: TGI-style generate and stream, probes, batching."""

import concurrent.futures
import json
import os
import threading

import httpx
import pytest
import torch

from tests.checkpoints import tokenizer, write_checkpoint
from tests.sampling_reference import sample_reference
from tests.server_process import ServerProcess

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a server that never hung and never lost a request",
    "hsdp",
    "0123456789",
    "every rank runs every forward in lockstep",
    "The lazy dog",
    "zero",
    "Rank zero answers HTTP requests; every rank runs every forward",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    path = write_checkpoint(root / "llama", "llama")
    # a slowed load (20 ms a tensor), so that /ready is seen reporting the ranks' progress
    server = ServerProcess(path, log_path=root / "server.log", env={"HSDP_INJECT_LOAD_DELAY": "0.02"})
    try:
        ready_trace = server.poll_ready()
        yield server, path, ready_trace
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference_model(served):
    """transformers' own unsharded model."""
    from transformers import AutoModelForCausalLM

    _, path, _ = served
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(reference_model):
    """transformers' own greedy generate on the unsharded model, stopping at EOS as the server does."""
    tok = tokenizer()

    def generate(prompt: str | list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids if isinstance(prompt, str) else torch.tensor([prompt])
        with torch.no_grad():
            out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           do_sample=False, pad_token_id=tok.pad_token_id, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    return generate


@pytest.fixture(scope="module")
def sampled_reference(reference_model):
    """The tokens a seeded sampled request of ``prompt`` must get (tests/sampling_reference.py)."""
    def sample(prompt, max_new_tokens: int, **settings) -> list[int]:
        ids = tokenizer()(prompt).input_ids if isinstance(prompt, str) else prompt
        return sample_reference(reference_model, ids, max_new_tokens, **settings)

    return sample


def _generate(client, prompt, **params):
    params.setdefault("details", True)
    r = client.post("/generate", json={"inputs": prompt, "parameters": params})
    assert r.status_code == 200, r.text
    return r.json()


def _ids(response):
    return [t["id"] for t in response["details"]["tokens"]]


def test_ready_moves_from_loading_to_ready(served):
    _, _, trace = served
    assert trace[-1][0] == 200 and trace[-1][1]["phase"] == "ready"
    not_ready = [body for status, body in trace if status == 503]
    assert not_ready and not_ready[0]["phase"] == "loading" and "progress" in not_ready[0]
    assert {body["phase"] for body in not_ready} <= {"loading", "warming_up"}
    # every rank's own progress, from the group's store: both move, and both reach the end
    ranks = [body["progress"]["ranks"] for body in not_ready if body["phase"] == "loading"]
    assert all([r["rank"] for r in seen] == [0, 1] for seen in ranks)
    for rank in (0, 1):
        fractions = [seen[rank]["fraction"] for seen in ranks]
        assert fractions == sorted(fractions) and len(set(fractions)) >= 3, fractions
        assert fractions[-1] == 1.0 or not_ready[-1]["phase"] == "warming_up"


def test_health_and_info(served):
    from transformers import AutoModelForCausalLM

    server, path, _ = served
    assert server.client.get("/health").json()["status"] == "ok"
    info = server.client.get("/info").json()
    assert info["model_id"] == os.path.basename(path) and info["model_path"] == path  # served by its name
    assert info["mesh_shape"] == {"replicate": 1, "shard": 2}
    assert info["max_total_tokens"] == 256 and info["max_input_tokens"] == 255
    assert info["model_dtype"] == "float32"
    # CPU ranks of one host (--resident-units auto): every unit resident in one shared copy for the
    # host (as large as the model, each rank's shards views of it), nothing private, nothing gathered
    residency = info["residency"]
    whole = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert whole <= residency.pop("shared_bytes") < whole + 64 * 64
    assert residency == {"units": 6, "of": 6, "names": ["", "model.embed_tokens", "model.layers.0",
                                                        "model.layers.1", "model.layers.2", "lm_head"],
                         "extra_bytes_per_rank": [0, 0], "shared_with": 2, "prefetch_depth": 2, "all_gather": "none"}
    # nothing gathered, no collective in a forward: each rank steps on its own (tests/test_replicas.py)
    assert [(r["replica"], r["step_group"]) for r in info["ranks"]] == [(0, 0), (0, 1)]
    for rank in info["ranks"]:
        memory = rank["memory"]
        assert memory["shared_weights"] >= whole and memory["shared_weights_share"] == memory["shared_weights"] // 2
        assert memory["shards"] < whole // 4  # the shards are views of the shared copy: only buffers are private


def test_greedy_matches_transformers(served, reference):
    server, _, _ = served
    for prompt in PROMPTS[:3]:
        out = _generate(server.client, prompt, max_new_tokens=16)
        expected = reference(prompt, 16)
        assert _ids(out) == expected
        assert out["generated_text"] == tokenizer().decode(expected, skip_special_tokens=True)
        assert out["details"]["generated_tokens"] == len(expected)
        assert out["details"]["finish_reason"] in ("length", "eos_token")


def test_repetition_penalty_matches_transformers(served, reference):
    server, _, _ = served
    out = _generate(server.client, PROMPTS[1], max_new_tokens=16, repetition_penalty=1.5)
    expected = reference(PROMPTS[1], 16, repetition_penalty=1.5)
    assert _ids(out) == expected
    assert expected != reference(PROMPTS[1], 16)  # the penalty changed something


def test_degenerate_sampling_is_greedy_and_serving_goes_on(served, reference):
    # temperature -> 0 overflows the scaled logits; its limit, greedy, is what comes back.
    server, _, _ = served
    out = _generate(server.client, PROMPTS[0], max_new_tokens=8, do_sample=True, temperature=1e-300, seed=1)
    assert _ids(out) == reference(PROMPTS[0], 8)
    assert server.client.get("/health").status_code == 200


def test_concurrent_requests_each_equal_transformers(served, reference):
    server, _, _ = served
    lengths = [16, 24, 8, 20, 12, 32, 4, 28]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_generate, server.client, p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
        together = [_ids(f.result(timeout=120)) for f in futures]
    for prompt, n, ids in zip(PROMPTS, lengths, together):
        assert ids == reference(prompt, n), prompt


def test_sequences_are_spread_over_ranks(served):
    """Six requests in flight together are placed on both ranks. Each is long enough (48 tokens)
    that none ends before the last is placed: with 12, CI once saw two end on rank 0 (whose steps
    skip the control wire) before the last arrivals, which then went there too ([5, 1])."""
    server, _, _ = served
    before = server.client.get("/info").json()["ranks"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: _generate(server.client, p, max_new_tokens=48), PROMPTS[:6]))
    after = server.client.get("/info").json()["ranks"]
    started = [a["sequences_started"] - b["sequences_started"] for a, b in zip(after, before)]
    computed = [a["tokens_computed"] - b["tokens_computed"] for a, b in zip(after, before)]
    assert sum(started) == 6 and all(n >= 2 for n in started), started
    assert all(n > 0 for n in computed), computed


def test_short_request_overtakes_a_long_one(served):
    server, _, _ = served
    finished = []
    first_token = threading.Event()

    def long_stream():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            with c.stream("POST", "/generate_stream",
                          json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 150}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        first_token.set()
        finished.append("long")

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_token.wait(60)
    _generate(server.client, PROMPTS[2], max_new_tokens=4)
    finished.append("short")
    thread.join(120)
    assert finished == ["short", "long"]


def test_sse_format(served, reference):
    server, _, _ = served
    with server.client.stream("POST", "/generate_stream",
                              json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    events = [json.loads(b.removeprefix("data:").strip()) for b in blocks]
    assert all(b.startswith("data:") for b in blocks)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["token"]["id"] for e in events] == reference(PROMPTS[0], 6)
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == tokenizer().decode(reference(PROMPTS[0], 6), skip_special_tokens=True)
    assert last["details"]["finish_reason"] in ("length", "eos_token")
    assert last["details"]["generated_tokens"] == len(events)


def test_seeded_sampling_equals_the_reference_draw(served, sampled_reference):
    server, _, _ = served
    warpers = {"temperature": 1.5, "top_k": 50, "top_p": 0.95}
    drawn = {seed: sampled_reference(PROMPTS[0], 12, seed=seed, **warpers) for seed in (1234, 99)}
    assert drawn[1234] != drawn[99]
    for seed, expected in drawn.items():
        out = _generate(server.client, PROMPTS[0], max_new_tokens=12, do_sample=True, seed=seed, **warpers)
        assert out["details"]["seed"] == seed and _ids(out) == expected, seed
    # unseeded: the server chooses a seed and reports it, and that seed replays the answer
    unseeded = _generate(server.client, PROMPTS[0], max_new_tokens=4, do_sample=True)
    assert _ids(unseeded) == sampled_reference(PROMPTS[0], 4, seed=unseeded["details"]["seed"])


def test_stop_sequence_and_return_full_text(served, reference):
    server, _, _ = served
    tok = tokenizer()
    full = tok.decode(reference(PROMPTS[2], 16), skip_special_tokens=True)
    stop = full[4:7]
    out = _generate(server.client, PROMPTS[2], max_new_tokens=16, stop=[stop], return_full_text=True)
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"].startswith(PROMPTS[2])
    # Generation ends with the token that completed the stop sequence.
    ids = _ids(out)
    assert stop in tok.decode(ids, skip_special_tokens=True)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)


INVALID = [
    ("not json", b"{inputs: nope", {"content-type": "application/json"}),
    ("wrong type", {"inputs": 5}, None),
    ("empty input", {"inputs": ""}, None),
    ("no inputs", {"parameters": {}}, None),
    ("zero new tokens", {"inputs": "a", "parameters": {"max_new_tokens": 0}}, None),
    ("negative temperature", {"inputs": "a", "parameters": {"temperature": -1}}, None),
    ("top_p too big", {"inputs": "a", "parameters": {"top_p": 1.5}}, None),
    ("top_k zero", {"inputs": "a", "parameters": {"top_k": 0}}, None),
    ("bad penalty", {"inputs": "a", "parameters": {"repetition_penalty": 0}}, None),
    ("unknown parameter", {"inputs": "a", "parameters": {"max_tokens": 3}}, None),
    ("over the limit", {"inputs": "a", "parameters": {"max_new_tokens": 100000}}, None),
    ("prompt too long", {"inputs": "hsdp " * 400, "parameters": {"max_new_tokens": 1}}, None),
    ("empty stop", {"inputs": "a", "parameters": {"stop": [""]}}, None),
    ("10000 stops", {"inputs": "a", "parameters": {"stop": ["x"] * 10000}}, None),
    ("invalid utf-8", b'{"inputs": "\xff\xfe\xfd"}', {"content-type": "application/json"}),
    ("NaN", b'{"inputs": "a", "parameters": {"temperature": NaN}}', {"content-type": "application/json"}),
    ("Infinity", b'{"inputs": "a", "parameters": {"top_p": Infinity}}', {"content-type": "application/json"}),
    ("huge number", {"inputs": "a", "parameters": {"max_new_tokens": 10**30}}, None),
    ("negative seed", {"inputs": "a", "parameters": {"seed": -1}}, None),
    ("negative tokens", {"inputs": "a", "parameters": {"max_new_tokens": -5}}, None),
    ("parameters not an object", {"inputs": "a", "parameters": []}, None),
    ("body not an object", [1, 2, 3], None),
    ("long prompt", {"inputs": "the server " * 40000}, None),
]


@pytest.mark.parametrize("endpoint", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("case,body,headers", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_requests_get_422_and_serving_goes_on(served, endpoint, case, body, headers):
    server, _, _ = served
    if isinstance(body, bytes):
        r = server.client.post(endpoint, content=body, headers=headers)
    else:
        r = server.client.post(endpoint, json=body)
    assert r.status_code == 422, (case, r.status_code, r.text)
    error = r.json()
    assert error["error_type"] == "validation" and error["error"], error
    assert _generate(server.client, "ok", max_new_tokens=2)["details"]["generated_tokens"] >= 1


# -- the rest of the request surface: TGI's official client, every TGI parameter, penalties,
# logit bias, stop token ids, tokenization --------------------------------------------------------

def test_tgi_official_client_works_unmodified(served, reference, sampled_reference):
    """text-generation 0.7 sends every TGI parameter, unset ones as null or false, to ``/``, and
    reads a list back; streaming too."""
    from text_generation import Client
    from text_generation.errors import ValidationError

    server, _, _ = served
    client = Client(server.url, timeout=60)
    prompt = PROMPTS[1]
    expected = reference(prompt, 12)
    response = client.generate(prompt, max_new_tokens=12)
    assert [t.id for t in response.details.tokens] == expected
    assert response.generated_text == tokenizer().decode(expected, skip_special_tokens=True)
    streamed = list(client.generate_stream(prompt, max_new_tokens=12))
    assert [r.token.id for r in streamed] == expected
    assert streamed[-1].generated_text == response.generated_text
    # top_n_tokens: the greedy choice leads each step's list
    response = client.generate(prompt, max_new_tokens=6, top_n_tokens=3)
    assert len(response.details.top_tokens) == len(response.details.tokens)
    for chosen, top in zip(response.details.tokens, response.details.top_tokens):
        assert len(top) == 3 and top[0].id == chosen.id and top[0].logprob >= top[1].logprob >= top[2].logprob
    # truncate keeps the input's last tokens
    ids = tokenizer()(prompt).input_ids
    truncated = client.generate(prompt, max_new_tokens=8, truncate=4)
    assert [t.id for t in truncated.details.tokens] == reference(tokenizer().decode(ids[-4:]), 8)
    # sampling with typical_p and a frequency penalty, seeded: the reference draw
    a = client.generate(prompt, max_new_tokens=8, do_sample=True, typical_p=0.8, frequency_penalty=0.5, seed=7)
    assert [t.id for t in a.details.tokens] == sampled_reference(prompt, 8, seed=7, typical_p=0.8,
                                                                 frequency_penalty=0.5)
    # best_of and decoder_input_details, read by the client's own types
    best = client.generate(prompt, max_new_tokens=4, do_sample=True, best_of=2, decoder_input_details=True)
    assert len(best.details.best_of_sequences) == 1 and [t.id for t in best.details.prefill] == ids
    assert best.details.prefill[0].logprob is None and all(t.logprob < 0 for t in best.details.prefill[1:])
    # what cannot be honoured is a 422 that says so
    with pytest.raises(ValidationError, match="watermark"):
        client.generate(prompt, max_new_tokens=4, watermark=True)


def test_tgi_parameters_null_means_unset(served, reference):
    server, _, _ = served
    nulls = {name: None for name in ("temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
                                     "frequency_penalty", "seed", "top_n_tokens", "truncate", "best_of", "grammar",
                                     "adapter_id", "stop", "return_full_text")}
    out = _generate(server.client, PROMPTS[0], max_new_tokens=8, details=True, watermark=False,
                    decoder_input_details=False, **nulls)
    assert _ids(out) == reference(PROMPTS[0], 8)
    for field, value, words in [("best_of", 2, "sampling"), ("grammar", {"type": "xml", "value": ""}, "grammar"),
                                ("adapter_id", "lora", "adapters"), ("best_of", 17, "best_of")]:
        r = server.client.post("/generate", json={"inputs": PROMPTS[0], "parameters": {field: value}})
        assert r.status_code == 422 and words in r.json()["error"], (field, r.text)


def test_openai_penalties_logit_bias_and_stop_token_ids(served, reference):
    server, _, _ = served
    prompt = PROMPTS[4]
    expected = reference(prompt, 8)

    def complete(**fields):
        r = server.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                        **fields})
        return r

    # a bias of +100 makes one token the greedy choice at every step
    favoured = 42
    r = complete(logit_bias={str(favoured): 100}, logprobs=0)
    assert r.status_code == 200, r.text
    assert tokenizer()(r.json()["choices"][0]["text"], add_special_tokens=False).input_ids[:1] == [favoured]
    # the first greedy token as a stop token id: one token, finish_reason stop
    r = complete(stop_token_ids=[expected[0]])
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 1
    # penalties are accepted in OpenAI's range (their formula is tested in tests/test_sampling.py)
    assert complete(presence_penalty=1.5, frequency_penalty=-0.5).status_code == 200
    for fields, param in [({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"logit_bias": {"999999": 5}}, "logit_bias"),
                          ({"logit_bias": {"x": 5}}, "logit_bias"), ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),
                          ({"stop_token_ids": [999999]}, "stop_token_ids")]:
        r = complete(**fields)
        assert r.status_code == 400 and param in json.dumps(r.json()), (fields, r.text)


def test_tokenize_and_detokenize_in_tgi_and_vllm_shapes(served):
    server, _, _ = served
    text = PROMPTS[1]
    ids = tokenizer()(text).input_ids
    spans = server.client.post("/tokenize", json={"inputs": text}).json()
    assert [s["id"] for s in spans] == ids
    assert "".join(s["text"] for s in spans) == text[spans[0]["start"]:spans[-1]["stop"]]
    assert all(text[s["start"]:s["stop"]] == s["text"] for s in spans)
    vllm = server.client.post("/tokenize", json={"prompt": text}).json()
    assert vllm["tokens"] == ids and vllm["count"] == len(ids) and vllm["max_model_len"] == 256
    chat = server.client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 1
    back = server.client.post("/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == text
    assert server.client.post("/tokenize", json={"inputs": text, "prompt": text}).status_code == 422
    assert server.client.post("/detokenize", json={"tokens": [10**9]}).status_code == 422


def test_output_constraints_that_cannot_be_served_get_400(served):
    """(Tool requests: tests/test_real_weights.py.)"""
    server, _, _ = served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, words in [({"tool_choice": "required"}, "tool_choice"),
                         ({"guided_regex": "a+", "guided_choice": ["x"]}, "at most one"),
                         ({"response_format": {"type": "xml"}}, "response_format")]:
        r = server.client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and words in json.dumps(r.json()), (extra, r.text)
    ok = server.client.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"},
                                                          "tool_choice": "none"})
    assert ok.status_code == 200, ok.text


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "tag"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "tag": {"type": "string", "maxLength": 4}}}


def test_structured_outputs_always_match(served):
    """A random-weight model, constrained: every answer parses and matches its schema or pattern,
    greedy and sampled, streamed or not, through both APIs."""
    import re

    import jsonschema

    server, _, _ = served
    chat = {"messages": [{"role": "user", "content": "answer in JSON"}], "max_tokens": 60}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "top_p": 0.9}):
        r = server.client.post("/v1/chat/completions", json={**chat, **sampling, "response_format": fmt, "n": 2})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            assert choice["finish_reason"] == "stop"
    r = server.client.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"},
                                                         "temperature": 1.0, "seed": 5, "max_tokens": 200})
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":  # any object may be long; complete, it parses
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    # streamed: the pieces concatenate to a valid answer
    text = ""
    with server.client.stream("POST", "/v1/chat/completions", json={**chat, "response_format": fmt,
                                                                    "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    jsonschema.validate(json.loads(text), SCHEMA)
    # vLLM's guided fields on completions
    out = server.client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 1.0,
                                                      "seed": 1, "guided_choice": ["alpha", "beta", "gamma"]}).json()
    assert out["choices"][0]["text"] in ("alpha", "beta", "gamma")
    out = server.client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 20,
                                                      "guided_regex": "[0-9]{3}-(yes|no)"}).json()
    assert re.fullmatch("[0-9]{3}-(yes|no)", out["choices"][0]["text"]), out
    # TGI's grammar parameter
    for grammar, check in [({"type": "json", "value": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
                           ({"type": "regex", "value": "(cat|dog)s? [a-c]{2}"},
                            lambda t: re.fullmatch("(cat|dog)s? [a-c]{2}", t) or pytest.fail(t))]:
        r = server.client.post("/generate", json={"inputs": PROMPTS[1], "parameters": {
            "max_new_tokens": 60, "grammar": grammar, "do_sample": True, "seed": 9}})
        assert r.status_code == 200, r.text
        check(r.json()["generated_text"])
    # what the grammar library cannot take is a 4xx naming the field
    bad = server.client.post("/v1/chat/completions", json={**chat, "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and "guided_regex" in json.dumps(bad.json()), bad.text
    bad = server.client.post("/generate", json={"inputs": "x", "parameters": {"grammar": {"type": "json",
                                                                                         "value": {"type": 7}}}})
    assert bad.status_code == 422 and "grammar" in bad.json()["error"], bad.text


def test_openai_sdk_parse_with_a_pydantic_model(served):
    """``client.chat.completions.parse(response_format=Model)`` unmodified: a parsed Model back."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]

    server, _, _ = served
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    completion = client.chat.completions.parse(model=client.models.list().data[0].id, max_tokens=60,
                                               messages=[{"role": "user", "content": "answer"}],
                                               response_format=Answer, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer), completion


def test_openai_n_prompt_lists_and_token_id_prompts(served, reference, sampled_reference):
    server, _, _ = served
    tok = tokenizer()
    first, second = PROMPTS[0], PROMPTS[5]

    def complete(**fields):
        r = server.client.post("/v1/completions", json={"max_tokens": 6, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    # two texts and one prompt of token ids, n = 2 each: choice i * n + j answers prompt i
    out = complete(prompt=[first, second], n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] == tok.decode(reference(first, 6), skip_special_tokens=True)
    assert texts[2] == texts[3] == tok.decode(reference(second, 6), skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(tok(first).input_ids) + len(tok(second).input_ids)
    by_ids = complete(prompt=tok(first).input_ids)
    assert by_ids["choices"][0]["text"] == texts[0]
    assert complete(prompt=[tok(first).input_ids, tok(second).input_ids])["choices"][1]["text"] == texts[2]
    # sampled and seeded: choice j samples with seed + j (the reference draw), so the choices differ
    sampled = complete(prompt=first, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c["text"] for c in sampled["choices"]] == [
        tok.decode(sampled_reference(first, 8, seed=11 + j), skip_special_tokens=True) for j in range(3)]
    assert len({c["text"] for c in sampled["choices"]}) > 1
    # streamed: every chunk names its choice; each choice's text is the non-streamed one
    pieces = {0: "", 1: ""}
    with server.client.stream("POST", "/v1/completions", json={"prompt": [first, second], "max_tokens": 6,
                                                               "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    pieces[c["index"]] += c["text"]
    assert pieces == {0: texts[0], 1: texts[2]}
    # chat, n = 2: both choices are the greedy answer to the templated prompt
    from server.api.openai.chat import FALLBACK_CHAT_TEMPLATE

    messages = [{"role": "user", "content": first}]
    chat = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                           "temperature": 0, "n": 2}).json()
    templated = tok.apply_chat_template(messages, chat_template=FALLBACK_CHAT_TEMPLATE, add_generation_prompt=True,
                                        tokenize=False)
    expected = tok.decode(reference(tok(templated, add_special_tokens=False).input_ids, 5), skip_special_tokens=True)
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in chat["choices"]] == [expected, expected]
    # token ids outside the vocabulary are a 400 naming the prompt
    r = server.client.post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and "prompt" in json.dumps(r.json())
