"""The client connection in one place: SSE framing for streams, disconnect watching for non-streamed answers.

Frames are `data: <json>\\n\\n` (OpenAI's framing), comment pings (`: ping`) keep proxies and clients from timing
out while a long prefill runs, and `data: [DONE]` is always last, after an in-band `data: {"error": ...}` too.
A client that goes away has its engine requests aborted (blocks freed on the next step) and is counted.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.async_engine import RequestStream
from server.errors import body_for_exception

logger = logging.getLogger("llmserve.server")
T = TypeVar("T")


def sse_response(request: Request, chunks: AsyncIterator[BaseModel], stream: RequestStream) -> EventSourceResponse:
    async def events() -> AsyncIterator[dict[str, Any]]:
        failed = False
        try:
            async for chunk in chunks:
                yield {"data": chunk.model_dump_json(exclude_unset=True)}
        except Exception as exc:  # the 200 is already out: report in-band, then end the stream properly
            failed = True
            if getattr(exc, "status", 500) >= 500:
                logger.exception("stream %s failed after the response started", stream.request_id)
            yield {"data": json.dumps(body_for_exception(exc))}
        finally:
            # Reached early only when the client went away (sse-starlette cancels this generator) or on error.
            if stream.close() and not failed:
                _count_disconnect(request, stream)
        yield {"data": "[DONE]"}

    return EventSourceResponse(
        events(),
        ping=request.app.state.sse_ping_seconds,
        ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
        sep="\n",
        headers={"Cache-Control": "no-cache"},
    )


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect: when the client closes the socket.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_unless_disconnected(
    request: Request, stream: RequestStream, collect: AsyncIterator[T]
) -> list[T] | None:
    """Drain `collect` (the stream's deltas); None, with the request aborted and counted, if the client left first."""

    async def drain() -> list[T]:
        return [item async for item in collect]

    work = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    if stream.close():
        _count_disconnect(request, stream)
    return None


def _count_disconnect(request: Request, stream: RequestStream) -> None:
    request.app.state.metrics.client_disconnects.inc()
    prompt_tokens, completion_tokens, _ = stream.usage()
    request.state.prompt_tokens = prompt_tokens
    request.state.completion_tokens = completion_tokens
    request.state.finish_reason = "client_disconnect"
