"""Drive an Engine synchronously, step by step, without its worker thread."""

from model.engine.engine import Engine
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import SamplingParams


def run(
    engine: Engine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    arrival_step: dict[str, int] | None = None,
    abort_at: dict[str, int] | None = None,
    max_steps: int = 10_000,
) -> dict[str, list[int]]:
    """Submit each request at its arrival step (default 0), step until all finish; return the tokens of each."""
    arrival_step = arrival_step or {}
    abort_at = abort_at or {}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    done: set[str] = set()
    for step in range(max_steps):
        for rid, (ids, params) in requests.items():
            if arrival_step.get(rid, 0) == step:
                engine.add_request(rid, ids, params)
        for rid, at in abort_at.items():
            if at == step:
                engine.abort(rid)
        outputs = engine._drain_inbox(block=False)
        if engine.scheduler.has_work():
            outputs += engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                done.add(out.request_id)
        if len(done) == len(requests) and step >= max(arrival_step.values(), default=0):
            return tokens
    raise AssertionError(f"requests did not finish in {max_steps} steps: {set(requests) - done}")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def next_decode_step(engine: Engine, prompts: list[list[int]], tag: str) -> list[ScheduledSeq]:
    """Submit `prompts` (3 greedy tokens each), step until all are prefilled, and return the next step's scheduled
    rows, one decode token each, without running it."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, greedy(3))
    engine._drain_inbox(block=False)
    running = engine.scheduler.running
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in running) or not running:
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert len(scheduled) == len(prompts) and all(s.num_tokens == 1 for s in scheduled)
    return scheduled
