"""The chat page over plain HTTP: served without the API key while the API still needs it, sent with a CSP that
forbids inline script, absent from the API schema, off with --no-webui; its vendored libraries are the pinned files.
(tests/browser drives the page itself.)"""

import hashlib
import re

import httpx
from fastapi.testclient import TestClient

from config.settings import Settings, load_settings
from server.app import create_app
from server.webui import STATIC_DIR
from tests.server.harness import LiveServer

PAGE_FILES = [
    "/",
    "/static/app.css",
    "/static/js/main.js",
    "/static/vendor/marked/marked.esm.js",
    "/static/vendor/dompurify/purify.es.mjs",
    "/static/vendor/highlight/highlight.min.js",
]


def test_page_loads_without_the_key_and_the_api_still_needs_it(server: LiveServer) -> None:
    for path in PAGE_FILES:
        response = httpx.get(server.url + path)  # no Authorization header
        assert response.status_code == 200, path
    page = httpx.get(server.url + "/")
    assert page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/js/main.js">' in page.text
    assert httpx.get(server.url + "/static/js/main.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": []}).status_code == 401


def test_page_forbids_inline_and_foreign_script(server: LiveServer) -> None:
    csp = httpx.get(server.url + "/").headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'"
    assert directives["default-src"] == "'self'" and directives["object-src"] == "'none'"
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "<script>" not in httpx.get(server.url + "/").text  # the page itself obeys it
    assert httpx.get(server.url + "/static/js/main.js").headers["content-security-policy"] == csp


def test_missing_page_file_is_a_json_404(server: LiveServer) -> None:
    for path in ("/static/nope.js", "/static/%2e%2e/webui.py", "/static/%2e%2e/%2e%2e/config/settings.py"):
        response = httpx.get(server.url + path)
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_page_is_not_in_the_api_schema(server: LiveServer) -> None:
    paths = server.app.openapi()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)


def test_no_webui_turns_the_page_off() -> None:
    assert load_settings(["serve", "--no-webui"])[1].webui is False
    assert load_settings(["serve"])[1].webui is True
    client = TestClient(create_app(Settings(webui=False)))  # no `with`: the lifespan, which loads the model, never runs
    for path in ("/", "/static/js/main.js"):
        response = client.get(path)
        assert response.status_code == 404 and "error" in response.json()


def test_vendored_files_are_the_pinned_ones() -> None:
    vendor = STATIC_DIR / "vendor"
    listed = dict(
        (name, digest)
        for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", (vendor / "README.md").read_text(), re.MULTILINE)
    )
    on_disk = {str(p.relative_to(vendor)) for p in vendor.rglob("*") if p.is_file() and p.name != "README.md"}
    assert set(listed) == on_disk
    for name, digest in listed.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
