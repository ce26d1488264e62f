"""Pydantic models of the OpenAI API requests, in the order of OpenAI's documentation, vendor extras fenced below.

Conversion to the engine's plain `SamplingParams` is a method, `to_sampling_params()`; no pydantic type goes past
the server. Unknown fields are accepted (clients send fields of newer API versions) and logged once per name.
Response and chunk models live in `server/responses.py`.
"""

import json
import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from model.sampling_params import SamplingParams
from model.structured_output import GrammarError, GrammarSpec, canonical_json, check_schema
from server.errors import APIError, bad_request
from server.tools import NAME_PATTERN

logger = logging.getLogger("llmserve.server")
_logged_extra: set[tuple[str, str]] = set()


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "OpenAIModel":
        for name in self.model_extra or {}:
            key = (type(self).__name__, name)
            if key not in _logged_extra and len(_logged_extra) < 256:  # bounded: clients choose these names
                _logged_extra.add(key)
                logger.warning("%s: ignoring unknown field %r (logged once)", type(self).__name__, name)
        return self


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["developer", "system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools (content may be null)
    tool_call_id: str | None = None  # tool turns: the call they answer


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class JSONSchemaSpec(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


Stop = str | list[str] | None
Bias = Annotated[float, Field(ge=-100, le=100)]


class SamplingFields(OpenAIModel):
    """Fields that chat and completions share; each subclass re-declares its own in documentation order."""

    if TYPE_CHECKING:  # declared for the type checker only: at run time the subclasses' own fields keep their order
        stop: Stop
        stop_token_ids: list[int] | None
        logit_bias: dict[str, Bias] | None

    def _common_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        data = {name: getattr(self, name) for name in type(self).model_fields}  # subclasses declare the fields
        temperature = 1.0 if data["temperature"] is None else data["temperature"]
        top_p = 1.0 if data["top_p"] is None else data["top_p"]
        if top_p == 0:  # OpenAI accepts 0: only the most likely token survives, i.e. greedy
            temperature, top_p = 0.0, 1.0
        if temperature < 1e-5:  # dividing logits by ~0 overflows to inf/NaN; this close to 0 it is greedy anyway (vLLM)
            temperature = 0.0
        try:
            return self._build(data, temperature, top_p, max_tokens, logprobs)
        except ValueError as exc:  # SamplingParams says "param: why"; a client's bad value, never a 500
            param, _, _ = str(exc).partition(":")
            raise bad_request(str(exc), param=param if param.isidentifier() else None) from exc

    @staticmethod
    def _build(
        data: dict[str, Any], temperature: float, top_p: float, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=data["top_k"],
            min_p=data["min_p"],
            presence_penalty=data["presence_penalty"] or 0.0,
            frequency_penalty=data["frequency_penalty"] or 0.0,
            repetition_penalty=data["repetition_penalty"],
            logit_bias=_logit_bias(data["logit_bias"]),
            seed=data["seed"],
            max_tokens=max_tokens,
            min_tokens=data["min_tokens"],
            stop_token_ids=list(data["stop_token_ids"] or []),
            ignore_eos=data["ignore_eos"],
            logprobs=logprobs,
        )

    def grammar_spec(self) -> tuple[GrammarSpec, str] | None:
        """The output constraint asked for, and the parameter that asked: response_format, vLLM's
        structured_outputs or its older guided_* fields; at most one of them."""
        found: list[tuple[GrammarSpec, str]] = []
        response_format: ResponseFormat | None = getattr(self, "response_format", None)
        if response_format is not None and response_format.type == "json_object":
            found.append((GrammarSpec("json_object", ""), "response_format"))
        elif response_format is not None and response_format.type == "json_schema":
            spec = response_format.json_schema
            if spec is None or spec.schema_ is None:
                raise bad_request(
                    "response_format json_schema needs json_schema.schema", "response_format.json_schema.schema"
                )
            found.append(
                (_schema_spec(spec.schema_, "response_format.json_schema.schema"), "response_format.json_schema.schema")
            )
        so: StructuredOutputs | None = getattr(self, "structured_outputs", None)
        guided = [
            (so.json_ if so else None, "structured_outputs.json"),
            (getattr(self, "guided_json", None), "guided_json"),
            (so.regex if so else None, "structured_outputs.regex"),
            (getattr(self, "guided_regex", None), "guided_regex"),
            (so.choice if so else None, "structured_outputs.choice"),
            (getattr(self, "guided_choice", None), "guided_choice"),
            (so.grammar if so else None, "structured_outputs.grammar"),
            (getattr(self, "guided_grammar", None), "guided_grammar"),
        ]
        for value, param in guided:
            if value is None:
                continue
            kind = param.rpartition(".")[2].removeprefix("guided_")
            if kind == "json":
                try:
                    schema = json.loads(value) if isinstance(value, str) else value
                except ValueError as exc:
                    raise bad_request(f"{param} is not valid JSON: {exc}", param) from exc
                found.append((_schema_spec(schema, param), param))
            elif kind == "choice":
                if not value or any(not isinstance(c, str) or not c for c in value):
                    raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
                found.append((GrammarSpec("choice", canonical_json(value)), param))
            else:
                if not value:
                    raise bad_request(f"{param} must not be empty", param)
                assert isinstance(value, str)  # the regex and grammar fields are declared str
                found.append((GrammarSpec("regex" if kind == "regex" else "grammar", value), param))
        if so is not None and so.json_object:
            found.append((GrammarSpec("json_object", ""), "structured_outputs.json_object"))
        if len(found) > 1:
            raise bad_request(
                f"only one output constraint may be given, got {', '.join(p for _, p in found)}", found[1][1]
            )
        return found[0] if found else None

    def stop_strings(self) -> list[str]:
        stop = self.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", param="stop")
        return stops

    def check_token_ids(self, vocab_size: int) -> None:
        for token_id in self.stop_token_ids or []:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"stop_token_ids: {token_id} is not a token id (vocabulary size {vocab_size})", "stop_token_ids"
                )
        for token_id in _logit_bias(self.logit_bias) or {}:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"logit_bias: {token_id} is not a token id (vocabulary size {vocab_size})", "logit_bias"
                )


def _logit_bias(bias: dict[str, Bias] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return out


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    try:
        check_schema(schema)
    except GrammarError as exc:
        raise bad_request(str(exc), param) from exc
    return GrammarSpec.json_schema(schema)


def resolve_max_tokens(requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The completion budget: what the client asked for, else the rest of the context; 400 when it cannot fit."""
    if requested is None:
        if prompt_tokens >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_tokens} tokens, which leaves no room for a completion.",
                param="messages",
                code="context_length_exceeded",
            )
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the completion). "
            "Please reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


class ChatCompletionRequest(SamplingFields):
    # OpenAI, in documentation order (https://platform.openai.com/docs/api-reference/chat/create)
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None  # omitted = the served model (vLLM, llama-server)
    audio: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Bias] | None = None
    logprobs: bool | None = False
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    n: int | None = Field(1, ge=1, le=128)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    service_tier: str | None = None
    stop: Stop = None
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None

    # ---- vendor extras (vLLM names) ----
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Fields we parse but cannot honour would silently change the answer's meaning: refuse them clearly."""
        if self.audio is not None or "audio" in (self.modalities or []):
            raise bad_request("audio output is not supported by this server", param="audio")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")

    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the forced function's name; 400 on a choice that does not fit `tools`."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise bad_request(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if name not in {t.function.name for t in self.tools or []}:
                raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
            return name
        if choice == "required" and not self.tools:
            raise bad_request('tool_choice "required" needs tools', "tool_choice")
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as plain dicts, each checked: a valid name, parameters that are a JSON-Schema object."""
        out: list[dict[str, Any]] = []
        for i, tool in enumerate(self.tools or []):
            function = tool.function
            if not NAME_PATTERN.fullmatch(function.name):
                raise bad_request(
                    f"tools[{i}].function.name {function.name!r} must match [A-Za-z0-9_-]{{1,64}}",
                    f"tools[{i}].function.name",
                )
            param = f"tools[{i}].function.parameters"
            parameters = function.parameters
            if parameters is not None:
                if parameters.get("type", "object") != "object":
                    raise bad_request(f"{param} must be a JSON Schema of type object", param)
                try:
                    check_schema(parameters, param)
                except GrammarError as exc:
                    raise bad_request(str(exc), param) from exc
            out.append({"type": "function", "function": function.model_dump(exclude_none=True)})
        names = [t["function"]["name"] for t in out]
        if len(set(names)) != len(names):
            raise bad_request("tools must have distinct function names", "tools")
        return out

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: `developer` is `system`, text parts joined into a string,
        tool calls and tool results in OpenAI's shape (server/tools.py adapts them to the template)."""
        out: list[dict[str, Any]] = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"only text content parts are supported, got {part.type!r}", f"messages[{i}].content[{j}]"
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            item: dict[str, Any] = {
                "role": "system" if message.role == "developer" else message.role,
                "content": content or "",
            }
            if message.name:
                item["name"] = message.name
            if message.tool_calls:
                if message.role != "assistant":
                    raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
                item["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls]
            if message.role == "tool":
                if not message.tool_call_id:
                    raise bad_request("tool messages need tool_call_id", f"messages[{i}].tool_call_id")
                item["tool_call_id"] = message.tool_call_id
            out.append(item)
        return out

    def to_sampling_params(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = resolve_max_tokens(requested, prompt_tokens, max_model_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._common_params(max_tokens, logprobs)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    # OpenAI, in documentation order (https://platform.openai.com/docs/api-reference/completions/create)
    model: str | None = None  # omitted = the served model (vLLM, llama-server)
    prompt: Prompt
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool | None = False
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Bias] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)
    n: int | None = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None

    # ---- vendor extras (vLLM names) ----
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        if self.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported by this model", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "echo with logprobs needs prompt logprobs, which this server does not compute", "logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")

    def to_sampling_params(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        requested = 16 if self.max_tokens is None else self.max_tokens  # OpenAI: "defaults to 16", null included
        return self._common_params(resolve_max_tokens(requested, prompt_tokens, max_model_len), self.logprobs)


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None  # rendered as a chat request with these tools would render them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
