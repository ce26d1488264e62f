"""Start and talk to a real llmserve on 127.0.0.1 (uvicorn in a background thread) for the server tests."""

import asyncio
import contextlib
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from config.settings import Settings
from server.app import create_app
from server.serve import DrainingServer, make_server

API_KEY = "test-key-123"
ORIGIN = "http://allowed.example"
MODEL = Settings().model_name
PING_SECONDS = 0.2


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    server: DrainingServer

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator[None]:
        """Run a block with some settings changed (admission caps, API key); the app reads them per request."""
        original = self.app.state.settings
        self.app.state.settings = original.model_copy(update=changes)
        try:
            yield
        finally:
            self.app.state.settings = original

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=auth(), timeout=10).text
        return parse_metrics(text)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def parse_metrics(text: str) -> dict[str, float]:
    """{'vllm:num_requests_running': 0.0, 'vllm:request_success_total{finished_reason="stop"}': 3.0, ...};
    the model_name label, the same on every series, is dropped to keep keys short."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
        out[name] = float(value)
    return out


def launch(settings: Settings, **app_kwargs: Any) -> tuple[LiveServer, threading.Thread]:
    """Start serving in a background thread and return at once (the model may still be loading)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other processes
    port = sock.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    app = create_app(settings, **app_kwargs)
    server = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return LiveServer(f"http://127.0.0.1:{port}", app, server), thread


def start_server(settings: Settings, **app_kwargs: Any) -> tuple[LiveServer, threading.Thread]:
    """Start serving and wait until /health says the engine is ready."""
    live, thread = launch(settings, **app_kwargs)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if live.app.state.load_error:
            stop_server(live, thread)
            raise RuntimeError(live.app.state.load_error)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(live.url + "/health", timeout=2).status_code == 200:
                return live, thread
        time.sleep(0.2)
    stop_server(live, thread)
    raise RuntimeError("server did not become healthy in 240 s")


def stop_server(live: LiveServer, thread: threading.Thread) -> None:
    live.server.should_exit = True
    thread.join(timeout=60)


def free_port() -> int:
    """A loopback port free now, for a server process started next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 240) -> None:
    """Poll a server process's /health until it answers 200; fail with its output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.2)


def run(coro: Any) -> Any:
    """Run a coroutine to completion from a sync test (no pytest-asyncio in the dev dependencies)."""
    return asyncio.run(coro)


def wait_until_idle(server: LiveServer, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held; return the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["llmserve:kv_blocks_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
