"""The official `openai` SDK, sync and async, against the real server: every field it parses must come back right."""

import asyncio

import httpx
import openai
import pytest

from tests.server.harness import MODEL, LiveServer, run

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_factual_greedy_answer_non_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=16)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    assert reply.system_fingerprint and reply.system_fingerprint.startswith("fp_")
    assert reply.created > 1_700_000_000
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 5
    assert 1 <= reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details is not None and reply.usage.prompt_tokens_details.cached_tokens is not None


def test_streaming_equals_non_streaming_greedy(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks)


def test_include_usage_adds_a_last_chunk_without_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CAPITAL, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5 and last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None and len(c.choices) == 1 for c in body)


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI) -> None:
    system = {"role": "system", "content": "You are a helpful assistant who answers geography questions. " * 8}
    messages = [system, *CAPITAL]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full KV block came from the cache


def test_n_choices_and_seed_reproducibility(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(model=MODEL, messages=CAPITAL, n=3, seed=7, temperature=1.0, max_tokens=8)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage is not None and 3 <= r.usage.completion_tokens <= 24
        return [c.message.content or "" for c in r.choices]

    first = ask()
    assert first == ask()  # same seed, same samples
    assert len(set(first)) > 1  # but the n samples differ from each other


def test_stop_string_ends_the_answer_with_stop(client: openai.OpenAI) -> None:
    full = (
        client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=16)
        .choices[0]
        .message.content
    )
    assert full and " is " in full
    cut = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=16, stop=[" is "])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full.split(" is ")[0]
    streamed = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=16, stop=" is ", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full.split(" is ")[0]


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4  # greedy picks the most likely token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_developer_role_and_content_parts(client: openai.OpenAI) -> None:
    as_system = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=8,
        messages=[{"role": "system", "content": "Answer in one word."}, *CAPITAL],
    )
    as_developer = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=8,
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        ],
    )
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens  # type: ignore[union-attr]


def test_continue_final_message(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=6,
        messages=[*CAPITAL, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "Paris" in (r.choices[0].message.content or "")


def test_completions_variants(client: openai.OpenAI, http: httpx.Client) -> None:
    one = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    assert "Paris" in one.choices[0].text
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert as_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy: both samples of a prompt agree
    assert many.choices[0].text == one.choices[0].text[: len(many.choices[0].text)]
    id_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(id_lists.choices) == 2
    echo = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True
    )
    assert echo.choices[0].text == "The capital of France is" + one.choices[0].text


def test_completion_integer_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert 2 <= len(top) <= 3 and top[token] == logprob


def test_streaming_completion(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
        )
    )
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    assert "Paris" in "".join(c.choices[0].text for c in chunks)


def test_models_endpoints(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.code == "model_not_found"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_async_client_concurrent_streams_and_non_streams(server: LiveServer, aclient: openai.AsyncOpenAI) -> None:
    async def streamed() -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=CAPITAL, temperature=0, max_tokens=8, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole() -> str:
        r = await aclient.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=8)
        return r.choices[0].message.content or ""

    async def main() -> list[str]:
        return await asyncio.gather(*(streamed() for _ in range(4)), *(whole() for _ in range(4)))

    answers = run(main())
    assert len(set(answers)) == 1 and "Paris" in answers[0]  # batching never changes a greedy answer
