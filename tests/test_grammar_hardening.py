"""Grammars under load and at their limits: compiling stays off rank 0's event loop (``/health``
answers while ten requests' call grammars of 128 tools of 50 properties compile), a step's masks
come in one batch equal to llguidance's own mask of each row, and a matcher that reaches one of
llguidance's resource limits fails its request with an error naming the limit, never ``stop``."""

import concurrent.futures
import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.checkpoints import tokenizer, write_checkpoint
from tests.server_process import REPO, ServerProcess
from tests.waiting import wait_until

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "tag"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "tag": {"type": "string", "maxLength": 4}}}
# a template that takes ``tools`` (so the renderer hands them over) and shows none of them: the
# prompt stays short however many tools a request offers
TOOLS_UNSHOWN_TEMPLATE = ("{%- if tools %}{%- endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
                          "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _tools(request: int, count: int = 128, properties: int = 50) -> list[dict]:
    """``count`` tools of ``properties`` properties each, named apart per request (no two requests
    share a grammar: none is compiled once for all)."""
    kinds = ("string", "integer", "boolean", "number")
    return [{"type": "function", "function": {
        "name": f"r{request}_tool_{i}",
        "parameters": {"type": "object",
                       "properties": {f"p{j}": {"type": kinds[(i + j) % len(kinds)]} for j in range(properties)},
                       "required": [f"p{j}" for j in range(0, properties, 7)]}}}
        for i in range(count)]


# --- batched masks ------------------------------------------------------------------------------
def _reference_mask(matcher, vocab: int) -> torch.Tensor:
    """[vocab] bool from llguidance's own single-matcher ``compute_bitmask`` (bytes, one bit a token)."""
    raw = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    bits = ((raw[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().flatten()
    out = torch.zeros(vocab, dtype=torch.bool)
    n = min(vocab, bits.numel())
    out[:n] = bits[:n]
    return out


def test_the_batched_mask_equals_each_rows_own_mask():
    from server.api.openai.tools import FORMATS
    from server.engine.grammar import GrammarRows, Grammars, grammar_for
    from server.engine.sampling import BatchSampler, Row, SamplingParams

    tok = tokenizer()
    grammars = Grammars(tok)
    calls = FORMATS["hermes"].grammar([t["function"] for t in _tools(0, count=3, properties=4)], several=True)
    specs = [grammar_for("json_schema", SCHEMA), grammar_for("regex", "(cat|dog)s? [a-c]{2}"),
             grammar_for("choice", ["alpha", "beta", "gamma"]), calls, grammar_for("json_object", None),
             grammar_for("json_schema", SCHEMA)]
    batch_rows = [0, 2, 3, 5, 6, 8]  # constrained rows among a batch of 9, some free between them
    width = grammars.vocab_size + 13  # the model's logits: wider than the tokenizer (padded embedding)
    rng = random.Random(0)
    rows = GrammarRows(grammars)
    entries, references = [], []
    for n, (row, grammar) in enumerate(zip(batch_rows, specs)):
        # walk the grammar a few tokens (each allowed by llguidance's own mask), as a decoding row would
        walker, generated = grammars.matcher(grammar), []
        for _ in range(n % 4 + (n // 4) * 3):
            allowed = _reference_mask(walker, grammars.vocab_size)
            allowed[tok.eos_token_id] = False
            if not allowed.any():
                break
            token = rng.choice(allowed.nonzero().flatten().tolist())
            assert walker.consume_token(token)
            generated.append(token)
        references.append(torch.cat([_reference_mask(walker, grammars.vocab_size), torch.zeros(13, dtype=torch.bool)]))
        rows.start(100 + n, grammar, generated)  # rebuilt from the compiled form, fed in one call
        entries.append((row, 100 + n, grammar, generated))
    masks, failed = rows.masks(entries, width, torch.device("cpu"))
    assert failed == {}
    assert masks.rows_M.tolist() == batch_rows
    assert masks.allowed_MV.shape == (len(batch_rows), width)
    for j, reference in enumerate(references):
        assert reference.any()
        assert torch.equal(masks.allowed_MV[j], reference), j
    # applied in one operation: each constrained row's greedy token is the likeliest it allows
    logits = torch.randn(9, width, generator=torch.Generator().manual_seed(1))
    picks = BatchSampler().sample(logits.clone(), [Row(SamplingParams(max_new_tokens=1), [1], 0) for _ in range(9)],
                                  masks)
    for i in range(9):
        allowed = references[batch_rows.index(i)] if i in batch_rows else torch.ones(width, dtype=torch.bool)
        expected = int(logits[i].masked_fill(~allowed, float("-inf")).argmax())
        assert picks[i][0] == expected, i
        assert picks[i][1] == pytest.approx(float(torch.log_softmax(logits[i], -1)[expected]), abs=1e-5)
    # and one row alone (the sampler's fallback) gets the same mask
    alone = masks.row(batch_rows[2])
    assert alone.rows_M.tolist() == [0] and torch.equal(alone.allowed_MV[0], references[2])
    assert masks.row(1) is None


def test_masks_import_no_compiler():
    """A step's masks import nothing of torch.compile: llguidance.torch's decorator imported
    inductor (seconds holding the GIL) on rank 0's engine thread at the first grammar step, and
    ``/health`` waited for it. In a fresh interpreter, as a rank starts."""
    check = (
        "import sys, torch\n"
        "from tests.checkpoints import tokenizer\n"
        "from server.engine.grammar import GrammarRows, Grammars, grammar_for\n"
        "rows = GrammarRows(Grammars(tokenizer()))\n"
        "g = grammar_for('regex', '[0-9]+')\n"
        "rows.start(1, g, [])\n"
        "masks, failed = rows.masks([(0, 1, g, [])], 300, torch.device('cpu'))\n"
        "assert failed == {} and masks.allowed_MV.any(), failed\n"
        "found = sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo', 'llguidance.torch')))\n"
        "print(len(found), found[:3])\n")
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout


def test_a_matcher_in_an_error_state_is_an_error_not_a_stop():
    """Fed a token its grammar does not allow (llguidance's error state), the row says so."""
    from server.engine.grammar import GrammarRows, Grammars, grammar_for

    tok = tokenizer()
    rows = GrammarRows(Grammars(tok))
    grammar = grammar_for("regex", "[0-9]+")
    rows.start(1, grammar, [])
    rows.start(2, grammar, [])
    letter = tok("z", add_special_tokens=False).input_ids[0]
    digit = tok("7", add_special_tokens=False).input_ids[0]
    (done_1, error_1), (done_2, error_2) = rows.accept([(1, letter), (2, digit)])
    assert not done_1 and error_1 is not None and "doesn't satisfy the grammar" in error_1, error_1
    assert not done_2 and error_2 is None


# --- a real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("grammar") / "llama", "llama")


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("grammar-log") / "server.log"
    with ServerProcess(checkpoint, log_path=log, extra_args=("--chat-template", TOOLS_UNSHOWN_TEMPLATE)) as server:
        yield server


def test_health_answers_while_large_tool_grammars_compile(served):
    """10 concurrent ``tool_choice: required`` requests of 128 tools of 50 properties each (0.4 s
    of llguidance's compile apiece): a ``/health`` probe answers within 1 s throughout."""
    probe_s: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=served.url, timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                probe_s.append(time.monotonic() - t0)
                time.sleep(0.02)

    def ask(k: int) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "call a tool"}], "tools": _tools(k),
                "tool_choice": "required", "max_tokens": 40, "temperature": 0}
        with httpx.Client(base_url=served.url, timeout=120) as client:
            return client.post("/v1/chat/completions", json=body)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    wait_until(lambda: probe_s, 10, "a first /health probe")
    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(ask, range(10)))
    finally:
        done.set()
        prober.join(35)
    print(f"/health: {len(probe_s)} probes, max {max(probe_s):.3f} s")
    for k, r in enumerate(answers):
        assert r.status_code == 200, r.text
        # the call grammar holds: the answer opens a call of one of this request's own tools
        head = f'<tool_call>\n{{"name":"r{k}_tool_'
        text = r.json()["choices"][0]["message"]["content"] or ""
        assert r.json()["choices"][0]["message"]["tool_calls"] or text.startswith(head), (k, r.text)
    assert len(probe_s) > 5 and max(probe_s) < 1.0, max(probe_s)


@pytest.fixture(scope="module")
def limited(checkpoint, tmp_path_factory):
    """A server whose llguidance parser limits are set low (``max_lexer_states``): a matcher reaches
    one a few tokens into a schema's answer, after the request's grammar was checked and accepted."""
    log = tmp_path_factory.mktemp("grammar-limited") / "server.log"
    with ServerProcess(checkpoint, log_path=log, env={"HSDP_INJECT_GRAMMAR_LIMITS": "max_lexer_states=12"}) as server:
        yield server


def test_a_matcher_at_a_resource_limit_ends_with_an_error_naming_it(limited):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    chat = {"messages": [{"role": "user", "content": "answer in JSON"}], "max_tokens": 60, "response_format": fmt}
    r = limited.client.post("/v1/chat/completions", json={**chat, "temperature": 0})
    assert r.status_code >= 500, r.text  # before: 200, finish_reason stop, with output the schema may reject
    assert "too many states" in json.dumps(r.json()), r.text
    frames = []
    with limited.client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        frames = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "error" in frames[-1] and "too many states" in json.dumps(frames[-1]), frames[-1]
    assert all(c.get("finish_reason") != "stop" for f in frames for c in f.get("choices", [])), frames
    r = limited.client.post("/generate", json={"inputs": "x", "parameters": {
        "max_new_tokens": 60, "grammar": {"type": "json", "value": SCHEMA}}})
    assert r.status_code >= 500 and "too many states" in r.json()["error"], r.text
