"""Request and response schemas of the TGI-style API (Hugging Face text-generation-inference)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["length", "eos_token", "stop_sequence"]
# best_of, top_n_tokens and stop are bounded by the server's --max-* options
# (server.api.generation.check_request_bounds), not by the schema.


class GenerateParameters(BaseModel):
    """Every parameter TGI documents. Clients send all of them, unset ones as null or false (TGI's
    own ``text-generation`` client does), so null means unset throughout; a value this server
    cannot honour is a 422 that says so."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=20, ge=1)
    do_sample: bool = False
    temperature: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    typical_p: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                            description="OpenAI's formula, over the generated tokens")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] | None = Field(default_factory=list)
    return_full_text: bool | None = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(default=None, ge=0)
    truncate: int | None = Field(default=None, ge=1, description="keep only the last N tokens of the input")
    best_of: int | None = Field(default=None, ge=1,
                                description="sample this many and answer the likeliest (not streamed)")
    watermark: bool = False
    grammar: dict | None = None
    adapter_id: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str]:
        value = value or []
        if any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _default_max_new_tokens(cls, value: int | None) -> int:
        return 20 if value is None else value

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, value: dict | None) -> dict | None:
        if value is not None and (value.get("type") not in ("json", "json_object", "regex") or
                                  (value["type"] != "json_object" and "value" not in value)):
            raise ValueError('grammar is {"type": "json", "value": schema} or {"type": "regex", "value": pattern}')
        return value

    @field_validator("watermark", "adapter_id")
    @classmethod
    def _not_served(cls, value, info):
        if value is not None and value is not False:
            raise ValueError(NOT_SERVED[info.field_name])
        return value

    @property
    def samples(self) -> bool:
        """TGI's rule: sampling when asked, or when a warper is set."""
        return self.do_sample or any(v is not None for v in (self.temperature, self.top_k, self.top_p,
                                                              self.typical_p))


NOT_SERVED = {
    "watermark": "watermarking is not implemented by this server",
    "adapter_id": "adapters (LoRA) are not served: one model without adapters is loaded",
}
"""TGI parameters accepted when unset (null, false) and refused, saying so, when set."""


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    model: str | None = Field(default=None, description="ignored, as TGI ignores it: one model is served")


class Token(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool


class InputToken(BaseModel):
    """A prompt token (``decoder_input_details``): the first has no log-probability."""

    id: int
    text: str
    logprob: float | None = None


class SequenceDetails(BaseModel):
    """What TGI reports of one generated sequence."""

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken] = Field(default_factory=list)
    """With ``decoder_input_details``: the prompt's tokens and their log-probabilities."""
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None
    """With ``top_n_tokens``: the most likely tokens at each step."""
    weights_version: str | None = None
    """hsdp-serve's: the version of the weights that computed the last token (``POST /admin/weights``)."""


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None
    """With ``best_of`` > 1: the other sequences sampled."""


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    weights_version: str | None = None  # as SequenceDetails'


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class CompatGenerateRequest(GenerateRequest):
    """The body of TGI's ``POST /``: a generate request that says whether to stream."""

    stream: bool = False
