"""POST /v1/completions: the legacy text API. A prompt is a string, a list of strings, token ids, or a list of
token-id lists; each prompt gets `n` choices, numbered prompt_index * n + sample_index as OpenAI does."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from server.async_engine import Delta, RequestStream
from server.errors import bad_request
from server.logprobs import completion_logprobs
from server.protocol import CompletionRequest
from server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, make_usage
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

router = APIRouter(responses=ERROR_RESPONSES)
_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}
}


async def tokenize_prompts(
    ctx: Serving, prompt: str | list[str] | list[int] | list[list[int]]
) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (the text is what `echo` repeats)."""
    items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not items:
        raise bad_request("prompt must not be an empty list", param="prompt")
    ids: list[list[int]] = []
    texts: list[str] = []
    vocab = ctx.tokenizer.vocab_size
    for i, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            tokens = await ctx.tokenize(len(item), ctx.tokenizer.encode, item)
            text = item
        else:
            tokens = list(item)
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"{name}: {bad[0]} is not a token id (vocabulary size {vocab})", param=name)
            text = await ctx.tokenize(len(tokens) * 4, ctx.tokenizer.decode, tokens)
        if not tokens:
            raise bad_request(f"{name} must not be empty", param=name)
        ids.append(tokens)
        texts.append(text)
    return ids, texts


@router.post("/v1/completions", dependencies=[Depends(admit)], response_model=CompletionResponse, responses=_STREAM_DOC)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = serving(request)
    check_model(ctx, body.model)
    body.check_supported()
    body.check_token_ids(ctx.tokenizer.vocab_size)
    stop = body.stop_strings()
    prompts, prompt_texts = await tokenize_prompts(ctx, body.prompt)
    params = body.to_sampling_params(max(len(p) for p in prompts), ctx.max_model_len)
    constraint = body.grammar_spec()
    if constraint is not None:
        params.constraint = await compile_constraint(ctx, *constraint)
    model = body.model or ctx.settings.model_name
    n = body.n or 1
    echo = [prompt_texts[i // n] if body.echo else "" for i in range(len(prompts) * n)]
    stream = submit(
        ctx, new_request_id("cmpl"), prompts, params, n, stop, body.include_stop_str_in_output, body.skip_special_tokens
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(request, _chunks(ctx, request, stream, model, echo, include_usage), stream)
    try:
        deltas = await collect_unless_disconnected(request, stream, aiter(stream))
    finally:
        stream.close()
    if deltas is None:
        return Response(status_code=499)  # nobody is listening; the code is for the access log
    want_logprobs = body.logprobs is not None
    return JSONResponse(_response(ctx, request, stream, deltas, model, echo, want_logprobs).model_dump(mode="json"))


def _response(
    ctx: Serving,
    request: Request,
    stream: RequestStream,
    deltas: list[Delta],
    model: str,
    echo: list[str],
    want_logprobs: bool,
) -> CompletionResponse:
    texts = [[e] for e in echo]
    logprobs = [CompletionLogprobs() for _ in echo]
    offsets = [len(e) for e in echo]
    finish: list[str | None] = [None] * len(echo)
    for d in deltas:
        texts[d.index].append(d.text)
        if d.logprobs:
            part = completion_logprobs(ctx.texts, d.logprobs, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in part.tokens)
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs[d.index], field).extend(getattr(part, field))
        if d.finish_reason is not None:
            finish[d.index] = d.finish_reason
    prompt_tokens, completion_tokens, cached = stream.usage()
    record_usage(request, prompt_tokens, completion_tokens, finish)
    choices = [
        CompletionChoice(
            index=i, text="".join(texts[i]), logprobs=logprobs[i] if want_logprobs else None, finish_reason=finish[i]
        )
        for i in range(len(echo))
    ]
    return CompletionResponse(
        id=stream.request_id,
        choices=choices,
        model=model,
        system_fingerprint=ctx.fingerprint,
        usage=make_usage(prompt_tokens, completion_tokens, cached),
    )


async def _chunks(
    ctx: Serving, request: Request, stream: RequestStream, model: str, echo: list[str], include_usage: bool
) -> AsyncIterator[CompletionResponse]:
    created = now()
    extra: dict[str, Any] = {"usage": None} if include_usage else {}  # usage: null on every chunk only when asked

    def chunk(choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(
            id=stream.request_id,
            choices=[choice],
            created=created,
            model=model,
            system_fingerprint=ctx.fingerprint,
            **extra,
        )

    offsets = [len(e) for e in echo]
    for i, text in enumerate(echo):
        if text:
            yield chunk(CompletionChoice(index=i, text=text, logprobs=None, finish_reason=None))
    finish: list[str | None] = [None] * len(echo)
    async for d in stream:
        if not d.text and d.finish_reason is None and not d.logprobs:
            continue  # text held back (partial UTF-8 or a possible stop string): nothing to say yet
        logprobs = None
        if d.logprobs:
            logprobs = completion_logprobs(ctx.texts, d.logprobs, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in logprobs.tokens)
        finish[d.index] = d.finish_reason
        yield chunk(CompletionChoice(index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason))
    prompt_tokens, completion_tokens, cached = stream.usage()
    record_usage(request, prompt_tokens, completion_tokens, finish)
    if include_usage:
        yield CompletionResponse(
            id=stream.request_id,
            choices=[],
            created=created,
            model=model,
            system_fingerprint=ctx.fingerprint,
            usage=make_usage(prompt_tokens, completion_tokens, cached),
        )
