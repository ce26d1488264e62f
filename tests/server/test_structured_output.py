"""Structured output and tool calls through the real `openai` SDK over HTTP, on the embedded model.

Every constrained answer is checked against an independent validator (`jsonschema`, `json.loads`, `re`); tool calls
are checked for OpenAI's shape, and streamed calls reassembled with the SDK's own stream accumulator."""

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from model.tokenizer import Tokenizer
from tests.engine.schemas import schemas
from tests.server.harness import MODEL, LiveServer

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=50_000_000)  # bounded: a 135M model may otherwise repeat digits forever


def answers(client: openai.OpenAI, kwargs: dict[str, Any], stream: bool) -> tuple[list[str], list[str | None]]:
    """Each choice's text and finish reason, from chunks reassembled or from the whole answer."""
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return [c.message.content or "" for c in reply.choices], [c.finish_reason for c in reply.choices]
    texts, finish = [""] * kwargs["n"], [None] * kwargs["n"]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content or ""), City.model_json_schema())


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_sampled_hot_validates(client: openai.OpenAI, stream: bool) -> None:
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "score": {"type": "integer", "minimum": -5, "maximum": 100},
            "done": {"type": "boolean"},
        },
        "required": ["title", "tags", "score", "done"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "task", "schema": schema, "strict": True}}
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A task as JSON."}],
        response_format=response_format,
        max_tokens=150,
        temperature=1.4,
        n=3,
        seed=7,
    )
    texts, finish = answers(client, kwargs, stream)
    finished = [t for t, f in zip(texts, finish, strict=True) if f == "stop"]
    assert finished, f"no choice finished within max_tokens: {texts}"
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_and_completions_route(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with a JSON object like {"greeting": "hello"}.'}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0.8,
        n=4,
        seed=5,
    )
    finished = [c.message.content or "" for c in reply.choices if c.finish_reason == "stop"]
    assert finished, [c.message.content for c in reply.choices]
    assert all(isinstance(json.loads(text), dict) for text in finished)
    completion = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=8,
        temperature=1.0,
        extra_body={"guided_regex": r"[0-9]{3}-[A-Z]{2}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", completion.choices[0].text)


def test_vllm_structured_outputs_choice_and_grammar(http: httpx.Client) -> None:
    choices = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "I love it!"}],
                "temperature": 1.0,
                "max_tokens": 10,
                **body,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in choices
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "Is it?",
            "max_tokens": 5,
            "temperature": 1.2,
            "seed": 3,
            "structured_outputs": {"grammar": grammar},
        },
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"yes|no|maybe [0-9]", r.json()["choices"][0]["text"])


def test_model_may_be_omitted(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = http.post("/v1/completions", json={"model": "other-model", "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 404


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_tool_choice_required_and_named(client: openai.OpenAI, temperature: float) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=temperature, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls or [], {"get_weather", "get_time"})
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=temperature,
        seed=2,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls or []) == 1
    _check_calls(choice.message.tool_calls or [], {"get_time"})


def test_streamed_tool_call_deltas_reassemble(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    pieces: dict[int, dict[str, Any]] = {}
    finish = None
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type != "chunk":
                continue
            for c in event.chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    if d.index not in pieces:  # the first delta of a call: id, type and name
                        assert d.id and d.type == "function" and d.function and d.function.name
                        pieces[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                    else:
                        assert d.id is None and d.function and d.function.name is None
                    pieces[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        final = stream.get_final_completion().choices[0].message.tool_calls or []
    assert finish == "tool_calls"
    assert [(p["name"], p["arguments"]) for p in pieces.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert [(c.id, c.function.arguments) for c in final] == [(p["id"], p["arguments"]) for p in pieces.values()]


def test_tool_loop_call_result_answer(client: openai.OpenAI) -> None:
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    message = first.choices[0].message
    assert len(message.tool_calls or []) == 1
    messages.append(message.model_dump(exclude_none=True))
    call = (message.tool_calls or [])[0]
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}
    )
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    choice = answer.choices[0]
    # auto: the model chooses; either way no half-formed call shows up as text
    assert "<tool_call>" not in (choice.message.content or "")
    if choice.message.tool_calls:
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    else:
        assert choice.message.content


def test_tool_choice_auto_call_is_constrained(client: openai.OpenAI, default_tokenizer: Tokenizer) -> None:
    """Under "auto" the model chooses; a history that shows a call makes it open a tag again (it would write
    `<tool_response>`, so that word is banned), and from `<tool_call>` on the call is constrained and valid."""
    response_word = default_tokenizer.encode("<tool_response>", add_special_tokens=False)[3]
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": "What is the weather in Rome right now?"},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=120,
        temperature=0,
        logit_bias={str(response_word): -100},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls or [], {"get_weather", "get_time"})
    assert "tool_call" not in (choice.message.content or "")


def _error(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json={"max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_param(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = _error(http, "/v1/chat/completions", {"messages": ASK, **body})
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unsupported_keyword_is_named(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}
    error = _error(http, "/v1/chat/completions", {"messages": ASK, "guided_json": schema})
    assert "multipleOf" in error["message"] and error["param"] == "guided_json"
    # a property merely *named* like a keyword is fine
    ok = http.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "max_tokens": 30,
            "temperature": 0,
            "guided_json": {"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"]},
        },
    )
    assert ok.status_code == 200, ok.text


def test_grammar_cache_metrics(server: LiveServer, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"metric_probe": {"type": "integer"}}, "required": ["metric_probe"]}
    before = server.metrics()
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=20, temperature=0, extra_body={"guided_json": schema}
        )
    after = server.metrics()
    assert after["llmserve:grammar_cache_misses_total"] == before.get("llmserve:grammar_cache_misses_total", 0) + 1
    assert after["llmserve:grammar_cache_hits_total"] >= before.get("llmserve:grammar_cache_hits_total", 0) + 1


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=schemas, seed=st.integers(0, 2**31), temperature=st.floats(1.0, 1.5), stream=st.booleans())
def test_generated_schemas_over_http(
    client: openai.OpenAI, schema: dict[str, Any], seed: int, temperature: float, stream: bool
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "generated", "schema": schema}}
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        n=2,
        response_format=response_format,
        max_tokens=96,
        temperature=temperature,
        seed=seed,
    )
    texts, finish = answers(client, kwargs, stream)
    assert "stop" in finish, texts
    for text, reason in zip(texts, finish, strict=True):
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)


class GetWeather(BaseModel):
    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def test_parse_with_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    """The SDK's strict function tools: parsed_arguments come back as the model class."""
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.7,
        seed=3,
    )
    calls = completion.choices[0].message.tool_calls or []
    assert calls and completion.choices[0].finish_reason == "tool_calls"
    assert all(isinstance(call.function.parsed_arguments, GetWeather) for call in calls)
