"""Pydantic models of what the server returns: completions, chunks, usage, logprobs, models, tokenize.

Field order follows OpenAI's documentation. Chunks are dumped with `exclude_unset=True`, so a field appears in a
chunk exactly when the builder set it (`usage: null` on every chunk only when `include_usage` asked for it).
"""

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer, model_validator


class _StreamedModel(BaseModel):
    """A model sent as a chunk (dumped with exclude_unset): `object` must always be there, though it has a default."""

    @model_validator(mode="after")
    def _always_send_object(self) -> "_StreamedModel":
        self.__pydantic_fields_set__.add("object")
        return self


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    completion_tokens: int = 0
    prompt_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        completion_tokens=completion_tokens,
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# ---- logprobs, chat shape ----
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


# ---- logprobs, legacy completions shape ----
class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# ---- chat ----
class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there are none, as OpenAI does

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    choices: list[ChatChoice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first has id, type and name; the rest pieces of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_StreamedModel):
    id: str
    choices: list[ChatChunkChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None


# ---- completions ----
class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_StreamedModel):
    id: str
    choices: list[CompletionChoice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | None = None


# ---- models, tokenize, version ----
class ModelCard(BaseModel):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "llmserve"
    max_model_len: int | None = None  # vLLM extra: clients size prompts with it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
