"""One rank of the tensor-parallel family test, started by tests/parallel/test_tensor_parallel.py as torchrun would
start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):

    python -m tests.parallel.ranks JOB.json

For every family folder in the job, in step with the other ranks: (1) one prefill of every position through the
sharded decoder; (2) greedy generation through the real Engine on rank 0 (each step's inputs broadcast by its
ModelRunner), the other ranks inside ModelRunner.follow(). Rank 0 saves logits, tokens and parameter counts to
the job's output file; the test compares them with one rank's."""

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from config import Settings
from model.engine.engine import Engine
from model.engine.model_runner import ModelRunner, build_decoder
from model.loaders import load_config
from model.parallel import TensorParallel
from tests.model.families import make_tokenizer, our_logits

DECODE_STEPS = 12
ENGINE_PROMPTS = [[5 + (7 * i + 3 * j) % 90 for j in range(n)] for i, n in enumerate((48, 9, 61))]
PREFILL_PROMPTS = [[3 + (11 * i + 5 * j) % 93 for j in range(n)] for i, n in enumerate((5, 23, 50))]


def engine_settings(folder: Path, world_size: int) -> Settings:
    # max_num_batched_tokens 64: the 61-token prompt is prefilled in two chunks, the second reading the paged cache
    return Settings(model=str(folder), kv_cache_memory=4 * 2**20, block_size=16, max_num_batched_tokens=64,
                    tensor_parallel_size=world_size)  # fmt: skip


def greedy_with_logits(engine: Engine, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Greedy tokens of each prompt and the logits every one of them was sampled from: {"tokens", "logits"}."""
    captured: list[torch.Tensor] = []
    compute_logits = engine.runner.decoder.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        captured.append(logits.clone())
        return logits

    engine.runner.decoder.compute_logits = recording  # type: ignore[method-assign]
    from model.engine.sequence import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine._drain_inbox(False)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.scheduler.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return {"tokens": tokens, "logits": captured}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    tp = TensorParallel(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    tp.init_process_group("env://", "gloo", timeout_s=60)
    results: dict[str, Any] = {}
    for family, folder in job["families"].items():
        folder = Path(folder)
        decoder = build_decoder(folder, load_config(folder), 256, torch.float32, torch.device("cpu"), tp=tp)
        prefill = our_logits(decoder, PREFILL_PROMPTS)  # every rank runs it: the collectives pair up
        params = sum(p.numel() for p in decoder.parameters())
        del decoder
        settings = engine_settings(folder, tp.world_size)
        if tp.rank == 0:
            engine = Engine(settings, tokenizer=make_tokenizer(), tp=tp)
            results[family] = {"prefill": prefill, "params": params, **greedy_with_logits(engine, ENGINE_PROMPTS,
                                                                                           DECODE_STEPS)}  # fmt: skip
            engine.shutdown()  # sends STOP: the other ranks' follow() returns
        else:
            ModelRunner(settings, [], tp).follow()
    if tp.rank == 0:
        torch.save(results, job["output"])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
