"""A server with speculative decoding, through the openai SDK: the same answers as the session's plain server,
streamed (several tokens per step arrive as text), with stop strings, logprobs, n, tools and a client that leaves."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from config.settings import Settings
from model.tokenizer import Tokenizer
from tests.server.harness import API_KEY, MODEL, LiveServer, start_server, stop_server, wait_until_idle

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 8})
PARAGRAPH = (
    "Our garden has three apple trees, two pear trees and a small pond with goldfish. Every spring the "
    "trees blossom and every autumn we pick the fruit together."
)
ASK = [{"role": "user", "content": "Repeat this paragraph exactly:\n" + PARAGRAPH}]


@pytest.fixture(scope="module")
def spec_server(default_model_path: Path, default_tokenizer: Tokenizer) -> Iterator[LiveServer]:
    from model.engine.engine import Engine

    settings = Settings(
        models_dir=default_model_path.parent,
        api_key=API_KEY,
        max_model_len=2048,
        kv_cache_memory=128 * 1024 * 1024,
        speculative_config=SPEC,
    )
    live, thread = start_server(settings, engine_factory=lambda s: Engine(s, tokenizer=default_tokenizer))
    yield live
    stop_server(live, thread)


@pytest.fixture(scope="module")
def spec_client(spec_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=spec_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def both(client: openai.OpenAI, spec_client: openai.OpenAI, **kwargs: Any) -> tuple[Any, Any]:
    return (
        client.chat.completions.create(model=MODEL, **kwargs),
        spec_client.chat.completions.create(model=MODEL, **kwargs),
    )


def test_same_answers_streamed_and_whole(
    client: openai.OpenAI, spec_client: openai.OpenAI, spec_server: LiveServer
) -> None:
    plain, spec = both(client, spec_client, messages=ASK, max_tokens=60, temperature=0)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage and plain.usage and spec.usage.completion_tokens == plain.usage.completion_tokens
    pieces = [
        c.choices[0].delta.content or ""
        for c in spec_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == plain.choices[0].message.content
    m = spec_server.metrics()
    assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < m["llmserve:spec_decode_acceptance_rate"] <= 1


def test_stop_strings_logprobs_and_n(client: openai.OpenAI, spec_client: openai.OpenAI) -> None:
    plain, spec = both(
        client,
        spec_client,
        messages=ASK,
        max_tokens=60,
        temperature=0,
        stop=["pond"],
        logprobs=True,
        top_logprobs=2,
        n=2,
        seed=4,
    )
    for p, s in zip(plain.choices, spec.choices, strict=True):
        assert s.message.content == p.message.content and s.finish_reason == p.finish_reason == "stop"
        assert "pond" not in (s.message.content or "")
        assert [t.token for t in s.logprobs.content] == [t.token for t in p.logprobs.content]  # type: ignore[union-attr]


def test_tool_call_with_speculation(client: openai.OpenAI, spec_client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "save_note",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "maxLength": 200}},
                    "required": ["text"],
                },
            },
        }
    ]
    plain, spec = both(
        client,
        spec_client,
        messages=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = spec.choices[0].message.tool_calls or []
    assert spec.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.arguments == (plain.choices[0].message.tool_calls or [])[0].function.arguments
    assert isinstance(json.loads(calls[0].function.arguments)["text"], str)


def test_a_client_that_leaves_frees_everything(spec_client: openai.OpenAI, spec_server: LiveServer) -> None:
    stream = spec_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    m = wait_until_idle(spec_server)
    assert m["llmserve:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0
