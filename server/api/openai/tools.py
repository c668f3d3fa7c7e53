"""Tool-call formats: how tools are shown to a model, how its calls are forced, how they are read.

A :class:`ToolCallFormat` is one model family's convention, named as ``--tool-call-parser`` names
it. It gives

- the system-prompt text that lists the tools, for chat templates that take no ``tools`` (the
  default SmolLM2's), and the text form of an assistant's calls and of a tool's answer there;
- the llguidance grammar of "one call, or several" over the declared functions, each call's
  arguments held to that function's JSON schema (``tool_choice`` ``required`` or a named function);
- a parser of the model's finished text into content and calls (:meth:`ToolCallFormat.parse`),
  and a streaming one that turns text deltas into OpenAI's content and tool-call deltas
  (:class:`StreamingToolParser`). Both read the same text the same way: the streamed deltas of a
  call concatenate to the arguments the whole response would carry.

Served: ``hermes``, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of
Hermes, Qwen 2.5/3 and the models tuned on their data. A call naming a function the request did not
declare, or whose JSON does not parse, stays text, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from server.config import TOOL_CALL_PARSERS

from server.api.detokenize import held_back


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI carries it
    id: str = field(default_factory=new_call_id)


class ToolCallFormat:
    """One tool-call convention (``hermes``'s; a subclass would override the texts and tags)."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    # --- the prompt, for templates that take no tools -----------------------------------------
    def system_text(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{self.open_tag}{self.close_tag} XML tags:\n"
            f'{self.open_tag}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{self.close_tag}'
        )

    def call_text(self, name: str, arguments) -> str:
        """An assistant's call as the model would have written it (``arguments``: dict or JSON text)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # kept as the client sent it
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def response_text(self, content: str) -> str:
        """A tool's answer, as a user turn of a template that knows no ``tool`` role."""
        return f"<tool_response>\n{content}\n</tool_response>"

    # --- forcing calls --------------------------------------------------------------------------
    def grammar(self, functions: list[dict], *, several: bool) -> str:
        """llguidance's grammar for calls only: one (or, ``several``, one or more, a newline apart),
        each ``{"name": one of functions, "arguments": matching its parameters}``, compact."""
        from llguidance import grammar_from

        options = []
        for fn in functions:
            params = fn.get("parameters") or {"type": "object"}
            options.append({
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        schema = {"anyOf": options, "x-guidance": {"whitespace_flexible": False}}
        repeat = ' ("\\n" call)*' if several else ""
        lark = (f"start: call{repeat}\n"
                f"call: {json.dumps(self.open_tag + chr(10))} body {json.dumps(chr(10) + self.close_tag)}\n"
                f"body: %json {json.dumps(schema)}\n")
        return grammar_from("lark", lark)

    # --- reading calls --------------------------------------------------------------------------
    def read_call(self, body: str, declared: set[str]) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of one call's body, or None where it is not a call of a
        declared function. The arguments are the body's own text where it lies ``{"name": ...,
        "arguments": {...}}`` in that order (what streaming sends), else re-serialized."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in declared:
            return None
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            return call["name"], args
        head = _NAME_FIRST.match(body)
        if head is not None:
            raw = _value_text(body[head.end():].lstrip())
            if raw is not None and _loads(raw) == args:
                return call["name"], raw
        return call["name"], json.dumps(args, ensure_ascii=False)

    def parse(self, text: str, declared: set[str]) -> tuple[str | None, list[ToolCall]]:
        """The finished text's content (text outside the calls, None when empty) and its calls.
        Where there are calls, the whitespace that ends a piece of content before a call, or the
        text, is dropped. A call left open at the end (the model stopped inside it) is read to the end."""
        calls, content, pos = [], [], 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                content.append(text[pos:])
                break
            end = text.find(self.close_tag, start)
            stop = len(text) if end < 0 else end + len(self.close_tag)
            read = self.read_call(text[start + len(self.open_tag):len(text) if end < 0 else end], declared)
            if read is None:  # not a call: text, as written
                content.append(text[pos:stop])
            else:
                content.append(text[pos:start].rstrip())
                calls.append(ToolCall(*read))
            pos = stop
            if end < 0:
                break
        if calls:
            content[-1] = content[-1].rstrip()
        return ("".join(content) or None), calls


# {"name": "f", "arguments": : the head of a call whose arguments can be streamed as they come
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
MAX_HEAD_CHARS = 1024
"""A call whose head (``{"name": ..., "arguments": ``) has not appeared within this many characters
is not streamed: it is sent whole when it closes. Bounds the work of looking for the head."""


def _outer_end(text: str) -> int:
    """Where the trailing ``\\s*}?\\s*`` of ``text`` begins (what may still be the call's closing
    brace and the space around it): linear, where the regex is cubic in a run of whitespace."""
    end = len(text.rstrip())
    if end and text[end - 1] == "}":
        end = len(text[:end - 1].rstrip())
    return end


class _ObjectEnd:
    """Finds where the JSON object a text starts with ends, reading each character once as the
    text grows (``json.raw_decode`` of the whole text on every token is quadratic in it)."""

    _OUTSIDE = re.compile(r'[{}"]')
    _INSIDE = re.compile(r'["\\]')

    def __init__(self):
        self.pos = 0  # characters read
        self.depth = 0
        self.in_string = False
        self.end: int | None = None  # just past the object's closing brace, once seen

    def feed(self, text: str) -> int | None:
        """``text``: the whole text so far (it only grows). Where its object ends, or None."""
        while self.end is None:
            if self.in_string:
                m = self._INSIDE.search(text, self.pos)
                if m is None:
                    self.pos = len(text)
                    break
                if m.group() == "\\":
                    if m.end() >= len(text):  # the escaped character has not arrived
                        self.pos = m.start()
                        break
                    self.pos = m.end() + 1
                    continue
                self.in_string, self.pos = False, m.end()
                continue
            m = self._OUTSIDE.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                break
            self.pos = m.end()
            if m.group() == '"':
                self.in_string = True
            elif m.group() == "{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.end = self.pos
        return self.end


def _value_text(text: str) -> str | None:
    """The text of the complete JSON object ``text`` starts with, or None while it is incomplete."""
    if not text.startswith("{"):
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return text[:end]


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (ToolCallFormat(),)}
if tuple(FORMATS) != TOOL_CALL_PARSERS:  # the option's choices are declared in server.config
    raise ImportError(f"tool-call formats {tuple(FORMATS)} differ from server.config.TOOL_CALL_PARSERS {TOOL_CALL_PARSERS}")
"""``--tool-call-parser`` names and their formats."""


@dataclass
class ToolDelta:
    """One streamed piece: content text, or a piece of call ``index`` (its id and name come once,
    with its first piece)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class StreamingToolParser:
    """Text deltas in, content and tool-call deltas out, read as :meth:`ToolCallFormat.parse`
    reads the whole text, so the deltas add up to the whole response's content and calls. Text
    that may begin a call tag, and whitespace that may end a piece of content, are held back; a
    call's arguments are streamed as they come once its head (``{"name": "f", "arguments": ``)
    names a declared function, all but what may still be the call's closing brace.

    One case differs from the whole response: a call whose head was streamed but whose JSON then
    does not parse (a model stopped by ``max_tokens`` inside it, a close tag inside a string): its
    text also follows as content, and it is not counted among the calls (``finish_reason``)."""

    def __init__(self, fmt: ToolCallFormat, declared: set[str]):
        self.fmt, self.declared = fmt, declared
        self.buffer = ""  # text received, not yet handed out
        self.held_space = ""  # whitespace that ended the content so far
        self.in_call = False
        self.calls: list[ToolCall] = []  # the calls read, as the whole answer reads them
        self.broken = 0  # calls announced in the stream whose JSON then broke: text, as parse() reads them
        self.open_call: ToolCall | None = None  # the call whose head has been sent
        self.args_start: int | None = None  # where its arguments begin in the buffer (-1: not streamable)
        self.args_end = _ObjectEnd()
        self.sent_args = 0
        self.searched = 0  # the open call's buffer holds no close tag before this

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        """The deltas ``text`` completes; ``final``: the text has ended, hand out everything."""
        self.buffer += text
        out: list[ToolDelta] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(self.fmt.open_tag)
                if start < 0:
                    keep = 0 if final else held_back(self.buffer, (self.fmt.open_tag,))
                    self._content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    if final and not self.calls and self.held_space:
                        out.append(ToolDelta(content=self.held_space))
                        self.held_space = ""
                    return out
                self._content(out, self.buffer[:start])
                self.buffer = self.buffer[start + len(self.fmt.open_tag):]
                self.in_call, self.open_call, self.args_start, self.sent_args = True, None, None, 0
                self.args_end, self.searched = _ObjectEnd(), 0
                continue
            # from where the last search stopped, less what may be a tag's beginning: linear in the text
            end = self.buffer.find(self.fmt.close_tag, self.searched)
            self.searched = max(0, len(self.buffer) - len(self.fmt.close_tag) + 1)
            if end < 0 and not final:
                self._stream_args(out)
                return out
            body = self.buffer if end < 0 else self.buffer[:end]
            self._close_call(out, body, closed=end >= 0)
            self.buffer = "" if end < 0 else self.buffer[end + len(self.fmt.close_tag):]
            self.in_call = False

    @property
    def _index(self) -> int:
        return len(self.calls) + self.broken

    def _content(self, out: list[ToolDelta], text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            out.append(ToolDelta(content=self.held_space + body))
            self.held_space = ""
        self.held_space += text[len(body):]

    def _stream_args(self, out: list[ToolDelta]) -> None:
        if self.args_start is None:
            head = _NAME_FIRST.match(self.buffer, 0, MAX_HEAD_CHARS)
            if head is None:
                if len(self.buffer) >= MAX_HEAD_CHARS:
                    self.args_start = -1  # no head in reach: sent whole when it closes
                return
            rest = self.buffer[head.end():]
            if not rest.strip():  # what follows the head decides
                if len(self.buffer) >= MAX_HEAD_CHARS:
                    self.args_start = -1
                return
            name = _loads(f'"{head.group(1)}"')
            if not isinstance(name, str) or name not in self.declared or not rest.lstrip().startswith("{"):
                self.args_start = -1  # sent whole when it closes
                return
            self.args_start = head.end() + len(rest) - len(rest.lstrip())
            self.open_call = ToolCall(name, "")
            self.held_space = ""  # content's trailing whitespace before a call is dropped
            out.append(ToolDelta(index=self._index, id=self.open_call.id, name=name, arguments=""))
        if self.args_start < 0:
            return
        rest = self.buffer[self.args_start:]
        end = self.args_end.feed(rest)
        if end is not None:  # the arguments are whole: nothing after them is theirs
            certain = rest[:end]
        else:
            rest = rest[: len(rest) - held_back(rest, (self.fmt.close_tag,))]
            certain = rest[: _outer_end(rest)]
        if len(certain) > self.sent_args:
            out.append(ToolDelta(index=self._index, arguments=certain[self.sent_args:]))
            self.sent_args = len(certain)

    def _close_call(self, out: list[ToolDelta], body: str, closed: bool) -> None:
        read = self.fmt.read_call(body, self.declared)
        if read is None:  # text after all, as parse() reads it
            if self.open_call is not None:
                self.broken += 1  # announced already: its index stays taken, but it is no call
            self._content(out, self.fmt.open_tag + body + (self.fmt.close_tag if closed else ""))
            return
        name, arguments = read
        self.held_space = ""
        call = self.open_call
        if call is None:
            call = ToolCall(name, arguments)
            out.append(ToolDelta(index=self._index, id=call.id, name=name, arguments=arguments))
        else:
            sent = body[self.args_start:self.args_start + self.sent_args]
            rest = arguments[len(sent):] if arguments.startswith(sent) else ""
            if rest:
                out.append(ToolDelta(index=self._index, arguments=rest))
            call.arguments = arguments
        self.calls.append(call)
