"""--torch-compile: the compiled decode steps give the eager step's logits and greedy tokens: the batched graph, whose
oneDNN-packed linears are a custom op, and the one-row graph, whose linears are GEMV loops over the plain weights;
both trace the paged attention, cache writes included."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from config import Settings
from model.batch import Batch
from model.engine.engine import Engine
from model.engine.model_runner import c_compiler_found
from tests.engine.drive import greedy, next_decode_step, run
from tests.model.families import build_hf, make_tokenizer, prompts, save_hf

pytestmark = pytest.mark.skipif(not c_compiler_found(), reason="torch.compile on CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # sliding-window layers, GQA, untied LM head: the attention op's window masks run inside the compiled step
    return save_hf(build_hf("mistral"), tmp_path_factory.mktemp("mistral"))


def engine(folder: Path, **overrides: object) -> Engine:
    settings = Settings(model=str(folder), kv_cache_memory=4 * 2**20, block_size=16, **overrides)
    e = Engine(settings, tokenizer=make_tokenizer())
    if settings.torch_compile:  # compiled in the background; taken over between requests
        assert e.runner.wait_compiled(timeout=600) and e.runner.compile_error is None
        assert e.runner.activate_compiled()
    return e


def test_compiled_decode_steps_give_eager_tokens(mistral_folder: Path) -> None:
    compiled = engine(mistral_folder, torch_compile=True)
    runner = compiled.runner
    assert runner.compiled_forward is not None and runner.compiled_one_row is not None and runner.compile_seconds > 0
    calls = {"batched": 0, "one_row": 0}

    def counting(kind: str, graph: Callable[[Batch], torch.Tensor]) -> Callable[[Batch], torch.Tensor]:
        def call(batch: Batch) -> torch.Tensor:
            calls[kind] += 1
            return graph(batch)

        return call

    runner.compiled_forward = counting("batched", runner.compiled_forward)
    runner.compiled_one_row = counting("one_row", runner.compiled_one_row)
    # staggered arrivals: single-stream steps, batched steps, and prompt steps (eager) between them; 40 tokens cross
    # the window of 16 and two KV blocks
    requests = {f"r{i}": (p, greedy(40)) for i, p in enumerate(prompts(lengths=(5, 23, 50, 9)))}
    arrivals = {"r0": 0, "r1": 3, "r2": 7, "r3": 30}
    with torch.compiler.set_stance("fail_on_recompile"):  # the graph traced at start-up serves every batch size
        got = run(compiled, requests, arrivals)
    want = run(engine(mistral_folder), requests, arrivals)
    assert got == want
    # most steps were decode-only and went through a compiled graph: one row alone at the start and at the end
    assert calls["batched"] > 30 and calls["one_row"] > 10, calls
    assert compiled.block_manager.num_used == 0


@pytest.mark.parametrize("rows", [3, 1])
def test_compiled_logits_match_eager_on_a_decode_batch(mistral_folder: Path, rows: int) -> None:
    e = engine(mistral_folder, torch_compile=True)
    scheduled = next_decode_step(e, prompts(lengths=(5, 23, 50)[:rows]), "r")
    runner = e.runner
    with torch.inference_mode():
        eager = runner.decoder.compute_logits(runner.decoder(runner.prepare(scheduled)))
        # a batch of its own, as every served step has: the eager forward filled the first one's rotary lookups,
        # and a graph would be traced anew for that
        batch = runner.prepare(scheduled)
        with torch.compiler.set_stance("fail_on_recompile"):
            if rows == 1:
                assert runner.compiled_one_row is not None
                compiled = runner.compiled_one_row(batch)
            else:
                compiled = runner.decoder.compute_logits(runner.compiled_forward(batch))
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_the_background_compile_takes_over_between_requests_only(mistral_folder: Path) -> None:
    """Eager steps serve while the compile runs in its thread (the layers must not take their graph-only paths
    then), and the compiled graphs take over at the first step with no running sequence."""
    settings = Settings(model=str(mistral_folder), kv_cache_memory=4 * 2**20, block_size=16, torch_compile=True)
    e = Engine(settings, tokenizer=make_tokenizer())
    runner = e.runner
    assert runner.decode_step_state == "compiling" and runner.compiled_forward is None
    eager = engine(mistral_folder)
    prompt = prompts(seed=7, lengths=(11,))[0]
    switched_while_running: list[bool] = []
    activate = runner.activate_compiled

    def recording_activate() -> bool:
        switched = activate()
        if switched:
            switched_while_running.append(bool(e.scheduler.running))
        return switched

    runner.activate_compiled = recording_activate  # type: ignore[method-assign]
    runner.start_compile()
    served_during_compile = 0
    while not runner.wait_compiled(timeout=0):  # requests one after another, each checked against an eager engine
        name = f"during-{served_during_compile}"
        assert run(e, {name: (prompt, greedy(24))}, {name: 0}) == run(eager, {name: (prompt, greedy(24))}, {name: 0})
        served_during_compile += 1
    assert runner.compile_error is None and served_during_compile > 0
    e.add_request("first", prompt, greedy(8))
    e._drain_inbox(block=False)
    e.step()  # nothing was running: the compiled graphs take over before this step, if not already
    assert runner.compiled_forward is not None and runner.decode_step_state == "compiled"
    assert switched_while_running == [False]
