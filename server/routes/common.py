"""What every generation route needs before and after the engine: serving state, model check, admission, submit."""

import asyncio
import functools
import hashlib
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from model.sampling_params import SamplingParams
from model.structured_output import Constraint, GrammarError, GrammarSpec
from server.async_engine import AsyncEngine, RequestStream
from server.errors import APIError
from server.logprobs import TokenText
from server.metrics import ServerMetrics
from server.responses import ErrorResponse

if TYPE_CHECKING:
    from config.settings import Settings
    from model.tokenizer import Tokenizer

T = TypeVar("T")
INLINE_TOKENIZE_CHARS = 16384  # ~10 ms of tokenizing: cheaper inline than a thread hop, too short to stall streams

# Every error status a route may answer; declared in the OpenAPI schema so clients and schemathesis know them.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": doc}
    for status, doc in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model or route"),
        (413, "Request body too large"),
        (429, "Server at capacity; retry after Retry-After seconds"),
        (503, "Model loading, engine stopped, or server shutting down"),
    )
}


@dataclass(slots=True)
class Serving:
    """The ready engine side of the app, fetched once per request."""

    settings: "Settings"
    engine: AsyncEngine
    tokenizer: "Tokenizer"
    texts: TokenText
    metrics: ServerMetrics
    max_model_len: int
    fingerprint: str
    tokenizer_worker: "TokenizerWorker"

    async def tokenize(self, text_size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenizer work inline when it is small (exact admission accounting, no thread hop), else off the loop."""
        if text_size < INLINE_TOKENIZE_CHARS:
            return fn(*args, **kwargs)
        return await self.tokenizer_worker.run(fn, *args, **kwargs)


class TokenizerWorker:
    """Tokenizer work off the event loop (a 2 MiB prompt takes seconds), so streams keep flowing. One thread: calls
    stay serialized, as HF fast tokenizers may change their own settings inside encode."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-tokenizer")
        self.queued = 0  # calls waiting or running: these requests wait too, so admission control counts them

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))
        finally:
            self.queued -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def serving(request: Request) -> Serving:
    state = request.app.state
    if state.async_engine is None:
        message = f"model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
        raise APIError(
            503,
            message,
            code="model_loading" if not state.load_error else "model_load_failed",
            headers={"Retry-After": "5"},
        )
    engine: AsyncEngine = state.async_engine
    return Serving(
        state.settings,
        engine,
        engine.engine.tokenizer,
        state.token_text,
        state.metrics,
        engine.engine.max_model_len,
        state.fingerprint,
        state.tokenizer_worker,
    )


def fingerprint(settings: "Settings", describe: str) -> str:
    """Changes whenever the model or its runtime configuration does, as OpenAI's does."""
    return "fp_" + hashlib.sha256(f"{settings.model_name}|{describe}".encode()).hexdigest()[:10]


def check_model(ctx: Serving, model: str | None) -> None:
    if model is not None and model != ctx.settings.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves `{ctx.settings.model_name}`.",
            param="model",
            code="model_not_found",
        )


async def admit(request: Request) -> None:
    """Admission control, a dependency of the generation routes: runs before the handler tokenizes anything.

    "Waiting" counts requests being tokenized and choices submitted that have not produced a token (queued or in
    prefill), kept on the event loop, so a burst is counted exactly, not after the engine thread drains its inbox."""
    ctx = serving(request)
    pending, tokens = ctx.engine.num_pending + ctx.tokenizer_worker.queued, ctx.engine.num_pending_tokens
    limits = ctx.settings
    if pending >= limits.max_waiting_requests or tokens >= limits.max_waiting_tokens:
        ctx.metrics.reject(429)
        raise APIError(
            429,
            f"The server is at capacity ({pending} requests / {tokens} prompt tokens waiting; limits "
            f"{limits.max_waiting_requests} / {limits.max_waiting_tokens}). Retry after a moment.",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def submit(
    ctx: Serving,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    stop: list[str],
    include_stop_str_in_output: bool,
    skip_special_tokens: bool,
) -> RequestStream:
    try:
        return ctx.engine.submit(
            request_id,
            prompts,
            params,
            n=n,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens,
        )
    except ValueError as exc:  # the engine's own check: the request can never run (e.g. more than the KV cache holds)
        message = str(exc)
        too_long = "context length" in message or "KV cache" in message
        raise APIError(400, message, code="context_length_exceeded" if too_long else None) from exc


async def compile_constraint(ctx: Serving, spec: GrammarSpec, param: str) -> Constraint:
    """The compiled grammar: from the cache on the event loop, else compiled in the worker thread (a schema can take
    tens of milliseconds). A schema or grammar the backend cannot enforce is the client's 400, naming `param`."""
    engine = ctx.engine.engine
    try:
        # the first constrained request builds xgrammar's vocabulary table (a fraction of a second): off the loop
        grammars = engine.grammars if engine.grammars_ready else await ctx.tokenizer_worker.run(lambda: engine.grammars)
        cached = grammars.lookup(spec)
        if cached is not None:
            return cached
        return await ctx.tokenizer_worker.run(grammars.compile, spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param or param) from exc


def record_usage(
    request: Request, prompt_tokens: int, completion_tokens: int, finish_reasons: list[str | None]
) -> None:
    """For the access log line, which the front-door middleware writes after the response."""
    request.state.prompt_tokens = prompt_tokens
    request.state.completion_tokens = completion_tokens
    if getattr(request.state, "finish_reason", None) is None:
        request.state.finish_reason = ",".join(sorted({r or "none" for r in finish_reasons}))
