"""flash-attn against the exact torch path on a batch mixing prefill and decode (CUDA only; skipped elsewhere)."""

from collections.abc import Callable

import pytest
import torch

from model.engine.engine import Engine
from tests.engine.drive import greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("importlib").util.find_spec("flash_attn"),
    reason="needs CUDA and flash-attn",
)


@torch.inference_mode()
def test_flash_and_torch_backends_agree_on_mixed_batches(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda", dtype="bfloat16", block_size=256)
    runner = engine.runner
    assert runner.attention_backend == "flash-attn"
    for i, n in enumerate((40, 300, 7)):
        engine.add_request(f"r{i}", list(range(100, 100 + n)), greedy(8))
    engine._drain_inbox(block=False)
    engine.step()  # prefill all three
    engine.add_request("late", list(range(500, 900)), greedy(4))
    engine._drain_inbox(block=False)
    sched = engine.scheduler.schedule()  # three decodes + one prefill
    assert {s.num_tokens for s in sched.scheduled} == {1, 400}
    batch = runner.prepare(sched.scheduled)
    flash = runner.decoder.compute_logits(runner.decoder(batch))
    for layer in runner.decoder.layers:
        layer.self_attn.attn.use_flash = False
    batch = runner.prepare(sched.scheduled)  # with the torch path's decode views, which flash-attn needs not
    exact = runner.decoder.compute_logits(runner.decoder(batch))
    assert (flash - exact).abs().max().item() <= 0.1 * exact.abs().max().item()
    assert (flash.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.75
