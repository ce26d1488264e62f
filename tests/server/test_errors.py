"""Malformed requests: each gets its documented status and OpenAI's error shape, never a 422 or a 5xx, and the
server answers a good request right after each one."""

import json
from typing import Any

import httpx
import pytest

from tests.server.harness import MODEL

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


C, P = "/v1/chat/completions", "/v1/completions"
# (name, method, path, json body or raw bytes, extra headers, status, expected param, expected code)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str | None, str | None]] = [
    ("no messages", "POST", C, without(chat(), "messages"), {}, 400, "messages", None),
    ("empty messages", "POST", C, chat(messages=[]), {}, 400, "messages", None),
    ("messages not a list", "POST", C, chat(messages="hi"), {}, 400, "messages", None),
    ("bad role", "POST", C, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "messages[0].role", None),
    ("missing role", "POST", C, chat(messages=[{"content": "x"}]), {}, 400, "messages[0].role", None),
    (
        "content is a number",
        "POST",
        C,
        chat(messages=[{"role": "user", "content": 5}]),
        {},
        400,
        "messages[0].content",
        None,
    ),
    (
        "image part",
        "POST",
        C,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        {},
        400,
        "messages[0].content[0]",
        None,
    ),
    ("temperature too high", "POST", C, chat(temperature=3), {}, 400, "temperature", None),
    ("temperature a word", "POST", C, chat(temperature="hot"), {}, 400, "temperature", None),
    ("top_p above 1", "POST", C, chat(top_p=1.5), {}, 400, "top_p", None),
    ("n zero", "POST", C, chat(n=0), {}, 400, "n", None),
    ("n too many", "POST", C, chat(n=129), {}, 400, "n", None),
    ("max_tokens zero", "POST", C, chat(max_tokens=0), {}, 400, "max_tokens", None),
    ("max_tokens negative", "POST", C, chat(max_tokens=-5), {}, 400, "max_tokens", None),
    ("over the context", "POST", C, chat(max_tokens=100_000), {}, 400, "max_tokens", "context_length_exceeded"),
    ("presence_penalty", "POST", C, chat(presence_penalty=3), {}, 400, "presence_penalty", None),
    ("frequency_penalty", "POST", C, chat(frequency_penalty=-3), {}, 400, "frequency_penalty", None),
    ("top_logprobs 21", "POST", C, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs", None),
    ("top_logprobs alone", "POST", C, chat(top_logprobs=2), {}, 400, "top_logprobs", None),
    ("logit_bias key", "POST", C, chat(logit_bias={"abc": 1}), {}, 400, "logit_bias", None),
    ("logit_bias id", "POST", C, chat(logit_bias={"99999999": 1}), {}, 400, "logit_bias", None),
    ("empty stop", "POST", C, chat(stop=[""]), {}, 400, "stop", None),
    ("stop_token_ids id", "POST", C, chat(stop_token_ids=[10**9]), {}, 400, "stop_token_ids", None),
    ("stream_options alone", "POST", C, chat(stream_options={"include_usage": True}), {}, 400, "stream_options", None),
    (
        "tool name",
        "POST",
        C,
        chat(tools=[{"type": "function", "function": {"name": "f g"}}]),
        {},
        400,
        "tools[0].function.name",
        None,
    ),
    ("tool type", "POST", C, chat(tools=[{"type": "retrieval"}]), {}, 400, "tools[0].type", None),
    (
        "json_schema",
        "POST",
        C,
        chat(response_format={"type": "json_schema"}),
        {},
        400,
        "response_format.json_schema.schema",
        None,
    ),
    ("required without tools", "POST", C, chat(tool_choice="required"), {}, 400, "tool_choice", None),
    ("tool_choice word", "POST", C, chat(tool_choice="sometimes"), {}, 400, "tool_choice", None),
    (
        "tool message without id",
        "POST",
        C,
        chat(messages=[*USER, {"role": "tool", "content": "1"}]),
        {},
        400,
        "messages[1].tool_call_id",
        None,
    ),
    ("seed a word", "POST", C, chat(seed="abc"), {}, 400, "seed", None),
    ("template kwargs", "POST", C, chat(chat_template_kwargs=[1]), {}, 400, "chat_template_kwargs", None),
    ("continue a user turn", "POST", C, chat(continue_final_message=True), {}, 400, "continue_final_message", None),
    ("unknown model", "POST", C, chat(model="gpt-4o"), {}, 404, "model", "model_not_found"),
    ("malformed JSON", "POST", C, b'{"model": ', {"content-type": "application/json"}, 400, None, None),
    ("JSON array body", "POST", C, b"[1, 2]", {"content-type": "application/json"}, 400, None, None),
    ("empty body", "POST", C, b"", {"content-type": "application/json"}, 400, None, None),
    ("text/plain body", "POST", C, json.dumps(chat()).encode(), {"content-type": "text/plain"}, 400, None, None),
    (
        "body too large",
        "POST",
        C,
        chat(messages=[{"role": "user", "content": "x" * 300_000}]),
        {},
        413,
        None,
        "request_too_large",
    ),
    ("suffix", "POST", P, completion(suffix="!"), {}, 400, "suffix", None),
    ("prompt empty list", "POST", P, completion(prompt=[]), {}, 400, "prompt", None),
    ("prompt empty string", "POST", P, completion(prompt=""), {}, 400, "prompt", None),
    ("prompt token id", "POST", P, completion(prompt=[1, 10**9]), {}, 400, "prompt", None),
    ("prompt a dict", "POST", P, completion(prompt={"a": 1}), {}, 400, "prompt", None),
    ("logprobs 21", "POST", P, completion(logprobs=21), {}, 400, "logprobs", None),
    ("echo with logprobs", "POST", P, completion(echo=True, logprobs=1), {}, 400, "logprobs", None),
    ("best_of", "POST", P, completion(best_of=3), {}, 400, "best_of", None),
    ("tokenize nothing", "POST", "/tokenize", {}, {}, 400, "prompt", None),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [-1]}, {}, 400, "tokens", None),
    ("GET a POST route", "GET", C, None, {}, 405, None, None),
    ("no such route", "GET", "/v1/nothing", None, {}, 404, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_then_good_request(http: httpx.Client, case: tuple) -> None:
    name, method, path, body, headers, status, param, code = case
    if isinstance(body, bytes):
        response = http.request(method, path, content=body, headers=headers)
    else:
        response = http.request(method, path, json=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    payload = response.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error

    good = http.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["message"]["role"] == "assistant"
