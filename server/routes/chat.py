"""POST /v1/chat/completions: render the chat template, run the engine, answer whole or as a chunk stream."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from model.structured_output import GrammarSpec
from server.async_engine import Delta, RequestStream
from server.errors import bad_request
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest
from server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_usage,
)
from server.routes.common import (
    ERROR_RESPONSES,
    Serving,
    admit,
    check_model,
    compile_constraint,
    new_request_id,
    now,
    record_usage,
    serving,
    submit,
)
from server.streaming import collect_unless_disconnected, sse_response
from server.tools import (
    ToolCallDelta,
    ToolCallFormat,
    ToolCallParser,
    ToolSetup,
    structural_tag,
    template_messages,
    tool_setup,
)

router = APIRouter(responses=ERROR_RESPONSES)
_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}
}


def tools_for(ctx: Serving) -> ToolSetup:
    return tool_setup(ctx.tokenizer.hf.chat_template, ctx.settings.tool_call_parser)


async def render_prompt(
    ctx: Serving, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt's token ids; `tools` (checked dicts) go into the template when the model may call them."""
    kwargs = dict(body.chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "continue_final_message", "tokenize", "tools"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs")
    try:
        messages, tool_kwargs = template_messages(body.template_messages(), tools, tools_for(ctx))
        kwargs.update(tool_kwargs)
        prompt = await ctx.tokenize(
            sum(len(m["content"]) for m in messages),
            ctx.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except (ValueError, TypeError, KeyError) as exc:  # includes jinja2's TemplateError raised by the template itself
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):
            raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc
        raise
    if not prompt:
        raise bad_request("the rendered prompt is empty", param="messages")
    return prompt


@router.post(
    "/v1/chat/completions", dependencies=[Depends(admit)], response_model=ChatCompletionResponse, responses=_STREAM_DOC
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = serving(request)
    check_model(ctx, body.model)
    body.check_supported()
    body.check_token_ids(ctx.tokenizer.vocab_size)
    stop = body.stop_strings()
    setup = tools_for(ctx)
    tools, tool_choice = body.tool_dicts(), body.tool_choice_name()
    constraint = body.grammar_spec()
    if tools and tool_choice != "none":
        if constraint is not None:
            raise bad_request(
                'response_format and guided outputs cannot be combined with tools unless tool_choice is "none"',
                constraint[1],
            )
        parallel = body.parallel_tool_calls is not False
        constraint = GrammarSpec("structural_tag", structural_tag(tools, tool_choice, parallel, setup.format)), "tools"
    prompt = await render_prompt(ctx, body, tools if tool_choice != "none" else None)
    params = body.to_sampling_params(len(prompt), ctx.max_model_len)
    if constraint is not None:
        params.constraint = await compile_constraint(ctx, *constraint)
    tool_format = setup.format if tools and tool_choice != "none" else None
    request_id = new_request_id("chatcmpl")
    model = body.model or ctx.settings.model_name
    n = body.n or 1
    stream = submit(
        ctx, request_id, [prompt], params, n, stop, body.include_stop_str_in_output, body.skip_special_tokens
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(request, _chunks(ctx, request, stream, model, include_usage, tool_format), stream)
    try:
        deltas = await collect_unless_disconnected(request, stream, aiter(stream))
    finally:
        stream.close()
    if deltas is None:
        return Response(status_code=499)  # nobody is listening; the code is for the access log
    response = _response(ctx, request, stream, deltas, model, bool(body.logprobs), tool_format)
    return JSONResponse(response.model_dump(mode="json"))


def _final_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason


def _response(
    ctx: Serving,
    request: Request,
    stream: RequestStream,
    deltas: list[Delta],
    model: str,
    want_logprobs: bool,
    tool_format: ToolCallFormat | None,
) -> ChatCompletionResponse:
    texts: list[list[str]] = [[] for _ in range(stream.num_choices)]
    logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(stream.num_choices)]
    finish: list[str | None] = [None] * stream.num_choices
    for d in deltas:
        texts[d.index].append(d.text)
        if d.logprobs:
            logprobs[d.index].extend(chat_logprobs(ctx.texts, d.logprobs).content or [])
        if d.finish_reason is not None:
            finish[d.index] = d.finish_reason
    prompt_tokens, completion_tokens, cached = stream.usage()
    record_usage(request, prompt_tokens, completion_tokens, finish)
    choices = []
    for i in range(stream.num_choices):
        message = AssistantMessage(content="".join(texts[i]))
        if tool_format is not None:
            parser = ToolCallParser(tool_format)
            content = parser.feed(message.content or "")[0] + parser.finish()[0]
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parser.calls]
            message = AssistantMessage(content=content or (None if calls else ""), tool_calls=calls or None)
            finish[i] = _final_reason(finish[i], parser)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=ChatLogprobs(content=logprobs[i]) if want_logprobs else None,
                finish_reason=finish[i],
            )
        )
    return ChatCompletionResponse(
        id=stream.request_id,
        choices=choices,
        model=model,
        system_fingerprint=ctx.fingerprint,
        usage=make_usage(prompt_tokens, completion_tokens, cached),
    )


def _delta_tool_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """One entry per call in this chunk: its opening (id, type, name) and/or the next piece of its arguments."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        if out and out[-1].index == d.index and out[-1].function is not None:
            out[-1].function.arguments = (out[-1].function.arguments or "") + d.arguments
        elif d.id is not None:
            out.append(
                DeltaToolCall(
                    index=d.index,
                    id=d.id,
                    type="function",
                    function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
                )
            )
        else:
            out.append(DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments)))
    return out


async def _chunks(
    ctx: Serving,
    request: Request,
    stream: RequestStream,
    model: str,
    include_usage: bool,
    tool_format: ToolCallFormat | None,
) -> AsyncIterator[ChatCompletionChunk]:
    created = now()
    extra: dict[str, Any] = {"usage": None} if include_usage else {}  # usage: null on every chunk only when asked

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=stream.request_id,
            choices=choices,
            created=created,
            model=model,
            system_fingerprint=ctx.fingerprint,
            **extra,
        )

    for i in range(stream.num_choices):  # the role goes first, before any token, so clients see the answer start
        yield chunk(
            [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None, finish_reason=None)]
        )
    finish: list[str | None] = [None] * stream.num_choices
    parsers = [ToolCallParser(tool_format) if tool_format is not None else None for _ in range(stream.num_choices)]
    async for d in stream:
        text, parser = d.text, parsers[d.index]
        calls: list[ToolCallDelta] = []
        if parser is not None:  # text that may start a call waits until it is known
            text, calls = parser.feed(d.text)
            if d.finish_reason is not None:
                more_text, more_calls = parser.finish()
                text, calls = text + more_text, calls + more_calls
        if not text and not calls and d.finish_reason is None and not d.logprobs:
            continue  # text held back (partial UTF-8, a possible stop string or call): nothing to say yet
        delta = ChatDelta(content=text) if text else ChatDelta()
        if calls:
            delta.tool_calls = _delta_tool_calls(calls)
        logprobs = chat_logprobs(ctx.texts, d.logprobs) if d.logprobs else None
        reason = _final_reason(d.finish_reason, parser)
        finish[d.index] = reason
        yield chunk([ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs, finish_reason=reason)])
    prompt_tokens, completion_tokens, cached = stream.usage()
    record_usage(request, prompt_tokens, completion_tokens, finish)
    if include_usage:
        last = ChatCompletionChunk(
            id=stream.request_id,
            choices=[],
            created=created,
            model=model,
            system_fingerprint=ctx.fingerprint,
            usage=make_usage(prompt_tokens, completion_tokens, cached),
        )
        yield last
