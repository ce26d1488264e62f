"""Scheduler: token budget, chunked prefill, preemption and admission, driven without a model."""

import random

from model.engine.block_manager import BlockManager
from model.engine.scheduler import Scheduler
from model.engine.sequence import SamplingParams, Sequence, SequenceStatus


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    out = sched.schedule()
    sampled = [[token] for s in out.scheduled if s.samples]
    rows = sched.postprocess(out, sampled)
    for s in rows:
        if s.seq.num_output_tokens >= s.seq.params.max_tokens:
            sched.remove(s.seq)
    return [(s.seq.request_id, s.num_tokens) for s in out.scheduled]


def test_chunked_prefill_respects_the_token_budget_and_keeps_decodes_flowing() -> None:
    sched = Scheduler(BlockManager(200, 16), max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(Sequence(f"d{i}", [1] * 10, SamplingParams(max_tokens=50)))
    run_step(sched)  # the four prompts fit in one step (40 tokens)
    sched.add(Sequence("long", list(range(300)), SamplingParams(max_tokens=2)))
    for _ in range(5):  # 300 prompt tokens in chunks of 64 - 4
        rows = dict(run_step(sched))
        assert sum(rows.values()) <= 64
        assert all(rows[f"d{i}"] == 1 for i in range(4))  # every stream gets its token every step
        assert rows["long"] == 60
    rows = dict(run_step(sched))
    assert rows == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 1}  # the long prompt now decodes too


def test_preemption_recomputes_newest_and_everything_finishes() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)  # room for ~24 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(Sequence(f"s{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6)))
    finished: set[str] = set()
    for _ in range(100):
        if not sched.has_work():
            break
        out = sched.schedule()
        rows = sched.postprocess(out, [[3]] * sum(s.samples for s in out.scheduled))
        for s in rows:
            if s.seq.num_output_tokens >= 6:
                sched.remove(s.seq)
                finished.add(s.seq.request_id)
        assert bm.num_used <= 6
    assert finished == {"s0", "s1", "s2"}
    assert sched.num_preemptions > 0
    assert bm.num_free == 6


def test_max_num_seqs_caps_running() -> None:
    sched = Scheduler(BlockManager(100, 16), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(5):
        sched.add(Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3


def test_random_load_with_aborts_leaks_nothing() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=48)
    live: list[Sequence] = []
    for i in range(500):
        s = Sequence(
            f"r{i}",
            [rng.randrange(5) for _ in range(rng.randint(1, 40))],
            SamplingParams(max_tokens=rng.randint(1, 12)),
        )
        sched.add(s)
        live.append(s)
        if rng.random() < 0.2 and live:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                sched.remove(victim)
        out = sched.schedule()
        rows = sched.postprocess(out, [[rng.randrange(5)] for s in out.scheduled if s.samples])
        for r in rows:
            if r.seq.num_output_tokens >= r.seq.params.max_tokens:
                sched.remove(r.seq)
    while sched.has_work():
        run_step(sched)
    assert not sched.running and not sched.waiting
    assert bm.num_free == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert all(s.status == SequenceStatus.FINISHED for s in live)


def test_short_prompts_fill_the_budget_while_long_ones_go_one_chunk_at_a_time() -> None:
    sched = Scheduler(
        BlockManager(400, 16), max_num_seqs=16, max_num_batched_tokens=512, long_prefill_token_threshold=256
    )
    for i in range(4):
        sched.add(Sequence(f"short{i}", [1] * 146, SamplingParams(max_tokens=50)))
    rows = dict(run_step(sched))
    # three whole prompts and 74 tokens of the fourth: a burst of short prompts takes the whole budget
    assert rows == {"short0": 146, "short1": 146, "short2": 146, "short3": 74}
    run_step(sched)  # the fourth's last 72 tokens
    sched.add(Sequence("long0", list(range(1000)), SamplingParams(max_tokens=2)))
    sched.add(Sequence("long1", list(range(1000, 1900)), SamplingParams(max_tokens=2)))
    for _ in range(3):
        rows = dict(run_step(sched))
        assert all(rows[f"short{i}"] == 1 for i in range(4))  # the streams get their token every step
        assert rows["long0"] == 256 and "long1" not in rows  # one long prompt per step, in chunks of 256
    rows = dict(run_step(sched))  # long0's last chunk: still the step's one long prompt
    assert rows["long0"] == 232 and "long1" not in rows
    rows = dict(run_step(sched))
    assert rows["long0"] == 1 and rows["long1"] == 256
