"""Loading, load failure and engine death, with scripted engines in place of the real one (the HTTP side is real).

The scripted engine keeps the Engine contract (start/add_request/abort/stats/shutdown, outputs through the
on_outputs callback from another thread) so that the failure paths run exactly as they would with a real crash."""

import json
import threading
import time
from typing import Any

import httpx
import pytest

from config.settings import Settings
from model.engine.engine import EngineStats
from model.engine.sequence import StepOutput
from model.tokenizer import Tokenizer
from tests.server.harness import MODEL, LiveServer, launch, start_server, stop_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class ScriptedEngine:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 512
        self.alive = True
        self.requests: list[str] = []
        self.on_outputs: Any = None

    def describe(self) -> str:
        return "scripted engine"

    def start(self, on_outputs: Any) -> None:
        self.on_outputs = on_outputs

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.requests.append(request_id)

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        self.alive = False

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, self.alive)


def test_503_while_loading_then_exit_when_loading_fails() -> None:
    release = threading.Event()

    def slow_broken_factory(settings: Settings) -> Any:
        release.wait(60)
        raise FileNotFoundError("no weights here")

    live, thread = launch(Settings(), engine_factory=slow_broken_factory)
    try:
        health = _get_when_up(live.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "model_loading"
        chat = httpx.post(live.url + "/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.headers["retry-after"] == "5"
        assert chat.json()["error"]["code"] == "model_loading"
        preflight = httpx.options(
            live.url + "/v1/chat/completions",
            headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers  # CORS is off without --allowed-origins
        release.set()
        thread.join(30)
        assert not thread.is_alive(), "a server whose model failed to load must exit, not answer 503 forever"
        assert "no weights here" in live.app.state.load_error
    finally:
        release.set()
        stop_server(live, thread)


def _get_when_up(url: str) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_engine_death_mid_stream(server: LiveServer) -> None:
    engine = ScriptedEngine(server.app.state.engine.tokenizer)  # reuse the loaded tokenizer: no second load
    live, thread = start_server(Settings(), engine_factory=lambda settings: engine)
    try:
        lines: list[str] = []

        def read() -> None:
            with httpx.stream(
                "POST", live.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
            ) as r:
                lines.extend(r.iter_lines())

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hello = engine.tokenizer.encode("Hello")
        engine.on_outputs([StepOutput(engine.requests[0], hello, None, None, 5, 0)])  # as the worker thread would
        time.sleep(0.2)
        engine.alive = False  # the worker thread dies without a word
        reader.join(10)
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        contents = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[:-2]]
        assert "Hello" in contents
        error = json.loads(data[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error"
        assert httpx.get(live.url + "/health").status_code == 503
        after = httpx.post(live.url + "/v1/chat/completions", json=CHAT)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    finally:
        stop_server(live, thread)


@pytest.mark.parametrize("argv", [["serve", "--port", "9"], ["inspect"]])
def test_cli_parses_commands(argv: list[str]) -> None:
    from config.settings import load_settings

    command, settings = load_settings(argv)
    assert command == argv[0] and settings.model_name == MODEL
