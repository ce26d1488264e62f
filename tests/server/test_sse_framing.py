"""SSE framing byte by byte, with raw httpx: what any OpenAI-compatible client parser relies on."""

import json

import httpx
import pytest

from tests.server.harness import MODEL, LiveServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True}


def frames(raw: bytes) -> list[bytes]:
    """Split an SSE body into events; each must end with a blank line (b"\\n\\n")."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return raw[:-2].split(b"\n\n")


def data_events(raw: bytes) -> list[bytes]:
    out = []
    for frame in frames(raw):
        if frame.startswith(b":"):  # a comment (our pings): clients must skip these
            assert frame == b": ping", frame
            continue
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame  # one line per event, no event:/id: fields
        out.append(frame[len(b"data: ") :])
    return out


def stream_bytes(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with http.stream("POST", path, json=body) as response:
        raw = response.read()
    return response, raw


def test_chat_stream_framing(http: httpx.Client) -> None:
    response, raw = stream_bytes(http, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "n": 2})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"]
    events = data_events(raw)
    assert events[-1] == b"[DONE]" and b"[DONE]" not in b"".join(events[:-1])
    chunks = [json.loads(e) for e in events[:-1]]
    first_by_choice: dict[int, dict] = {}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        assert set(chunk) == {
            "id",
            "object",
            "created",
            "model",
            "choices",
            "system_fingerprint",
        }  # no usage key unasked
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL
        assert chunk["id"] == chunks[0]["id"] and chunk["created"] == chunks[0]["created"]
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
        first_by_choice.setdefault(choice["index"], choice)
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
        elif choice is not first_by_choice[choice["index"]]:
            assert "role" not in choice["delta"]
    for index in (0, 1):
        assert first_by_choice[index]["delta"] == {"role": "assistant", "content": ""}  # the role goes first
        assert len(finishes[index]) == 1 and finishes[index][0] in ("stop", "length")  # exactly one finish_reason


def test_include_usage_framing(http: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 4, "stream_options": {"include_usage": True}}
    _, raw = stream_bytes(http, "/v1/chat/completions", body)
    events = data_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]


def test_completion_stream_framing(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "stream": True, "echo": True}
    _, raw = stream_bytes(http, "/v1/completions", body)
    events = data_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["text"] == "The capital of France is"  # echo comes first
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
    assert all("usage" not in c for c in chunks)

    _, raw = stream_bytes(http, "/v1/completions", {**body, "echo": False, "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in data_events(raw)[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_pings_during_long_prefill(server: LiveServer, http: httpx.Client) -> None:
    """A ~800-token prompt takes two engine steps to prefill; the client must hear pings meanwhile."""
    long_prompt = "Here is a list of words: " + " ".join(f"word{i}" for i in range(200))
    body = {**CHAT, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2}
    _, raw = stream_bytes(http, "/v1/chat/completions", body)
    parts = frames(raw)
    first_content = next(i for i, f in enumerate(parts) if f.startswith(b"data: ") and b'"content":""' not in f)
    assert b": ping" in parts[1:first_content], "no ping between the role chunk and the first token"
    assert parts[-1] == b"data: [DONE]"


def test_error_after_200_is_in_band_then_done(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """If building the answer fails once the 200 is out, the stream carries {"error": ...} and still ends with
    [DONE]; the request's engine side is aborted. The fault is injected where chunks get their logprobs."""
    import server.routes.chat

    def explode(*args: object) -> None:
        raise RuntimeError("logprobs exploded")

    monkeypatch.setattr(server.routes.chat, "chat_logprobs", explode)
    response, raw = stream_bytes(http, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "logprobs": True})
    assert response.status_code == 200
    events = data_events(raw)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert "logprobs exploded" in error["error"]["message"] and error["error"]["type"] == "server_error"
