"""Speculative decoding (prompt lookup) on the embedded model: the same tokens as without it, greedy and seeded,
alone and batched, constrained and preempted; the same distribution unseeded (chi-square); no leaked blocks."""

import json
from collections import Counter
from typing import Any

import pytest
import torch
from scipy.stats import chi2_contingency

from model.engine.engine import Engine
from model.engine.speculative import NgramProposer, SpeculativeConfig
from model.sampling_params import SamplingParams
from model.structured_output import GrammarSpec
from model.tokenizer import Tokenizer
from tests.engine.drive import run

SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "max_batch_size": 64,
    }
)
TEXT = "The lighthouse keeper climbed the spiral stairs at dusk and lit the great lamp. "
TASKS = ["Repeat this text exactly:\n", "Copy the following, word for word:\n", "Summarize:\n", "Quote it back:\n"]


@pytest.fixture(scope="module")
def plain(make_engine: Any) -> Engine:
    return make_engine()


@pytest.fixture(scope="module")
def spec(make_engine: Any) -> Engine:
    return make_engine(speculative_config=SPEC)


def grounded(tokenizer: Tokenizer, i: int) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": TASKS[i % len(TASKS)] + TEXT * (1 + i % 2)}])


def test_proposer_finds_the_latest_longest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 10) == [4, 5, 9]
    assert proposer.propose([5, 1, 2, 6, 1, 2, 7, 1, 2], 10) == [7, 1, 2]  # the latest occurrence
    assert proposer.propose([8, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3], 10) == [5, 7, 2]
    assert proposer.propose([1, 2, 3, 4, 1, 2], 1) == [3]  # within the limit
    assert proposer.propose([1, 2, 3], 5) == []


def test_config_parsing() -> None:
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse(SPEC) == SpeculativeConfig("ngram", 4, 4, 1, 64)
    draft = SpeculativeConfig.parse('{"method": "draft_model", "model": "/m.gguf", "num_speculative_tokens": 3}')
    assert draft is not None and (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model",
        "/m.gguf",
        3,
    )
    for bad in (
        '{"method": "eagle", "num_speculative_tokens": 2}',
        '{"method": "ngram"}',
        "[1]",
        '{"method": "draft_model", "num_speculative_tokens": 2}',
        '{"method": "ngram", "model": "/m.gguf", "num_speculative_tokens": 2}',
        '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
        '{"x": 1}',
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


def test_greedy_is_token_identical_alone_and_batched(plain: Engine, spec: Engine, default_tokenizer: Tokenizer) -> None:
    requests = {
        f"r{i}": (grounded(default_tokenizer, i), SamplingParams(temperature=0, max_tokens=24 + i)) for i in range(3)
    }
    open_question = [{"role": "user", "content": "What do lighthouse keepers do all day, and why?"}]  # rejections
    requests["r3"] = (
        default_tokenizer.apply_chat_template(open_question),
        SamplingParams(temperature=0, max_tokens=40),
    )
    reference = run(plain, requests)
    before = spec.stats()
    assert run(spec, requests) == reference
    for rid in ("r0", "r3"):
        assert run(spec, {rid: requests[rid]})[rid] == reference[rid]
    after = spec.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # it speculated, and some proposals were rejected
    assert after.kv_blocks_used == 0 and after.num_running == 0
    for rid, tokens in reference.items():
        assert len(tokens) <= requests[rid][1].max_tokens


def test_fewer_steps_than_tokens_when_copying(spec: Engine, default_tokenizer: Tokenizer) -> None:
    before = spec.stats()
    tokens = run(spec, {"r": (grounded(default_tokenizer, 1), SamplingParams(temperature=0, max_tokens=40))})["r"]
    steps = spec.stats().num_steps - before.num_steps
    assert steps < len(tokens), (steps, len(tokens))


def test_seeded_sampling_is_identical_with_and_without(
    plain: Engine, spec: Engine, default_tokenizer: Tokenizer
) -> None:
    """One uniform per output token, rewound after rejections: the seed decides the text, speculation or not."""
    requests = {
        f"s{i}": (
            grounded(default_tokenizer, i),
            SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24, logprobs=2),
        )
        for i in range(3)
    }
    reference = run(plain, requests)
    assert run(spec, requests) == reference
    assert run(spec, {"s1": requests["s1"]})["s1"] == reference["s1"]


def test_unseeded_distribution_matches(plain: Engine, spec: Engine, default_tokenizer: Tokenizer) -> None:
    """Chi-square on the 2nd to 4th sampled tokens of 128 unseeded samples each way (no shared generator), after a
    short repetitive prompt, so that the first token is often followed by proposals."""
    prompt = default_tokenizer.encode("red green blue red green blue red green blue red", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    counts = []
    drafted = spec.stats().spec_draft_tokens
    for engine in (plain, spec):
        outputs = run(engine, {f"u{i}": (prompt, params) for i in range(128)})
        counts.append(Counter(tuple(t[1:]) for t in outputs.values()))
    assert spec.stats().spec_draft_tokens > drafted + 64  # many samples had later tokens proposed
    keys = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    common, rest = keys[:6], keys[6:]
    table = [[c[k] for k in common] + [sum(c[k] for k in rest)] for c in counts]
    table = [list(col) for col in zip(*[col for col in zip(*table, strict=True) if sum(col) > 0], strict=True)]
    assert chi2_contingency(table).pvalue > 0.001, table


def test_logprobs_are_those_of_the_output_tokens(plain: Engine, spec: Engine, default_tokenizer: Tokenizer) -> None:
    prompt = grounded(default_tokenizer, 2)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    results = []
    for engine in (plain, spec):
        engine.add_request("lp", prompt, params)
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs += [o for o in engine._drain_inbox(block=False) + engine.step() if o.request_id == "lp"]
        results.append([(t, lp) for o in outputs for t, lp in zip(o.new_token_ids, o.logprobs or [], strict=True)])
    assert [t for t, _ in results[1]] == [t for t, _ in results[0]]
    for (token, a), (_, b) in zip(results[0], results[1], strict=True):
        assert a.token_id == b.token_id == token
        assert abs(a.logprob - b.logprob) < 1e-3 and [i for i, _ in a.top] == [i for i, _ in b.top]


def test_constrained_and_preempted(make_engine: Any, plain: Engine, default_tokenizer: Tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 80}},
        "required": ["text"],
        "additionalProperties": False,
    }
    c = plain.runner.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    tight = make_engine(speculative_config=SPEC, kv_cache_memory=per_token * 16 * 12, max_num_batched_tokens=1024)

    def requests(engine: Engine) -> dict[str, tuple[list[int], SamplingParams]]:
        constraint = engine.grammars.compile(GrammarSpec.json_schema(schema))
        out = {
            f"g{i}": (
                grounded(default_tokenizer, i),
                SamplingParams(temperature=0, max_tokens=48, constraint=constraint),
            )
            for i in range(2)
        }
        out.update(
            {
                f"p{i}": (grounded(default_tokenizer, i), SamplingParams(temperature=0, max_tokens=48))
                for i in range(2, 5)
            }
        )
        return out

    reference = run(plain, requests(plain))
    assert run(tight, requests(tight)) == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_used == 0
    for rid in ("g0", "g1"):
        text = default_tokenizer.decode(reference[rid], skip_special_tokens=True)
        assert set(json.loads(text)) == {"text"}


def test_speculation_stops_past_the_batch_threshold(make_engine: Any, default_tokenizer: Tokenizer) -> None:
    engine = make_engine(
        speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3, "max_batch_size": 2})
    )
    run(
        engine,
        {f"r{i}": (grounded(default_tokenizer, i), SamplingParams(temperature=0, max_tokens=6)) for i in range(4)},
    )
    assert engine.stats().spec_drafts == 0  # four running: over the threshold every step
    run(engine, {"r": (grounded(default_tokenizer, 0), SamplingParams(temperature=0, max_tokens=12))})
    assert engine.stats().spec_drafts > 0


def test_draft_model_proposals(
    make_engine: Any, plain: Engine, default_tokenizer: Tokenizer, default_model_path: Any, tmp_path: Any
) -> None:
    """The embedded model drafting for itself agrees almost always; a random draft with the same vocabulary
    almost never. Either way the output is the target's, and no block of either pool is left behind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    requests = {
        f"d{i}": (grounded(default_tokenizer, i), SamplingParams(temperature=0, max_tokens=20)) for i in range(2)
    }
    requests["s"] = (grounded(default_tokenizer, 2), SamplingParams(temperature=0.9, seed=5, max_tokens=20))
    reference = run(plain, requests)

    torch.manual_seed(0)
    random_draft = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=plain.runner.config.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
    )
    random_draft.save_pretrained(tmp_path / "draft")
    for draft_path, expect_high in ((default_model_path, True), (tmp_path / "draft", False)):
        config = json.dumps(
            {
                "method": "draft_model",
                "model": str(draft_path),
                "num_speculative_tokens": 3,
                "max_batch_size": 8,
                "draft_kv_cache_memory": 16 * 2**20,
            }
        )
        engine = make_engine(speculative_config=config)
        assert run(engine, requests) == reference
        stats = engine.stats()
        rate = stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1)
        assert stats.spec_draft_tokens > 0 and (rate > 0.7 if expect_high else rate < 0.3), rate
        assert stats.kv_blocks_used == 0
        assert engine.proposer is not None and engine.proposer.block_manager.num_used == 0  # type: ignore[union-attr]


def test_draft_model_with_another_vocabulary_is_refused(make_engine: Any, tmp_path: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "small")
    config = json.dumps({"method": "draft_model", "model": str(tmp_path / "small"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative_config=config)
