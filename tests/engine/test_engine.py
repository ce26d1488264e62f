"""The engine on the real default model: batching, the paged KV cache, prefix reuse, preemption, chunked prefill."""

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from model.engine.engine import Engine
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import Sequence
from model.tokenizer import Tokenizer
from tests.engine.drive import greedy, run

MakeEngine = Callable[..., Engine]


def prompt_ids(tokenizer: Tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = ["river", "mountain", "copper", "violet", "engine", "lantern", "orbit", "harbor", "maple", "signal"]
    text = " ".join(rng.choice(words) for _ in range(n))
    return tokenizer.encode(text, add_special_tokens=False)[:n]


@torch.inference_mode()
def test_cached_decoding_equals_full_recompute(make_engine: MakeEngine, default_tokenizer: Tokenizer) -> None:
    engine = make_engine(enable_prefix_caching=False, block_size=16)
    ids = prompt_ids(default_tokenizer, 37, seed=1)
    seq = Sequence("a", ids, greedy(12))
    engine.scheduler.add(seq)
    step_logits = []
    for _ in range(12):  # prefill, then 11 decode steps through the paged cache
        out = engine.scheduler.schedule()
        logits = engine.runner.decoder.compute_logits(engine.runner.decoder(engine.runner.prepare(out.scheduled)))
        step_logits.append(logits[0])
        engine.scheduler.postprocess(out, [[int(logits[0].argmax())]])
    # Full recompute: one prefill of the whole sequence, logits at every position.
    full = Sequence("b", seq.token_ids[:-1], greedy(1))
    bm = engine.block_manager
    bm.allocate_prompt(full)
    bm.append(full, len(full))
    batch = engine.runner.prepare([ScheduledSeq(full, len(full))])
    batch.logits_indices = torch.arange(len(full))
    ref = engine.runner.decoder.compute_logits(engine.runner.decoder(batch))
    for i, logits in enumerate(step_logits):
        assert (logits - ref[len(ids) - 1 + i]).abs().max().item() <= 1e-4


def test_staggered_batch_gives_each_request_its_solo_tokens(
    make_engine: MakeEngine, default_tokenizer: Tokenizer
) -> None:
    engine = make_engine(max_num_batched_tokens=256)
    requests = {f"r{i}": (prompt_ids(default_tokenizer, 5 + 9 * i, seed=i), greedy(8)) for i in range(16)}
    solo = {rid: run(engine, {rid: req})[rid] for rid, req in requests.items()}
    engine = make_engine(max_num_batched_tokens=256, enable_prefix_caching=False)
    together = run(engine, requests, arrival_step={rid: i // 2 for i, rid in enumerate(requests)})
    assert together == solo


def test_shared_prefix_is_computed_once(make_engine: MakeEngine, default_tokenizer: Tokenizer) -> None:
    prefix = prompt_ids(default_tokenizer, 200, seed=7)
    first = prefix + prompt_ids(default_tokenizer, 20, seed=8)
    second = prefix + prompt_ids(default_tokenizer, 30, seed=9)
    engine = make_engine(record_steps=True)
    run(engine, {"first": (first, greedy(4))})
    steps_before = len(engine.step_records or [])
    with_cache = run(engine, {"second": (second, greedy(8))})["second"]
    prefill_tokens = (engine.step_records or [])[steps_before].rows[0][1]
    assert prefill_tokens == len(second) - 192  # 12 full blocks of 16 reused
    assert engine.stats().prefix_cache_hits == 192
    without_cache = run(make_engine(enable_prefix_caching=False), {"second": (second, greedy(8))})["second"]
    assert with_cache == without_cache


def test_preemption_under_memory_pressure_changes_no_output(
    make_engine: MakeEngine, default_tokenizer: Tokenizer
) -> None:
    requests = {f"r{i}": (prompt_ids(default_tokenizer, 40 + i, seed=20 + i), greedy(24)) for i in range(12)}
    unconstrained = make_engine(max_num_batched_tokens=1024)
    reference = run(unconstrained, requests)
    c = unconstrained.runner.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    tight = make_engine(kv_cache_memory=per_token * 16 * 9, max_num_batched_tokens=1024)  # 9 blocks: ~2 sequences
    constrained = run(tight, requests)
    assert constrained == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_aborts_and_random_load_leak_no_blocks(make_engine: MakeEngine, default_tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    engine = make_engine(kv_cache_memory=32 * 2**20, max_num_seqs=8)
    requests = {
        f"r{i}": (prompt_ids(default_tokenizer, rng.randint(3, 60), seed=100 + i), greedy(rng.randint(1, 6)))
        for i in range(60)
    }
    arrivals = {rid: i // 3 for i, rid in enumerate(requests)}
    aborts = {rid: arrivals[rid] + rng.randint(0, 3) for rid in requests if rng.random() < 0.25}
    run(engine, requests, arrival_step=arrivals, abort_at=aborts)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine._sequences and not engine._generators


def test_long_prefill_never_starves_running_streams(make_engine: MakeEngine, default_tokenizer: Tokenizer) -> None:
    engine = make_engine(record_steps=True, max_num_batched_tokens=512)
    requests: dict[str, Any] = {f"s{i}": (prompt_ids(default_tokenizer, 20, seed=40 + i), greedy(12)) for i in range(4)}
    requests["long"] = (prompt_ids(default_tokenizer, 2000, seed=50), greedy(2))
    run(engine, requests, arrival_step={"long": 2})
    records = engine.step_records or []
    long_steps = [i for i, r in enumerate(records) if any(rid == "long" and n > 1 for rid, n in r.rows)]
    assert len(long_steps) >= 4  # the 2,000-token prompt was split into chunks
    for i in long_steps:
        rows = dict(records[i].rows)
        assert all(rows.get(f"s{k}") == 1 for k in range(4))  # every stream got a token in that step
        assert sum(rows.values()) <= 512


def test_request_that_can_never_fit_is_rejected_up_front(make_engine: MakeEngine) -> None:
    engine = make_engine(kv_cache_memory=2**20, max_model_len=4096)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("big", [1] * 1000, greedy(10))
    with pytest.raises(ValueError, match="maximum context length is 4096"):
        engine.add_request("long", [1] * 4000, greedy(200))
