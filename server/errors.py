"""Every error the server returns, in OpenAI's shape, from one place: `{"error": {message, type, param, code}}`.

Handlers raise `APIError`; FastAPI's own validation and routing errors are mapped here too, so that no bad input
gets FastAPI's default 422 or a 5xx (the `openai` SDK retries 5xx, which would multiply a client's bad request).
"""

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("llmserve.server")

# OpenAI's error `type` per status; `code` narrows it where a client may branch on it.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raised anywhere under a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def body_for_exception(exc: BaseException) -> dict[str, Any]:
    """The `{"error": ...}` object for an exception that happens after a stream's 200 went out."""
    if isinstance(exc, APIError):
        return exc.body()
    return error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content": OpenAI's way of naming a parameter.

    Pydantic appends the tried union member ("str", "list[ContentPart]", "function-after[...]") to the location;
    those tags are not parameters, so they are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        text = str(item)
        if "[" in text or text in ("str", "int", "float", "bool", "list", "dict", "none", "null"):
            continue
        parts.append(text)
    return ".".join(parts) or None


def _validation_error(request: Request, exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = tuple(first.get("loc", ()))
    content_type = request.headers.get("content-type", "")
    if loc in ((), ("body",)):
        if "json" not in content_type:
            return bad_request(
                f"expected a JSON body with Content-Type: application/json, got {content_type or 'none'!r}"
            )
        if kind == "missing":
            return bad_request("request body is missing")
        return bad_request(f"request body must be a JSON object: {first.get('msg')}")
    param = _param_from_loc(loc)
    if kind == "missing":
        message = f"{param} is a required parameter" if param else "a required parameter is missing"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if "input" in first and not isinstance(first["input"], (dict, list)):
            message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
