"""OpenAI-compatible request and response models (pydantic v2).

Requests are validated from the raw JSON body in **strict** JSON mode
(``model_validate_json(..., strict=True)``): a string where a number belongs,
a number where a string belongs, or a bad literal is a 400, not a silent
coercion. Unknown fields are **accepted** (``extra="allow"``) and logged by
the server (clients such as LangChain send fields we do not know); see
:func:`unknown_fields`. Value ranges follow OpenAI / vLLM: ``temperature``
in [0, 2], ``top_p`` in (0, 1], ``top_k`` -1/0 (off) or >= 1, penalties in
[-2, 2], ``max_tokens`` >= 1, ``seed`` in the int64 range; every number
finite (``NaN`` and ``Infinity`` are refused).

Responses are models too (``model_dump(exclude_none=True)`` keeps optional
fields out of the JSON the way the OpenAI API omits them).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class OpenAIModel(BaseModel):
    # allow_inf_nan=False: NaN and Infinity (which Python's json writes) are
    # refused as "should be a finite number", before a range check would call
    # NaN merely too large
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# ---------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunctionIn(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class _SamplingRequest(OpenAIModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Union[str, list[str], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    repetition_penalty: float | None = Field(default=None, gt=0.0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        for s in stops:
            if s == "":
                raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0)


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def parse_request(cls: type[OpenAIModel], body: bytes) -> OpenAIModel:
    """Strict JSON validation (raises ``pydantic.ValidationError``)."""
    return cls.model_validate_json(body, strict=True)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of every field the models did not declare (nested too)."""
    out = [f"{prefix}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        v = getattr(model, name, None)
        items = v if isinstance(v, list) else [v]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                idx = f"[{i}]" if isinstance(v, list) else ""
                out += unknown_fields(item, f"{prefix}{name}{idx}.")
    return out


def describe_validation_error(err: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of the first problems in a pydantic error."""
    parts = []
    param = None
    for e in err.errors(include_url=False)[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        if e.get("type") == "json_invalid":
            return f"request body is not valid JSON: {e.get('msg')}", None
        if param is None and loc:
            param = str(e["loc"][0])
        msg = e.get("msg", "invalid")
        if e.get("type") == "missing":
            msg = "field required"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", param


# ---------------------------------------------------------------------------- responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "megac"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatMessage",
    "ChatMessageOut",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCallOut",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "TokenizeRequest",
    "ToolCallDeltaOut",
    "ToolCallOut",
    "Usage",
    "describe_validation_error",
    "parse_request",
    "unknown_fields",
]
