"""The chat page as the browser tests use it: opening it, acting on it in the user's terms, reading what it stored,
and the fake streams that some tests serve in place of the model."""

import json
import re
from typing import Any

from playwright.sync_api import Browser, ConsoleMessage, Locator, Page, Route, expect

from tests.server.harness import MODEL, LiveServer

SETTINGS_KEY = "llmserve.settings.v1"  # server/static/js/store.js
CHATS_KEY = "llmserve.chats.v1"
FINISHED = re.compile("^(done|stopped|error)$")
GENERATION_MS = 180_000  # a real answer on a busy 2-core machine


class PageProblems:
    """Uncaught errors and CSP violations on a page: each means the page is broken, so every test checks them."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        page.on("console", self._console)

    def _console(self, message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            self.errors.append(f"CSP: {message.text}")


def open_page(
    browser: Browser, server: LiveServer, viewport: dict[str, int] | None = None, **settings: Any
) -> tuple[Page, PageProblems]:
    """A fresh browser profile on the chat page. `settings` (store.js names: apiKey, max_tokens, ...) are what the
    user typed on an earlier visit: they go into localStorage before the page's scripts first run."""
    context = browser.new_context(viewport=viewport or {"width": 1280, "height": 800})
    if settings:
        value = json.dumps(json.dumps(settings))
        context.add_init_script(
            f"if (!localStorage.getItem('{SETTINGS_KEY}')) localStorage.setItem('{SETTINGS_KEY}', {value});"
        )
    page = context.new_page()
    problems = PageProblems(page)
    response = page.goto(server.url + "/")
    assert response is not None and response.status == 200
    return page, problems


def ready(page: Page) -> None:
    """Wait until /v1/models has answered: the model is chosen and requests will name it."""
    expect(page.locator("#model-name")).to_have_text(MODEL)


def send(page: Page, text: str) -> Locator:
    """Type a message, press Enter, and return the answer's element (the last message)."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    answer = page.locator("article.msg").last
    expect(answer).to_have_class(re.compile(r"\bassistant\b"))
    return answer


def finished(answer: Locator, state: str | re.Pattern[str] = FINISHED, timeout: float = GENERATION_MS) -> Locator:
    expect(answer).to_have_attribute("data-state", state, timeout=timeout)
    return answer


def stored_conversations(page: Page) -> list[dict[str, Any]]:
    return page.evaluate(f"JSON.parse(localStorage.getItem('{CHATS_KEY}')).conversations")


def open_settings(page: Page) -> Locator:
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    return page.locator("#settings-form")


def sse(*pieces: str, prompt_tokens: int = 7) -> str:
    """A chat completion stream as the server frames it: role, one chunk per piece, finish, usage, [DONE]."""

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        body = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": choices,
            "usage": usage,
        }
        return f"data: {json.dumps(body)}\n\n"

    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(pieces),
        "total_tokens": prompt_tokens + len(pieces),
    }
    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": piece}) for piece in pieces]
    frames += [chunk({}, finish="stop"), chunk(None, usage=usage), "data: [DONE]\n\n"]
    return "".join(frames)


def fulfill_stream(route: Route, *pieces: str) -> None:
    route.fulfill(status=200, content_type="text/event-stream", body=sse(*pieces))
