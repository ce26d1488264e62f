"""create_app(settings): the FastAPI app. Nothing heavy happens at import or in create_app itself.

The lifespan starts loading the engine in a worker thread and returns at once, so the server answers while the
weights load: /health says 503 until the engine is ready, generation routes say 503 `model_loading`.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from config.settings import Settings
from server.errors import install_error_handlers
from server.metrics import ServerMetrics
from server.middleware import FrontDoor
from server.routes import chat, completions, models, ops, tokenize
from server.routes.common import TokenizerWorker, fingerprint
from server.routes.ops import server_version
from server.webui import install_webui

if TYPE_CHECKING:
    from model.engine.engine import Engine, EngineStats

logger = logging.getLogger("llmserve.server")


def _build_engine(settings: Settings) -> "Engine":
    from model.engine.engine import Engine  # torch and the weights load here, not at import

    return Engine(settings)


async def _in_fresh_thread(fn: Callable[[Settings], "Engine"], settings: Settings) -> "Engine":
    """Run fn in a thread that exits afterwards. Each thread that runs torch ops gets its own OpenMP pool, and
    libgomp stops spinning at its barriers once more pool threads exist than CPUs: building the engine in a
    lingering executor thread left the step loop 30 % slower (51 vs 39 ms per single-stream token here)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Engine] = loop.create_future()

    def run() -> None:
        try:
            result = fn(settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=run, name="llmserve-load", daemon=True).start()
    return await done


async def _load(app: FastAPI, engine_factory: Callable[[Settings], "Engine"]) -> None:
    from server.async_engine import AsyncEngine
    from server.logprobs import TokenText

    state = app.state
    settings: Settings = state.settings
    started = time.monotonic()
    try:
        engine = await _in_fresh_thread(engine_factory, settings)
        async_engine = AsyncEngine(engine, state.metrics)
        await async_engine.start()
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.exception("loading the model failed")
        return
    description = engine.describe()
    state.token_text = TokenText(engine.tokenizer)
    state.fingerprint = fingerprint(settings, description)
    state.engine = engine
    state.async_engine = async_engine
    logger.info("engine ready in %.1f s: %s", time.monotonic() - started, description)
    logger.info(
        "serving %s at http://%s:%d/v1 (max_model_len %d)",
        settings.model_name,
        settings.host,
        settings.port,
        engine.max_model_len,
    )


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents a 422 on every route with a body; errors.py answers 400 instead, so say that."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(
    settings: Settings,
    *,
    engine_factory: Callable[[Settings], "Engine"] = _build_engine,
    sse_ping_seconds: float = 15.0,
) -> FastAPI:
    """`engine_factory` and `sse_ping_seconds` exist for tests (a short ping interval makes pings observable)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(app, engine_factory))
        app.state.loader = loader
        app.state.tokenizer_worker = TokenizerWorker()
        try:
            yield
        finally:
            app.state.tokenizer_worker.shutdown()
            if not loader.done():
                await asyncio.wait({loader}, timeout=60)  # a half-built engine must not outlive the app
            if app.state.async_engine is not None:
                await asyncio.to_thread(app.state.async_engine.shutdown)

    app = FastAPI(
        title="llmserve",
        version=server_version(),
        lifespan=lifespan,
        description="OpenAI-compatible LLM inference server",
    )
    state = app.state
    state.settings = settings
    state.engine = None
    state.async_engine = None
    state.load_error = None
    state.engine_failure = None  # set when a tensor-parallel engine failed and the server stops for it
    state.draining = False
    state.inflight = 0
    state.started_at = int(time.time())
    state.sse_ping_seconds = sse_ping_seconds

    def stats() -> "EngineStats | None":
        return state.engine.stats() if state.engine is not None else None

    state.metrics = ServerMetrics(settings.model_name, stats)
    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    for module in (chat, completions, models, tokenize, ops):
        app.include_router(module.router)
    if settings.webui:
        install_webui(app)
    app.add_middleware(FrontDoor, state=state)
    if settings.allowed_origins:  # added last = outermost, so preflights never meet the API key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    return app
