"""POST /v1/chat/completions: render the chat template, run the engine, answer whole or as a chunk stream."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

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
    make_usage,
)
from server.routes.common import ERROR_RESPONSES, Serving, admit, check_model, new_request_id, now, record_usage, serving, submit
from server.streaming import collect_unless_disconnected, sse_response

router = APIRouter(responses=ERROR_RESPONSES)
_STREAM_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}}


async def render_prompt(ctx: Serving, body: ChatCompletionRequest) -> list[int]:
    kwargs = dict(body.chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "continue_final_message", "tokenize"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs")
    try:
        messages = body.template_messages()
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


@router.post("/v1/chat/completions", dependencies=[Depends(admit)], response_model=ChatCompletionResponse,
             responses=_STREAM_DOC)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = serving(request)
    check_model(ctx, body.model)
    body.check_supported()
    body.check_token_ids(ctx.tokenizer.vocab_size)
    stop = body.stop_strings()
    prompt = await render_prompt(ctx, body)
    params = body.to_sampling_params(len(prompt), ctx.max_model_len)
    request_id = new_request_id("chatcmpl")
    n = body.n or 1
    stream = submit(ctx, request_id, [prompt], params, n, stop, body.include_stop_str_in_output, body.skip_special_tokens)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(request, _chunks(ctx, request, stream, body.model, include_usage), stream)
    try:
        deltas = await collect_unless_disconnected(request, stream, aiter(stream))
    finally:
        stream.close()
    if deltas is None:
        return Response(status_code=499)  # nobody is listening; the code is for the access log
    return JSONResponse(_response(ctx, request, stream, deltas, body.model, bool(body.logprobs)).model_dump(mode="json"))


def _response(ctx: Serving, request: Request, stream: RequestStream, deltas: list[Delta], model: str,
              want_logprobs: bool) -> ChatCompletionResponse:
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
    choices = [
        ChatChoice(index=i, message=AssistantMessage(content="".join(texts[i])),
                   logprobs=ChatLogprobs(content=logprobs[i]) if want_logprobs else None, finish_reason=finish[i])
        for i in range(stream.num_choices)
    ]
    return ChatCompletionResponse(id=stream.request_id, choices=choices, model=model, system_fingerprint=ctx.fingerprint,
                                  usage=make_usage(prompt_tokens, completion_tokens, cached))


async def _chunks(ctx: Serving, request: Request, stream: RequestStream, model: str, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    created = now()
    extra: dict[str, Any] = {"usage": None} if include_usage else {}  # usage: null on every chunk only when asked

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=stream.request_id, choices=choices, created=created, model=model,
                                   system_fingerprint=ctx.fingerprint, **extra)

    for i in range(stream.num_choices):  # the role goes first, before any token, so clients see the answer start
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None, finish_reason=None)])
    finish: list[str | None] = [None] * stream.num_choices
    async for d in stream:
        if not d.text and d.finish_reason is None and not d.logprobs:
            continue  # text held back (partial UTF-8 or a possible stop string): nothing to say yet
        delta = ChatDelta(content=d.text) if d.text else ChatDelta()
        logprobs = chat_logprobs(ctx.texts, d.logprobs) if d.logprobs else None
        finish[d.index] = d.finish_reason
        yield chunk([ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs, finish_reason=d.finish_reason)])
    prompt_tokens, completion_tokens, cached = stream.usage()
    record_usage(request, prompt_tokens, completion_tokens, finish)
    if include_usage:
        last = ChatCompletionChunk(id=stream.request_id, choices=[], created=created, model=model,
                                   system_fingerprint=ctx.fingerprint, usage=make_usage(prompt_tokens, completion_tokens, cached))
        yield last
