"""The chat page with answers served by request interception: exact content the model would rarely write (an XSS
payload, a given code block), the requests the page sends, and failures the real server cannot be made to show."""

from typing import Any

import pytest

from tests.browser.conftest import NO_PLAYWRIGHT
from tests.server.harness import API_KEY, MODEL, LiveServer

pytest.importorskip("playwright.sync_api", reason=NO_PLAYWRIGHT)

from playwright.sync_api import Browser, Dialog, Page, Route, expect  # noqa: E402

from tests.browser.page import (  # noqa: E402
    PageProblems,
    finished,
    fulfill_stream,
    open_page,
    ready,
    send,
    stored_conversations,
)

ChatPage = tuple[Page, PageProblems]
CHAT_ROUTE = "**/v1/chat/completions"

PAYLOADS = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(2)</script>",
    "<svg onload=alert(3)></svg>",
    '<iframe src="javascript:alert(4)"></iframe>',
]


def test_xss_payload_in_the_answer_runs_nothing(chat: ChatPage) -> None:
    page, problems = chat
    dialogs: list[str] = []

    def record(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", record)
    answer_text = "Look: " + PAYLOADS[0] + "\n\n" + "\n\n".join(PAYLOADS[1:]) + "\n\n[click me](javascript:alert(5))\n"
    page.route(CHAT_ROUTE, lambda route: fulfill_stream(route, *answer_text.partition("onerror")))
    answer = finished(send(page, "Write some HTML."), "done")
    page.wait_for_timeout(500)  # time for an image error or a load handler to fire, were there one

    assert dialogs == []
    body = answer.locator(".body")
    for tag in ("img", "script", "svg", "iframe"):
        expect(body.locator(tag)).to_have_count(0)
    expect(body.locator("[href^='javascript:' i]")).to_have_count(0)
    expect(body.get_by_text("click me")).to_be_visible()
    for payload in PAYLOADS:  # shown as the text the model wrote
        expect(body).to_contain_text(payload)
    assert stored_conversations(page)[0]["messages"][1]["content"] == answer_text
    assert problems.errors == []  # nothing even tried to run and was stopped by the CSP


def test_code_block_is_highlighted_with_a_copy_button(chat: ChatPage, server: LiveServer) -> None:
    page, _ = chat
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    code = "def add(a, b):\n    return a + b"
    page.route(CHAT_ROUTE, lambda route: fulfill_stream(route, "Here:\n\n```python\n", code, "\n```\n"))
    answer = finished(send(page, "Add two numbers in Python."), "done")
    block = answer.locator("pre code.hljs")
    expect(block).to_have_text(code)
    expect(block.locator(".hljs-keyword").first).to_have_text("def")
    answer.get_by_role("button", name="Copy").click()
    expect(answer.get_by_role("button", name="Copied")).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == code


def test_every_turn_sends_the_history_and_settings(browser: Browser, server: LiveServer) -> None:
    page, problems = open_page(
        browser,
        server,
        apiKey=API_KEY,
        system="Answer briefly.",
        temperature="0.5",
        top_p="0.9",
        top_k="40",
        max_tokens="64",
        seed="7",
    )
    ready(page)
    bodies: list[dict[str, Any]] = []
    sessions: list[str | None] = []

    def answer(route: Route) -> None:
        bodies.append(route.request.post_data_json)
        sessions.append(route.request.headers.get("x-session-id"))
        fulfill_stream(route, f"answer {len(bodies)}")

    page.route(CHAT_ROUTE, answer)
    finished(send(page, "first"), "done")
    page.check("#json-mode")
    finished(send(page, "second"), "done")

    assert bodies[0] == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "first"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 64,
        "seed": 7,
    }
    assert bodies[1]["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "second"},
    ]
    assert bodies[1]["response_format"] == {"type": "json_object"}
    # both turns name their conversation, so that nginx's session affinity keeps them on one replica
    assert sessions == [stored_conversations(page)[0]["id"]] * 2
    page.context.close()
    assert problems.errors == []


def test_regenerate_and_edit_the_last_turn(chat: ChatPage) -> None:
    page, _ = chat
    histories: list[list[dict[str, str]]] = []

    def answer(route: Route) -> None:
        histories.append(route.request.post_data_json["messages"])
        fulfill_stream(route, f"answer {len(histories)}")

    page.route(CHAT_ROUTE, answer)
    finished(send(page, "question"), "done")
    messages = page.locator("#messages article")

    messages.last.get_by_role("button", name="Regenerate").click()
    finished(messages.last, "done")
    expect(messages).to_have_count(2)
    expect(messages.last).to_contain_text("answer 2")
    assert histories[1] == [{"role": "user", "content": "question"}]  # without the answer it replaces

    messages.first.get_by_role("button", name="Edit").click()
    editor = messages.first.locator("textarea")
    expect(editor).to_have_value("question")
    editor.fill("better question")
    messages.first.get_by_role("button", name="Send").click()
    finished(messages.last, "done")
    expect(messages).to_have_count(2)
    expect(messages.first.locator(".body")).to_have_text("better question")
    expect(messages.last).to_contain_text("answer 3")
    assert histories[2] == [{"role": "user", "content": "better question"}]


def test_lost_connection_says_so(chat: ChatPage) -> None:
    page, _ = chat
    page.route(CHAT_ROUTE, lambda route: route.abort("connectionreset"))
    answer = finished(send(page, "Hello?"), "error")
    expect(answer.locator(".error")).to_have_text("Lost the connection to the server.")


def test_phone_width(browser: Browser, server: LiveServer) -> None:
    width = 390
    page, problems = open_page(browser, server, viewport={"width": width, "height": 844}, apiKey=API_KEY)
    ready(page)
    sidebar = page.locator("#sidebar")
    expect(sidebar).not_to_be_in_viewport()  # the conversation list waits behind its button
    page.route(
        CHAT_ROUTE,
        lambda route: fulfill_stream(
            route, "A long line that must wrap: " + "word " * 60, "\n\n```\n" + "x = 1  # " + "long " * 40 + "\n```\n"
        ),
    )
    answer = finished(send(page, "Hello from a phone."), "done")
    expect(answer).to_be_in_viewport()
    for control in ("#prompt", "#send", "#json-mode", "#toggle-settings"):
        expect(page.locator(control)).to_be_in_viewport()
    assert page.evaluate("document.documentElement.scrollWidth") <= width  # long text wraps; code scrolls in its box

    page.click("#toggle-sidebar")
    expect(sidebar).to_be_in_viewport()
    sidebar.get_by_role("button", name="Hello from a phone.").click()
    expect(sidebar).not_to_be_in_viewport()

    page.click("#toggle-settings")
    box = page.locator("#settings").bounding_box()
    assert box is not None and box["width"] == width  # the settings cover the screen
    page.click("#close-settings")
    expect(page.locator("#settings")).to_be_hidden()
    page.context.close()
    assert problems.errors == []
