"""Request and response schemas of the TGI-style API (Hugging Face text-generation-inference)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["length", "eos_token", "stop_sequence"]
MAX_STOP_SEQUENCES = 16


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=20, ge=1)
    do_sample: bool = False
    temperature: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    return_full_text: bool = False
    details: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value


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


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None


class StreamResponse(BaseModel):
    index: int
    token: Token
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class CompatGenerateRequest(GenerateRequest):
    """The body of TGI's ``POST /``: a generate request that says whether to stream."""

    stream: bool = False
