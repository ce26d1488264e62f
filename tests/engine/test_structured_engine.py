"""Constrained decoding through the engine on the embedded model: generated schemas sampled hot in batches mixed
with unconstrained rows, and under preemption. Every output that finishes validates with `jsonschema`."""

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.engine.engine import Engine
from model.sampling_params import SamplingParams
from model.structured_output import GrammarSpec
from model.tokenizer import Tokenizer
from tests.engine.drive import run
from tests.engine.schemas import schemas

EOS = 2  # SmolLM2's <|im_end|>: a constrained row that ends with it finished inside its grammar


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Engine:
    return make_engine()


def chat(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def check_outputs(tokenizer: Tokenizer, outputs: dict[str, list[int]], schema: dict[str, Any]) -> int:
    """Validate every constrained output that finished; return how many finished."""
    finished = 0
    for tokens in outputs.values():
        if tokens and tokens[-1] == EOS:
            finished += 1
            jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), schema)
    return finished


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=schemas, seed=st.integers(0, 2**31), temperature=st.floats(1.0, 1.5))
def test_generated_schemas_validate_when_sampled_hot(
    engine: Engine, default_tokenizer: Tokenizer, schema: dict[str, Any], seed: int, temperature: float
) -> None:
    constraint = engine.grammars.compile(GrammarSpec.json_schema(schema))
    prompt = chat(default_tokenizer, "Reply in JSON.")
    requests = {
        f"c{i}": (prompt, SamplingParams(temperature=temperature, seed=seed + i, max_tokens=96, constraint=constraint))
        for i in range(3)
    }
    requests["free"] = (prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=16))  # same batch
    outputs = run(engine, requests)
    free = outputs.pop("free")
    # bounded schemas: a sampled row that cannot finish in 96 tokens is rare, three in a row would be a bug
    assert check_outputs(default_tokenizer, outputs, schema) >= 1, [
        default_tokenizer.decode(t) for t in outputs.values()
    ]
    assert len(free) <= 16
    assert engine.stats().kv_blocks_used == 0


def test_most_hot_samples_finish_and_validate(engine: Engine, default_tokenizer: Tokenizer) -> None:
    """The property above skips outputs cut by max_tokens; this one shows that they are the exception."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "population", "sunny"],
        "additionalProperties": False,
    }
    constraint = engine.grammars.compile(GrammarSpec.json_schema(schema))
    prompt = chat(default_tokenizer, "Describe a city in JSON.")
    requests = {
        f"r{i}": (prompt, SamplingParams(temperature=1.5, seed=i, max_tokens=64, constraint=constraint))
        for i in range(12)
    }
    assert check_outputs(default_tokenizer, run(engine, requests), schema) >= 10


def test_constrained_greedy_is_batch_invariant_and_survives_preemption(
    make_engine: Any, engine: Engine, default_tokenizer: Tokenizer
) -> None:
    schemas_ = [
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "string", "maxLength": 10 + i},
                "n": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": [f"field_{i}", "n"],
            "additionalProperties": False,
        }
        for i in range(8)
    ]
    requests = {
        f"r{i}": (
            chat(default_tokenizer, f"Give me record number {i} as JSON, with some words."),
            SamplingParams(
                temperature=0, max_tokens=48, constraint=engine.grammars.compile(GrammarSpec.json_schema(schemas_[i]))
            ),
        )
        for i in range(8)
    }
    alone = {rid: run(engine, {rid: request})[rid] for rid, request in list(requests.items())[:2]}
    batched = run(engine, requests)
    assert {rid: batched[rid] for rid in alone} == alone

    c = engine.runner.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    tight = make_engine(kv_cache_memory=per_token * 16 * 8, max_num_batched_tokens=1024)  # ~2 sequences at once
    for rid, (prompt, params) in requests.items():  # the tight engine's own cache compiles the same schemas
        requests[rid] = (
            prompt,
            SamplingParams(
                temperature=0,
                max_tokens=48,
                constraint=tight.grammars.compile(params.constraint.spec),  # type: ignore[union-attr]
            ),
        )
    preempted = run(tight, requests)
    assert tight.stats().num_preemptions > 0
    assert preempted == batched
    for i in range(8):
        assert check_outputs(default_tokenizer, {"r": preempted[f"r{i}"]}, schemas_[i]) == 1
    assert tight.stats().kv_blocks_used == 0


def test_a_grammar_end_finishes_even_with_ignore_eos(engine: Engine, default_tokenizer: Tokenizer) -> None:
    constraint = engine.grammars.compile(GrammarSpec("choice", json.dumps(["alpha", "beta"])))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=5, constraint=constraint)
    tokens = run(engine, {"r": (chat(default_tokenizer, "Pick one."), params)})["r"]
    assert default_tokenizer.decode(tokens, skip_special_tokens=True) in ("alpha", "beta")
    assert tokens[-1] == EOS and len(tokens) < 30
