"""The chat page: plain HTML, CSS and JS modules from server/static/, no build step. `/` is the page, `/static/*`
its files; `--no-webui` leaves both out.

The page holds no secrets, so it loads without the API key (middleware.py lets these paths through); every API call
it makes carries the key the user typed into its settings."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static"

# Model output is untrusted. Besides the page sanitizing it, the browser runs no inline script or handler and no
# script from elsewhere, and the page talks to this server only.
CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag): an upgraded server never runs with last version's scripts
}


class _PageFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def install_webui(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=HEADERS)

    app.mount(STATIC_PREFIX, _PageFiles(directory=STATIC_DIR), name="static")
