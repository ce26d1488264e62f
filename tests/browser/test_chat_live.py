"""The chat page against the real server and model: streaming, Stop, the API key, reload, and the server's errors."""

import json

import pytest

from tests.browser.conftest import NO_PLAYWRIGHT
from tests.server.harness import API_KEY, MODEL, LiveServer, wait_until_idle

pytest.importorskip("playwright.sync_api", reason=NO_PLAYWRIGHT)

from playwright.sync_api import Browser, Page, Route, expect  # noqa: E402

from tests.browser.page import (  # noqa: E402
    GENERATION_MS,
    PageProblems,
    finished,
    open_page,
    open_settings,
    ready,
    send,
    stored_conversations,
)

ChatPage = tuple[Page, PageProblems]

# Inside the page: record the answer's text length and state on every change of the message list, and keep a copy
# of each chat completion stream as received (Chromium keeps no body of a streamed fetch for Playwright to read).
WATCH_ANSWER = """() => {
  window.samples = [];
  new MutationObserver(() => {
    const answer = document.querySelector("#messages article.assistant:last-child");
    if (answer) window.samples.push([answer.dataset.state, answer.querySelector(".body").textContent.length]);
  }).observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
  window.streams = [];
  const fetch = window.fetch;
  window.fetch = async (...args) => {
    const response = await fetch(...args);
    if (String(args[0]).endsWith("/v1/chat/completions")) response.clone().text().then((t) => window.streams.push(t));
    return response;
  };
}"""


def test_answer_streams_and_ends_complete(chat: ChatPage) -> None:
    page, _ = chat
    open_settings(page).locator("[name=max_tokens]").fill("32")
    page.click("#close-settings")
    page.evaluate(WATCH_ANSWER)
    answer = finished(send(page, "Count from one to twenty in words."), "done")

    # It grew while streaming: several lengths seen before the answer was complete.
    samples = page.evaluate("window.samples")
    growing = sorted({length for state, length in samples if state == "streaming" and length > 0})
    assert len(growing) >= 3, samples

    # It ended complete: the page kept every delta the server sent, and shows the server's token counts.
    (stream,) = page.wait_for_function("window.streams.length && window.streams").json_value()
    chunks = [json.loads(line.removeprefix("data: ")) for line in stream.split("\n") if line.startswith("data: {")]
    sent = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert sent and usage["completion_tokens"] > 1
    assert stored_conversations(page)[0]["messages"][1]["content"] == sent
    assert answer.locator(".body").inner_text().strip()
    stats = answer.locator(".stats")
    expect(stats).to_contain_text(f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens")
    expect(stats).to_contain_text("first token")
    expect(stats).to_contain_text("tok/s")


def test_stop_mid_stream_frees_the_sequence(chat: ChatPage, server: LiveServer) -> None:
    page, _ = chat
    before = wait_until_idle(server)

    def endless(route: Route) -> None:  # only Stop can end this answer: the model may not end it first
        body = {**route.request.post_data_json, "max_tokens": 1000, "ignore_eos": True}
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", endless)
    answer = send(page, "Tell me a long story about a dragon.")
    expect(answer.locator(".body")).not_to_have_text("", timeout=GENERATION_MS)  # tokens are arriving
    assert server.metrics()["vllm:num_requests_running"] == 1
    page.click("#stop")
    finished(answer, "stopped")
    expect(answer.locator(".meta")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    assert answer.locator(".body").inner_text().strip()  # the partial answer stays

    after = wait_until_idle(server)
    assert after["vllm:num_requests_running"] == 0 and after["llmserve:kv_blocks_used"] == 0
    assert after["llmserve:client_disconnects_total"] == before["llmserve:client_disconnects_total"] + 1
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[abort] == before[abort] + 1


def test_api_key_flow(browser: Browser, server: LiveServer) -> None:
    page, problems = open_page(browser, server, max_tokens="8", temperature="0")  # no key: the page still loads
    api_calls: list[dict[str, str]] = []
    page.on("request", lambda request: api_calls.append(request.headers) if "/v1/" in request.url else None)
    banner = page.locator("#banner")
    expect(banner).to_contain_text("needs an API key")

    answer = send(page, "Say hello.")
    finished(answer, "error")  # says so, rather than showing a blank answer
    expect(answer.locator(".error")).to_contain_text("401: Incorrect API key provided")
    expect(answer.locator(".error")).to_contain_text("Enter the server's API key in Settings")

    banner.click()  # it opens the settings at the key field
    key = page.locator("#settings-form [name=apiKey]")
    expect(key).to_be_focused()
    key.fill("not-the-key")
    key.blur()
    expect(banner).to_contain_text("needs an API key")
    key.fill(API_KEY)
    key.blur()
    expect(banner).to_be_hidden()
    expect(page.locator("#settings-form [name=model]")).to_have_value(MODEL)
    page.click("#close-settings")

    api_calls.clear()
    answer.locator("[data-action=regenerate]").click()
    answer = finished(page.locator("article.msg").last, "done")
    assert answer.locator(".body").inner_text().strip()
    assert api_calls and all(headers.get("authorization") == f"Bearer {API_KEY}" for headers in api_calls)
    page.context.close()
    assert problems.errors == []


def test_reload_keeps_conversations(chat: ChatPage) -> None:
    page, _ = chat
    answer = finished(send(page, "Name three colors."), "done")
    answer_text = answer.locator(".body").inner_text()
    stats = answer.locator(".stats").inner_text()

    page.reload()
    ready(page)
    messages = page.locator("#messages article")
    expect(messages).to_have_count(2)
    expect(messages.first.locator(".body")).to_have_text("Name three colors.")
    expect(messages.last.locator(".body")).to_have_text(answer_text)
    expect(messages.last.locator(".stats")).to_have_text(stats)

    # New, rename, switch and delete, each surviving a reload.
    conversations = page.locator("#conversations li")
    page.click("#new-chat")
    expect(messages).to_have_count(0)
    expect(conversations).to_have_count(2)
    first = conversations.filter(has_text="Name three colors.")
    first.get_by_role("button", name="Rename").click()
    page.locator(".rename-input").fill("Colours")
    page.locator(".rename-input").press("Enter")
    page.reload()
    expect(conversations).to_have_count(2)
    expect(messages).to_have_count(0)  # the new, empty conversation is still the open one
    conversations.filter(has_text="Colours").get_by_role("button", name="Colours").click()
    expect(messages.first.locator(".body")).to_have_text("Name three colors.")
    expect(page.locator("#title")).to_have_text("Colours")

    delete = conversations.filter(has_text="Colours").get_by_role("button", name="Delete")
    delete.click()
    expect(conversations).to_have_count(2)  # the first click only arms it
    delete.click()
    expect(conversations).to_have_count(1)
    page.reload()
    expect(conversations).to_have_count(1)
    expect(conversations).not_to_contain_text("Colours")


def test_429_shows_its_message(chat: ChatPage, server: LiveServer) -> None:
    page, _ = chat
    with server.override(max_waiting_requests=0):  # every generation request is over the cap
        answer = finished(send(page, "Hello?"), "error")
    error = answer.locator(".error")
    expect(error).to_contain_text("429: The server is at capacity")
    expect(error).to_contain_text("Try again in 1 s.")  # the Retry-After header


def test_400_shows_its_message(chat: ChatPage) -> None:
    page, _ = chat
    open_settings(page).locator("[name=top_k]").fill("-5")
    page.click("#close-settings")
    answer = finished(send(page, "Hello?"), "error")
    expect(answer.locator(".error")).to_have_text("400: top_k: Input should be greater than or equal to -1 (got -5)")


def test_json_mode_answers_with_a_json_object(chat: ChatPage) -> None:
    """The toggle asks for response_format json_object; the real model's answer, constrained, parses as an object."""
    page, _ = chat
    settings = open_settings(page)
    settings.locator("[name=max_tokens]").fill("200")
    settings.locator("[name=temperature]").fill("0")  # greedy: the same answer every run
    page.click("#close-settings")
    page.check("#json-mode")
    page.evaluate(WATCH_ANSWER)
    finished(send(page, 'Reply with a JSON object like {"greeting": "hello"}.'), "done")
    (stream,) = page.wait_for_function("window.streams.length && window.streams").json_value()
    chunks = [json.loads(line.removeprefix("data: ")) for line in stream.split("\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["stop"], text
    assert isinstance(json.loads(text), dict)
    assert stored_conversations(page)[0]["messages"][1]["content"] == text
