"""Tool-call formats without a server: the whole-text and streaming parsers read alike, the
grammar of required/named calls takes exactly the calls it should, and chat rendering writes
tools into templates that take none and hands them to templates that do."""

import json
import random

import pytest

from server.api.openai.chat import ChatRenderer, ChatTemplateError, read_chat_template
from server.api.openai.protocol import ChatCompletionRequest
from server.api.openai.tools import FORMATS, StreamingToolParser
from tests.checkpoints import tokenizer

HERMES = FORMATS["hermes"]
DECLARED = {"get_weather", "add"}
TEXTS = {
    "content then a call": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                           '"n": {"a": 1}}}\n</tool_call>',
    "two calls": '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n<tool_call>\n'
                 '{"name":"get_weather","arguments":{"city":"x}"}}\n</tool_call>\n',
    "no call, a partial tag": "no calls here <tool",
    "arguments first": '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> and after',
    "undeclared function": '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "arguments as a string": '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "content around": '  lead\n\n<tool_call>{"name": "add", "arguments": {"a": [1, 2]}} </tool_call>\n\nMore\n',
    "broken json": '<tool_call>{"name": add}</tool_call>',
    "a bad escape in the name": '<tool_call>\n{"name": "f\\q", "arguments": {"x": 1}}\n</tool_call>',
    "a key after the arguments": '<tool_call>\n{"name": "add", "arguments": {"x": 1}, "id": "z"}\n</tool_call>',
}
EXPECTED = {
    "content then a call": ("Sure.", [("get_weather", '{"city": "Paris", "n": {"a": 1}}')]),
    "two calls": (None, [("add", '{"a":1,"b":2}'), ("get_weather", '{"city":"x}"}')]),
    "no call, a partial tag": ("no calls here <tool", []),
    "arguments first": (" and after", [("add", '{"a": 1}')]),
    "undeclared function": ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    "arguments as a string": (None, [("add", '{"a": 1}')]),
    "content around": ("  lead\n\nMore", [("add", '{"a": [1, 2]}')]),
    "broken json": ('<tool_call>{"name": add}</tool_call>', []),
    "a bad escape in the name": ('<tool_call>\n{"name": "f\\q", "arguments": {"x": 1}}\n</tool_call>', []),
    "a key after the arguments": (None, [("add", '{"x": 1}')]),
}


def _streamed(text: str, rng: random.Random):
    parser, deltas, i = StreamingToolParser(HERMES, DECLARED), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        deltas += parser.feed(text[i:i + n])
        i += n
    deltas += parser.feed("", final=True)
    content = "".join(d.content for d in deltas if d.content) or None
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index is not None:
            call = calls.setdefault(d.index, [None, ""])
            if d.id is not None:
                assert call[0] is None, "id and name come once"
                call[0] = d.name
            call[1] += d.arguments or ""
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("name", TEXTS)
def test_whole_and_streamed_text_read_alike(name):
    content, calls = HERMES.parse(TEXTS[name], DECLARED)
    assert (content, [(c.name, c.arguments) for c in calls]) == EXPECTED[name]
    rng = random.Random(name)
    for _ in range(40):  # the same text cut anywhere
        assert _streamed(TEXTS[name], rng) == EXPECTED[name]


def _accepts(grammar: str, text: str) -> bool:
    from server.engine.grammar import grammars_of

    matcher = grammars_of(tokenizer()).matcher(grammar)
    for token in tokenizer()(text, add_special_tokens=False).input_ids:
        if not matcher.consume_token(token):
            return False
    return not matcher.is_error() and matcher.is_accepting()


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"], "additionalProperties": False}},
    {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"], "additionalProperties": False}},
]


def test_the_call_grammar_takes_declared_calls_with_valid_arguments_only():
    one = HERMES.grammar(FUNCTIONS, several=False)
    several = HERMES.grammar(FUNCTIONS, several=True)
    call = '<tool_call>\n{"name":"add","arguments":{"a":3}}\n</tool_call>'
    weather = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert _accepts(one, call) and _accepts(one, weather)
    assert _accepts(several, call + "\n" + weather) and not _accepts(one, call + "\n" + weather)
    for bad in ('<tool_call>\n{"name":"nope","arguments":{"a":3}}\n</tool_call>',  # undeclared
                '<tool_call>\n{"name":"add","arguments":{"a":"3"}}\n</tool_call>',  # wrong type
                '<tool_call>\n{"name":"add","arguments":{}}\n</tool_call>',  # missing required
                'Sure. ' + call):  # text first
        assert not _accepts(several, bad), bad
    parsed = HERMES.parse(call, {"add"})[1]
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("add", {"a": 3})]


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
        "tools": [{"type": "function", "function": FUNCTIONS[0]}], **extra})


def test_a_template_without_tools_gets_them_written_in():
    renderer = ChatRenderer(tokenizer())  # the fallback template: no tools
    assert not renderer.native_tools
    text = tokenizer().decode(renderer.prompt_ids(_request()))
    system, rest = text.split("<|user|>", 1)
    assert system.startswith("<|system|>") and "<tools>" in system and '"name": "get_weather"' in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rest
    assert "<tool_response>\nrain\n</tool_response>" in rest and "<|tool|>" not in rest
    none = tokenizer().decode(renderer.prompt_ids(_request(tool_choice="none")))
    assert "<tools>" not in none and "<tool_call>" in none  # the history stays, the offer goes


def test_a_template_with_tools_gets_them_and_arguments_as_objects(tmp_path):
    template = ("{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
                "{{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    renderer = ChatRenderer(tokenizer(), read_chat_template(str(path)))
    assert renderer.native_tools
    text = tokenizer().decode(renderer.prompt_ids(_request()))
    assert text.startswith("TOOLS=[") and "CALL get_weather Oslo" in text and "tool:rain" in text
    assert read_chat_template(template) == template  # inline
    with pytest.raises(ChatTemplateError, match="not a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_streamed_call_that_breaks_is_not_counted_as_a_call():
    """Announced (its head streamed), then its JSON breaks: its text follows as content and the
    parser does not count it, so finish_reason is not tool_calls, as for the whole answer."""
    text = '<tool_call>\n{"name": "add", "arguments": {"x": 1}}}\n</tool_call>'
    assert HERMES.parse(text, DECLARED) == (text, [])
    parser = StreamingToolParser(HERMES, DECLARED)
    deltas = [d for i in range(0, len(text), 3) for d in parser.feed(text[i:i + 3])] + parser.feed("", final=True)
    assert parser.calls == [] and parser.broken == 1
    assert "".join(d.content for d in deltas if d.content) == text
