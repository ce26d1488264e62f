"""Operations on the live server: concurrency, disconnects, admission control, auth, CORS, request ids, access log,
metrics. KV blocks and running requests are read back through /metrics, as an operator would."""

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.harness import API_KEY, MODEL, ORIGIN, LiveServer, auth, run, wait_until_idle

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]}
ENDLESS = {"max_tokens": 1000, "ignore_eos": True}  # still running when the client hangs up, whatever the model says


def parse_stream(raw: bytes) -> list[dict[str, Any]]:
    events = [f for f in raw.split(b"\n\n") if f and not f.startswith(b":")]
    assert events[-1] == b"data: [DONE]", events[-3:]
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


def test_64_concurrent_streams(server: LiveServer) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> list[dict[str, Any]]:
        body = {**CHAT, "messages": [{"role": "user", "content": f"Count from {i}."}], "max_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            return parse_stream(await response.aread())

    async def main() -> list[list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=180, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = run(main())
    assert len({chunks[0]["id"] for chunks in results}) == 64
    for chunks in results:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    wait_until_idle(server)


def _baseline(server: LiveServer) -> dict[str, float]:
    m = wait_until_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["llmserve:kv_blocks_used"] == 0
    return m


def _wait_running(server: LiveServer) -> dict[str, float]:
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] >= 1 and m["llmserve:kv_blocks_used"] > 0:
            return m
        assert time.monotonic() < deadline, f"the request never started running: {m}"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(server: LiveServer) -> None:
    before = _baseline(server)
    with (
        httpx.Client(base_url=server.url, headers=auth(), timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json={**CHAT, **ENDLESS, "stream": True}) as response,
    ):
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                _wait_running(server)
                break  # tokens are flowing: hang up (leaving iter_lines early closes the connection)
    after = wait_until_idle(server)
    assert after["vllm:num_requests_running"] == 0 and after["llmserve:kv_blocks_used"] == 0
    assert after["llmserve:client_disconnects_total"] == before["llmserve:client_disconnects_total"] + 1
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[abort] == before[abort] + 1


def test_disconnect_mid_non_stream_frees_blocks(server: LiveServer) -> None:
    before = _baseline(server)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=120) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, **ENDLESS}))
            await asyncio.to_thread(_wait_running, server)
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())
    after = wait_until_idle(server)
    assert after["vllm:num_requests_running"] == 0 and after["llmserve:kv_blocks_used"] == 0
    assert after["llmserve:client_disconnects_total"] == before["llmserve:client_disconnects_total"] + 1


def _burst(server: LiveServer, count: int) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.url, headers=auth(), timeout=180, limits=httpx.Limits(max_connections=count)
        ) as client:
            body = {**CHAT, "max_tokens": 3}
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(count)))

    return run(main())


def test_overload_gets_429_and_admitted_requests_complete(server: LiveServer) -> None:
    with server.override(max_waiting_requests=2):
        responses = _burst(server, 16)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"].isdigit()
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded"
        else:
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    wait_until_idle(server)


def test_waiting_token_cap(server: LiveServer) -> None:
    with server.override(max_waiting_tokens=1):  # one waiting request of any length already fills it
        statuses = [r.status_code for r in _burst(server, 6)]
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1
    wait_until_idle(server)


def test_auth(server: LiveServer) -> None:
    good = {**CHAT, "max_tokens": 1}
    missing = httpx.post(server.url + "/v1/chat/completions", json=good)
    wrong = httpx.post(server.url + "/v1/chat/completions", json=good, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # the one open route
    assert httpx.post(server.url + "/v1/chat/completions", json=good, headers=auth()).status_code == 200
    with server.override(api_key=""):  # no key configured: no header needed
        assert httpx.post(server.url + "/v1/chat/completions", json=good).status_code == 200


def test_cors_with_allowed_origins(server: LiveServer) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    ok = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    simple = httpx.get(server.url + "/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_request_id_and_access_log(server: LiveServer, http: httpx.Client) -> None:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    access = logging.getLogger("llmserve.access")
    access.addHandler(handler)
    old_level = access.level
    access.setLevel(logging.INFO)
    try:
        r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers={"X-Request-Id": "trace-abc-123"})
        generated = http.get("/v1/models")
    finally:
        access.removeHandler(handler)
        access.setLevel(old_level)
    assert r.headers["x-request-id"] == "trace-abc-123"
    assert len(generated.headers["x-request-id"]) >= 16
    lines = [json.loads(line) for line in records]
    (mine,) = [line for line in lines if line["request_id"] == "trace-abc-123"]
    assert mine["route"] == "/v1/chat/completions" and mine["status"] == 200 and mine["method"] == "POST"
    assert mine["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and mine["completion_tokens"] == 2
    assert mine["finish_reason"] == "length" and mine["latency_ms"] > 0


def test_chunked_upload_over_limit_is_413(server: LiveServer) -> None:
    def chunks() -> Any:
        for _ in range(40):
            yield b"x" * 10_000  # 400 kB without a Content-Length, over the 256 kB cap

    r = httpx.post(
        server.url + "/v1/chat/completions", content=chunks(), headers={**auth(), "content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_metrics_names_and_utility_routes(server: LiveServer, http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    text = http.get("/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_preemptions_total",
        'vllm:request_success_total{finished_reason="length"',
        "llmserve:client_disconnects_total",
    ):
        assert name in text, name
    m = server.metrics()
    assert m["vllm:generation_tokens_total"] >= 2 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat_tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tokens["count"] > 3  # the template's role markers are counted too
    assert API_KEY not in text


def test_big_prompts_are_tokenized_off_the_event_loop(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 MiB prompt takes seconds to tokenize: on the event loop it would stall every stream for that long."""
    tokenizer = server.app.state.engine.tokenizer
    original = tokenizer.apply_chat_template
    threads: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    small = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    big = http.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": "word " * 8000}]},
    )
    assert small.status_code == 200
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"  # 8000 words > 2048
    assert not threads[0].startswith("llmserve-tokenizer")  # small: inline, exact admission accounting
    assert threads[1].startswith("llmserve-tokenizer")


def test_metrics_show_the_process_memory(server: LiveServer) -> None:
    """prometheus-client's process collector: what an operator watches on a server that runs for weeks."""
    m = server.metrics()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    vm_rss = int(status["VmRSS"].split()[0]) * 1024  # the test process is the server's (uvicorn in a thread)
    rss = m["process_resident_memory_bytes"]
    assert 100 * 2**20 < rss < 64 * 2**30
    assert abs(rss - vm_rss) < max(64 * 2**20, vm_rss // 10)  # the same process, read a moment apart
    assert m["process_virtual_memory_bytes"] >= rss
    assert m["process_cpu_seconds_total"] > 0 and m["process_open_fds"] > 0
