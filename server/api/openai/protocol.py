"""Request and response schemas of the OpenAI-compatible API (completions, chat, models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

# How many choices, prompts, stop sequences and alternatives a request may ask for is the
# server's --max-* options (server.api.generation.check_request_bounds), not the schema's.


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI-style servers do, so that newer clients still work.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, description="choices per prompt")
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields; unset, they take generation_config.json's values
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100]")
    # vLLM's: more tokens that end a sequence, and going on past the end-of-sequence token
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (tenants apart)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Structured output: OpenAI's response_format, and vLLM's guided_* fields (one at most)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        if value is None:
            return value
        kind = value.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema, an object")
        return value

    def structured_output(self) -> tuple[str, object, str] | None:
        """(grammar kind, its spec, the field it came from), or None for free text."""
        asked = []
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            if self.response_format["type"] == "json_object":
                asked.append(("json_object", None, "response_format"))
            else:
                asked.append(("json_schema", self.response_format["json_schema"]["schema"], "response_format"))
        if self.guided_json is not None:
            asked.append(("json_schema", self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            asked.append(("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            asked.append(("choice", self.guided_choice, "guided_choice"))
        if len(asked) > 1:
            raise ValueError(f"at most one of response_format, guided_json, guided_regex, guided_choice; got "
                             f"{', '.join(a[2] for a in asked)}")
        return asked[0] if asked else None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        if not value:
            return value
        if len(value) > 300:
            raise ValueError("logit_bias holds at most 300 tokens")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"logit_bias keys are token ids, got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value):
        if value and any(t < 0 for t in value):
            raise ValueError("stop_token_ids are token ids (>= 0)")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, a list of texts, token ids, or a list of token-id lists: one choice (n of them) "
        "per prompt")
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            value = [value]  # one text, or one prompt of token ids
        if not value:
            raise ValueError("prompt must not be empty")
        for prompt in value:
            if not prompt:
                raise ValueError("prompt must not be empty")
            if not isinstance(prompt, str) and any(t < 0 for t in prompt):
                raise ValueError("token ids are >= 0")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids (the validator made the field this list)."""
        return self.prompt


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant's calls")
    tool_call_id: str | None = Field(default=None, description="a tool message: the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only here (image_parts: with images)
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""

    def image_parts(self) -> list[dict] | None:
        """Content parts with images: ``{"type": "text", "text"}`` and ``{"type": "image", "url"}``
        (an ``image_url`` part's URL), in order; None where the content has no image."""
        if not isinstance(self.content, list) or not any(p.get("type") == "image_url" for p in self.content):
            return None
        parts = []
        for part in self.content:
            if part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str) or not url:
                    raise ValueError("an image_url content part needs image_url.url")
                parts.append({"type": "image", "url": url})
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError("content parts must be text or image_url")
        return parts


FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    # OpenAI's deprecated forerunners of tools: refused with a pointer rather than ignored
    functions: list | None = None
    function_call: object | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value):
        if value:
            raise ValueError("functions and function_call are OpenAI's deprecated forms: send tools and tool_choice")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value):
        names = [t.function.name for t in value or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be unique")
        return value

    def check_tool_choice(self) -> None:
        """Raise ValueError where tool_choice asks for a call the tools cannot give."""
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice_kind!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")

    @property
    def tool_choice_kind(self) -> str:
        """none, auto, required or named."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def offered_tools(self) -> list[Tool]:
        """The tools the model is shown: none with tool_choice none, only the named one when one is named."""
        kind = self.tool_choice_kind
        if kind == "none":
            return []
        if kind == "named":
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools or ())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hsdp-serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- responses ------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class _DropNone(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI's stream deltas are."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (``object`` ``text_completion`` too) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # the version of the weights that computed it (server.weights; the x-weights-version header's): OpenAI's
    # backend fingerprint, which changes when the backend's configuration does; null before any token
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # the version of the weights that computed it (server.weights; the x-weights-version header's): OpenAI's
    # backend fingerprint, which changes when the backend's configuration does; null before any token
    system_fingerprint: str | None = None


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_DropNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # the version of the weights that computed it (server.weights; the x-weights-version header's): OpenAI's
    # backend fingerprint, which changes when the backend's configuration does; null before any token
    system_fingerprint: str | None = None
