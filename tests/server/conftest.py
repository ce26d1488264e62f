"""Fixtures of the server tests: one real llmserve for the whole session (loading the model is the slow part).

It runs with an API key, CORS for one origin and a short SSE ping interval, so the auth, CORS and ping tests need no
server of their own; tests that need other limits use `server.override(...)` for a block.
"""

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from config.settings import Settings
from model.tokenizer import Tokenizer
from tests.server.harness import API_KEY, ORIGIN, PING_SECONDS, LiveServer, auth, start_server, stop_server


@pytest.fixture(scope="session")
def server(default_model_path: Path, default_tokenizer: Tokenizer) -> Iterator[LiveServer]:
    settings = Settings(
        models_dir=default_model_path.parent,  # the default model, wherever pytest was started from
        api_key=API_KEY,
        allowed_origins=[ORIGIN],
        max_model_len=2048,
        kv_cache_memory=256 * 1024 * 1024,
        max_num_seqs=64,
        max_request_bytes=256 * 1024,
    )
    from model.engine.engine import Engine  # torch and the weights: only when a server test runs

    # The session's tokenizer (tests/conftest.py) saves a second load; the model is the default one either way.
    live, thread = start_server(
        settings, sse_ping_seconds=PING_SECONDS, engine_factory=lambda s: Engine(s, tokenizer=default_tokenizer)
    )
    yield live
    stop_server(live, thread)


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(server: LiveServer) -> openai.AsyncOpenAI:
    # Per test: an AsyncOpenAI holds an httpx pool bound to the event loop of the test that made it.
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=auth(), timeout=120) as c:
        yield c
