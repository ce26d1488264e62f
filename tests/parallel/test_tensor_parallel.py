"""Tensor parallelism on CPU (gloo, 2 ranks) against the same model on one rank, for every family of
tests/model/families.py (Gemma 3's single KV head is the case of fewer KV heads than ranks: replicated) and a Llama
whose sizes do not divide by 2 (3 KV heads, 99 MLP columns, 97 vocabulary rows: uneven slices and a padded one).

Both ranks are started as torchrun would start them (tests/parallel/ranks.py); this process computes the one-rank
reference meanwhile. Then a hung rank: the engine stops with an error naming the timeout, it does not wait forever."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from config import Settings
from model.engine.engine import Engine
from model.engine.sequence import SamplingParams
from tests.model.families import BASE, FAMILIES, build_hf, load_ours, make_tokenizer, our_logits, randomize, save_hf
from tests.parallel.ranks import (
    DECODE_STEPS,
    ENGINE_PROMPTS,
    PREFILL_PROMPTS,
    engine_settings,
    greedy_with_logits,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = [*FAMILIES, "llama-uneven"]
# float32 sums in another order (each rank's partial products, then the all-reduce): at most 3.1e-6 observed here
TOL = 2e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(one rank's results, two ranks' results) per family: prefill logits, greedy tokens and their logits."""
    root = tmp_path_factory.mktemp("tensor-parallel")
    folders = {family: save_hf(build_hf(family), root / family) for family in FAMILIES}
    uneven = LlamaConfig(**{**BASE, "vocab_size": 97, "hidden_size": 48, "intermediate_size": 99,
                            "num_attention_heads": 6, "num_key_value_heads": 3})  # fmt: skip
    model = AutoModelForCausalLM.from_config(uneven, dtype=torch.float32)
    randomize(model)
    folders["llama-uneven"] = save_hf(model, root / "llama-uneven")
    job, output = root / "job.json", root / "two-ranks.pt"
    job.write_text(json.dumps({"families": {f: str(p) for f, p in folders.items()}, "output": str(output)}))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.parallel.ranks", str(job)], env={**env, "RANK": str(rank)}, cwd=ROOT
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        reference: dict[str, Any] = {}
        for family, folder in folders.items():
            decoder = load_ours(folder)
            prefill = our_logits(decoder, PREFILL_PROMPTS)
            params = sum(p.numel() for p in decoder.parameters())
            engine = Engine(engine_settings(folder, 1), tokenizer=make_tokenizer())
            reference[family] = {"prefill": prefill, "params": params,
                                 **greedy_with_logits(engine, ENGINE_PROMPTS, DECODE_STEPS)}  # fmt: skip
        for rank in ranks:
            assert rank.wait(timeout=300) == 0, "a rank failed: its output is above"
    finally:
        for rank in ranks:
            rank.kill()
    return reference, torch.load(output)


@pytest.mark.parametrize("family", MODELS)
def test_prefill_logits_equal_one_rank(runs: tuple[dict[str, Any], dict[str, Any]], family: str) -> None:
    one, two = runs[0][family], runs[1][family]
    for reference, logits in zip(one["prefill"], two["prefill"], strict=True):
        assert logits.shape == reference.shape  # [prompt length, vocab]: the padding of the vocab slices is cut
        assert (logits - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("family", MODELS)
def test_greedy_tokens_identical_and_step_logits_equal(
    runs: tuple[dict[str, Any], dict[str, Any]], family: str
) -> None:
    """Through the engine: chunked prefill, the paged KV cache (sharded by KV head) and decode steps."""
    one, two = runs[0][family], runs[1][family]
    assert two["tokens"] == one["tokens"]
    assert all(len(tokens) == DECODE_STEPS for tokens in two["tokens"].values())
    assert len(two["logits"]) == len(one["logits"])
    for reference, logits in zip(one["logits"], two["logits"], strict=True):
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("family", MODELS)
def test_each_rank_holds_about_half_of_the_weights(runs: tuple[dict[str, Any], dict[str, Any]], family: str) -> None:
    one, two = runs[0][family], runs[1][family]
    # not exactly half: norms are replicated, and so are Gemma 3's K/V projections (one KV head, two ranks)
    assert two["params"] < 0.65 * one["params"]


# the engine thread ends by re-raising the collective's error, which pytest reports as an unhandled thread exception
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_hung_rank_stops_the_engine_with_a_timeout_error(tmp_path: Path) -> None:
    folder = save_hf(build_hf("llama3"), tmp_path / "llama3")
    settings = Settings(model=str(folder), kv_cache_memory=4 * 2**20, tensor_parallel_size=2, distributed_timeout=3)
    engine = Engine(settings, tokenizer=make_tokenizer())
    assert engine.workers is not None
    child = engine.workers.procs[0]
    try:
        engine.start(lambda outputs: None)
        os.kill(child.pid, signal.SIGSTOP)  # alive, but answers nothing
        engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
        started = time.monotonic()
        while engine.is_alive and time.monotonic() - started < 30:
            time.sleep(0.1)
        assert not engine.is_alive, "the engine still waits on a rank that stopped answering"
        assert engine.failure is not None and "--distributed-timeout (3 s)" in engine.failure
        assert engine.stats().error == engine.failure
    finally:
        child.kill()
        engine.shutdown()


def test_a_rank_that_dies_while_loading_fails_start_up_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from model.engine import workers

    spawn = workers.WorkerGroup._spawn

    def spawn_then_kill(self: workers.WorkerGroup, port: int) -> None:
        spawn(self, port)
        self.procs[0].kill()  # dies before it has loaded anything

    monkeypatch.setattr(workers.WorkerGroup, "_spawn", spawn_then_kill)
    folder = save_hf(build_hf("llama3"), tmp_path / "llama3")
    settings = Settings(model=str(folder), kv_cache_memory=4 * 2**20, tensor_parallel_size=2, distributed_timeout=600)
    started = time.monotonic()
    with pytest.raises(workers.WorkerFailedError, match=r"rank 1 \(pid \d+\) was killed by signal 9 .* while loading"):
        Engine(settings, tokenizer=make_tokenizer())
    assert time.monotonic() - started < 60, "start-up waited for the timeout instead of watching its children"
