"""The front door every HTTP request passes first (pure ASGI, so streams and disconnects pass through untouched):
request id, shutdown drain (503), API key (401), body-size cap (413), the in-flight count, one JSON access-log line.
"""

import hmac
import json
import logging
import time
import uuid
from typing import Any

from starlette.datastructures import Headers, State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError

access_log = logging.getLogger("llmserve.access")
_OPEN_PATHS = frozenset({"/health", "/"})  # no key needed: load balancers probe /health; / is the chat page
_OPEN_PREFIXES = ("/static/",)  # the chat page's files, which hold no secrets; the page sends the key on API calls


class FrontDoor:
    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state  # the FastAPI app's state: settings, draining flag, in-flight count, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = Headers(scope=scope)
        # Honour the caller's id (tracing across services), bounded: it goes into every log line.
        request_id = "".join(ch for ch in headers.get("x-request-id", "")[:128] if ch.isprintable()) or uuid.uuid4().hex
        request_state: dict[str, Any] = scope.setdefault("state", {})
        request_state["request_id"] = request_id
        status = 500  # what the log says if the app dies before starting a response

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1", "replace"))]
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await _send_error(send_with_id, refusal)
                return
            body, too_large = await _read_body(receive, self.state.settings.max_request_bytes)
            if too_large:
                limit = self.state.settings.max_request_bytes
                await _send_error(
                    send_with_id, APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
                )
                return
            self.state.inflight += 1
            try:
                await self.app(scope, _replay(body, receive), send_with_id)
            finally:
                self.state.inflight -= 1
        finally:
            _log(scope, request_state, request_id, status, started)

    def _refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        settings = self.state.settings
        if self.state.draining:
            self.state.metrics.reject(503)
            return APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if settings.api_key and not _is_open(scope["path"]) and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            scheme, _, key = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
                return APIError(
                    401,
                    "Incorrect API key provided. Send it as `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_bytes:
            return APIError(413, f"request body exceeds {settings.max_request_bytes} bytes", code="request_too_large")
        return None


def _is_open(path: str) -> bool:
    return path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES)


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """Read the whole body (chunked uploads carry no Content-Length to check), stopping as soon as it passes `limit`."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            return b"", False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # afterwards only http.disconnect, which the routes watch for

    return replay


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _log(scope: Scope, state: dict[str, Any], request_id: str, status: int, started: float) -> None:
    line = {
        "request_id": request_id,
        "method": scope["method"],
        "route": scope["path"],
        "status": status,
        "latency_ms": round((time.monotonic() - started) * 1000, 1),
        "prompt_tokens": state.get("prompt_tokens"),
        "completion_tokens": state.get("completion_tokens"),
        "finish_reason": state.get("finish_reason"),
    }
    access_log.info(json.dumps(line))
