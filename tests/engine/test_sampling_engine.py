"""Sampling through the whole engine: logprobs against a reference forward, seeds inside mixed batches."""

from collections.abc import Callable

import torch

from model.engine.engine import Engine
from model.engine.sequence import SamplingParams
from model.tokenizer import Tokenizer
from tests.engine.drive import run
from tests.model.test_smollm2_parity import single_sequence_batch

MakeEngine = Callable[..., Engine]


def collect_outputs(engine: Engine, rid: str, ids: list[int], params: SamplingParams) -> list:
    engine.add_request(rid, ids, params)
    outputs = engine._drain_inbox(block=False)
    while engine.scheduler.has_work():
        outputs += engine.step()
    return [o for o in outputs if o.request_id == rid]


@torch.inference_mode()
def test_logprobs_equal_log_softmax_of_a_reference_forward(
    make_engine: MakeEngine, default_tokenizer: Tokenizer
) -> None:
    engine = make_engine()
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=5)
    outputs = collect_outputs(engine, "lp", ids, params)
    generated = [t for o in outputs for t in o.new_token_ids]
    # Reference: one full forward over prompt + generated tokens, log-softmax in float64 at each sampled position.
    full = ids + generated[:-1]
    decoder = engine.runner.decoder
    ref = torch.log_softmax(decoder.compute_logits(decoder(single_sequence_batch(full))).double(), dim=-1)
    for step, out in enumerate(outputs):
        (lp,) = out.logprobs or []
        row = ref[len(ids) - 1 + step]
        assert lp.token_id == generated[step]
        assert abs(lp.logprob - row[lp.token_id].item()) <= 1e-3
        assert len(lp.top) == 5
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        expected_top = row.topk(5).indices.tolist()
        assert [t for t, _ in lp.top][:3] == expected_top[:3]


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(
    make_engine: MakeEngine, default_tokenizer: Tokenizer
) -> None:
    engine = make_engine(enable_prefix_caching=False)
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}])
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run(engine, {"s": (ids, seeded)})["s"]
    others = {
        f"o{i}": (
            default_tokenizer.apply_chat_template([{"role": "user", "content": f"Say something about number {i}."}]),
            SamplingParams(temperature=1.0, seed=None if i % 2 else 99 + i, max_tokens=12, ignore_eos=True),
        )
        for i in range(7)
    }
    batched = run(engine, {"s": (ids, seeded), **others})
    assert batched["s"] == alone
    again = run(engine, {"s": (ids, seeded)})["s"]
    assert again == alone
