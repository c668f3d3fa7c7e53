"""Chat requests rendered to token ids: messages, tool calls and tools through the chat template.

:class:`ChatRenderer` holds the template (``--chat-template``, else the tokenizer's, else
:data:`FALLBACK_CHAT_TEMPLATE`) and the tool-call format (``--tool-call-parser``). A template that
takes ``tools`` (its source uses the name) gets them, and the history's calls with their arguments
as objects, as Hugging Face templates expect. A template that does not (the default SmolLM2's) would
drop them without a word: the renderer writes the tools into the system message in the format's
words, an assistant's calls as the text the model would have written, and tool answers as user turns
(``<tool_response>``), so that any template renders a tool conversation. ``content: null`` becomes
"" for templates that cannot take None.
"""

from __future__ import annotations

import json
import re

from server.api.openai.protocol import ChatCompletionRequest, ChatMessage
from server.api.openai.tools import FORMATS, ToolCallFormat
from server.http.errors import InputValidationError

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Used when neither ``--chat-template`` nor the tokenizer gives one (documented in the README)."""


class ChatTemplateError(ValueError):
    """``--chat-template`` names no readable file and is no template (the server does not start)."""


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself when it is written inline."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if "{{" in value or "{%" in value:
            return value
        raise ChatTemplateError(f"--chat-template {value!r}: not a readable file ({e.strerror}) nor a "
                                f"Jinja template") from e


class ChatRenderer:
    """A chat request's messages (and tools) as the prompt's token ids."""

    def __init__(self, tokenizer, template: str | None = None, tool_format: str = "hermes", images=None):
        self.tokenizer = tokenizer
        self.images = images  # server.api.media.ImagePrompts of an image-text model, else None
        self.template = (template or getattr(tokenizer, "chat_template", None)
                         or (images.chat_template if images is not None else None) or FALLBACK_CHAT_TEMPLATE)
        if isinstance(self.template, dict):  # a tokenizer with named templates: the default one
            self.template = self.template.get("default") or next(iter(self.template.values()))
        self.format: ToolCallFormat = FORMATS[tool_format]
        self.native_tools = re.search(r"\btools\b", self.template) is not None

    def prompt_ids(self, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
        text, urls = self.render(req, add_generation_prompt)
        if urls:
            raise InputValidationError("this model takes no images (image_url content parts)", param="messages")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def render(self, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> tuple[str, list[str]]:
        """The prompt's text, an image's placeholder where each image part was, and the images' URLs
        in order (``image_url`` parts, an image-text model's only)."""
        tools = [t.model_dump(exclude_none=True) for t in req.offered_tools()]
        urls: list[str] = []
        try:
            if self.native_tools:
                messages = [self._native(m, urls) for m in req.messages]
            else:
                messages = self._as_text(req.messages, tools, urls)
                tools = []
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=self.template,
            )
        except ValueError as e:
            raise InputValidationError(str(e), param="messages") from e
        except Exception as e:  # noqa: BLE001 - jinja's errors: the template cannot render these messages
            raise InputValidationError(f"the chat template cannot render these messages: {e}",
                                       param="messages") from e
        return text, urls

    def _content(self, m: ChatMessage, urls: list[str]):
        """A message's content as the template takes it: its text, or with images (an image-text
        model's) its parts, each image part ``{"type": "image"}`` and its URL added to ``urls``."""
        parts = m.image_parts()
        if parts is None:
            return m.text()
        if self.images is None:
            raise ValueError("this model takes no images (image_url content parts)")
        urls += [part["url"] for part in parts if part["type"] == "image"]
        return [{"type": "image"} if part["type"] == "image" else part for part in parts]

    def _native(self, m: ChatMessage, urls: list[str]) -> dict:
        """A message as Hugging Face templates take it: calls' arguments as objects."""
        out: dict = {"role": m.role, "content": self._content(m, urls)}
        if m.name is not None:
            out["name"] = m.name
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]
        return out

    def _as_text(self, messages: list[ChatMessage], tools: list[dict], urls: list[str]) -> list[dict]:
        """Messages for a template that knows no tools: everything about tools written as text."""
        out: list[dict] = []
        for m in messages:
            if m.role == "tool":
                text = self.format.response_text(m.text())
                if out and out[-1].get("_tool_answers"):  # answers to one turn's calls: one user turn
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "_tool_answers": True})
                continue
            content = self._content(m, urls)
            if m.tool_calls and isinstance(content, list):
                raise ValueError("an assistant message with tool calls cannot carry images")
            if m.tool_calls:
                calls = "\n".join(self.format.call_text(c.function.name, c.function.arguments)
                                  for c in m.tool_calls)
                content = f"{content}\n{calls}" if content else calls
            out.append({"role": m.role, "content": content})
        if tools:
            listing = self.format.system_text(tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{listing}" if out[0]["content"] else listing
            else:
                out.insert(0, {"role": "system", "content": listing})
        for message in out:
            message.pop("_tool_answers", None)
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
