"""The decode step compiled ahead of time (AOTInductor, in a child process): the same tokens and logits as the eager
step, the package bound to the runner's own weights and KV pool, and a later runner that finds the package runs
compiled from its first step. The model: Mistral (sliding-window layers, GQA, untied LM head) with plain linears,
which export (oneDNN-packed ones keep torch.compile, test_torch_compile.py)."""

from pathlib import Path

import pytest
import torch

from config import Settings
from model.engine import aot_step
from model.engine.engine import Engine
from model.engine.model_runner import c_compiler_found
from model.layers import group_kernels
from tests.engine.drive import greedy, next_decode_step, run
from tests.model.families import build_hf, make_tokenizer, prompts, save_hf

pytestmark = pytest.mark.skipif(not c_compiler_found(), reason="AOTInductor on CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(build_hf("mistral"), tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def engine(folder: Path, cache_dir: Path, compiled: bool) -> Engine:
    settings = Settings(
        model=str(folder),
        kv_cache_memory=4 * 2**20,
        block_size=16,
        prepack_weights=False,
        torch_compile=compiled,
        cache_dir=str(cache_dir),
    )
    return Engine(settings, tokenizer=make_tokenizer())


@pytest.fixture(scope="module")
def built(folder: Path, cache_dir: Path) -> Engine:
    e = engine(folder, cache_dir, compiled=True)
    assert e.runner.decode_step_state == "compiling" and e.runner.aot_step is None
    assert e.runner.wait_compiled(timeout=900) and e.runner.compile_error is None, e.runner.compile_error
    assert e.runner.activate_compiled() and e.runner.aot_step is not None
    return e


def test_ahead_of_time_steps_give_eager_tokens(built: Engine, folder: Path, cache_dir: Path) -> None:
    runner = built.runner
    assert runner.compiled_forward is None and runner.compiled_one_row is None  # no torch.compile graph
    calls = [0]
    step = runner.aot_step
    assert step is not None
    # through our ops (they release the GIL) wherever our kernel library loads
    assert step._ops == group_kernels.load(str(cache_dir))

    def counting(batch):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return step(batch)

    runner.aot_step = counting  # type: ignore[assignment]
    # staggered arrivals: one row alone, batches of 2-4 rows and prompt steps (eager) between them; 40 tokens cross
    # the window of 16 and two KV blocks
    requests = {f"r{i}": (p, greedy(40)) for i, p in enumerate(prompts(lengths=(5, 23, 50, 9)))}
    arrivals = {"r0": 0, "r1": 3, "r2": 7, "r3": 30}
    try:
        got = run(built, requests, arrivals)
    finally:
        runner.aot_step = step
    assert got == run(engine(folder, cache_dir, compiled=False), requests, arrivals)
    assert calls[0] > 40, calls
    assert built.block_manager.num_used == 0


@pytest.mark.parametrize("rows", [3, 1])
def test_ahead_of_time_logits_match_eager(built: Engine, rows: int) -> None:
    e = built
    scheduled = next_decode_step(e, prompts(seed=3, lengths=(5, 23, 50)[:rows]), f"l{rows}")
    runner = e.runner
    assert runner.aot_step is not None
    with torch.inference_mode():
        eager = runner.decoder.compute_logits(runner.decoder(runner.prepare(scheduled)))
        compiled = runner.aot_step(runner.prepare(scheduled))  # writes the same K/V again, then reads it
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    while e.scheduler.has_work():  # the 3 tokens each, so that the next test starts idle
        e.step()


def test_a_later_runner_loads_the_package_and_runs_compiled_at_once(built: Engine, folder: Path,
                                                                    cache_dir: Path) -> None:  # fmt: skip
    later = engine(folder, cache_dir, compiled=True)
    assert later.runner.aot_step is not None and later.runner.decode_step_state == "compiled"
    assert aot_step.package_path(later.runner._settings).exists()
    # the package reads this runner's KV pool and weights, not the first runner's
    requests = {"a": (prompts(seed=5, lengths=(17,))[0], greedy(20))}
    assert run(later, requests, {"a": 0}) == run(engine(folder, cache_dir, compiled=False), requests, {"a": 0})
