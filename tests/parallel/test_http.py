"""A real llmserve at --tensor-parallel-size 2 on the default model (SmolLM2-135M GGUF: its 3 KV heads split 1 + 2
over the ranks), through the official openai SDK: streamed greedy text equals one rank's; then rank 1 is killed
with SIGKILL mid-stream and the stream ends with an error naming it, and the server stops instead of hanging."""

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from config.settings import Settings
from model.engine.engine import Engine
from model.engine.sequence import SamplingParams
from model.tokenizer import Tokenizer
from tests.engine.drive import run as drive
from tests.server.harness import LiveServer, start_server, stop_server

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
MAX_TOKENS = 24
LIMITS: dict[str, Any] = {"max_model_len": 1024, "kv_cache_memory": 64 * 2**20}


@pytest.fixture(scope="module")
def tp_server(default_model_path: Any) -> Iterator[tuple[LiveServer, threading.Thread]]:
    settings = Settings(models_dir=default_model_path.parent, tensor_parallel_size=2, distributed_timeout=30, **LIMITS)
    live, thread = start_server(settings)  # the production path: this process is rank 0 and starts rank 1
    yield live, thread
    stop_server(live, thread)


def test_streamed_greedy_text_equals_one_rank(
    tp_server: tuple[LiveServer, threading.Thread],
    make_engine: Callable[..., Engine],
    default_tokenizer: Tokenizer,
) -> None:
    live, _ = tp_server
    assert live.app.state.engine.runner.tp.world_size == 2
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)

    async def stream(question: str) -> str:
        chunks = await client.chat.completions.create(
            model=live.app.state.settings.model_name, messages=[{"role": "user", "content": question}],
            temperature=0, max_tokens=MAX_TOKENS, stream=True,
        )  # fmt: skip
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def all_at_once() -> list[str]:  # one batch across both ranks
        return await asyncio.gather(*(stream(q) for q in QUESTIONS))

    texts = asyncio.run(all_at_once())
    one_rank = make_engine(**LIMITS)
    prompts = {q: default_tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS}
    tokens = drive(
        one_rank, {q: (ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)) for q, ids in prompts.items()}
    )
    for question, text in zip(QUESTIONS, texts, strict=True):
        reference = tokens[question]
        if reference and reference[-1] in one_rank.eos_token_ids:
            reference = reference[:-1]
        assert text == default_tokenizer.decode(reference, skip_special_tokens=True)
    assert "Paris" in texts[0]
    metrics = live.metrics()
    assert metrics["llmserve:tensor_parallel_size"] == 2 and metrics["llmserve:all_reduce_seconds_total"] > 0


# the engine thread ends by re-raising the collective's error, which pytest reports as an unhandled thread exception
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_killing_a_rank_ends_streams_with_a_clear_error_and_stops_the_server(
    tp_server: tuple[LiveServer, threading.Thread],
) -> None:
    live, thread = tp_server
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": 900, "ignore_eos": True}  # fmt: skip
    lines: list[str] = []
    first_token = threading.Event()

    def read() -> None:
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if '"content"' in line:
                    first_token.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first_token.wait(60)
    rank1 = live.app.state.engine.workers.procs[0]
    os.kill(rank1.pid, signal.SIGKILL)
    killed = time.monotonic()
    reader.join(30)
    assert not reader.is_alive(), "the stream hangs after rank 1 died"
    assert time.monotonic() - killed < 10
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "engine_dead"
    assert "rank 1" in error["message"] and "SIGKILL" in error["message"], error["message"]

    thread.join(30)  # the server exits once the request in flight has its error (main() returns 1)
    assert not thread.is_alive(), "the server kept running without rank 1"
    assert "rank 1" in live.app.state.engine_failure
    # what /health answered meanwhile, asked of the app itself (the socket is closed now)

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=live.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tp") as client:
            return await client.get("/health")

    response = asyncio.run(health())
    assert response.status_code == 503
    assert "rank 1" in response.json()["error"]["message"] and "SIGKILL" in response.json()["error"]["message"]
