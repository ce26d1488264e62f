"""Tensor parallelism on this machine's CPU cores: N ranks of T threads against one process of N x T threads, on the
same dense float32 model, at each concurrency level (engine only, no HTTP; bench/engine_throughput.py's levels).

    .venv/bin/python bench/tensor_parallel.py                     # 2 ranks x 1 thread vs 1 process x 2 threads
    .venv/bin/python bench/tensor_parallel.py --quick             # 1 and 16 streams, 32 generated tokens
    .venv/bin/python bench/tensor_parallel.py --concurrency 1 16 --gen-tokens 64 -- --model my.gguf
    .venv/bin/python bench/tensor_parallel.py -- --cpu-all-reduce gloo   # gloo's all-reduce instead of shared memory

Both engines live in this process (it is rank 0 of the parallel one; its other ranks are child processes) and the
levels alternate between them, so a change in machine load hits both alike. Rank 0's time inside all-reduces
includes waiting for the slowest rank: with uneven slices (SmolLM2's 3 KV heads over 2 ranks) that is where the
imbalance shows, and so does the time a rank waits to be scheduled again on a busy machine. A last table times bare
all-reduces of one step's shapes between two otherwise idle processes, through gloo and through shared memory (the
collectives' own latency here and now).
Flags after `--` are `llmserve serve` flags for both engines."""

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from engine_throughput import LevelResult, bench_settings, run_level  # noqa: E402

from model.engine.engine import Engine  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402


@dataclass(slots=True)
class Row:
    name: str
    level: LevelResult
    all_reduce_ms: float  # per step, rank 0
    all_reduces: float  # per step
    broadcast_ms: float  # per step: sending the step's inputs


def measure(name: str, engine: Engine, threads: int, first_index: int, n: int, prompt: int, gen: int) -> Row:
    torch.set_num_threads(threads)
    stats = engine.runner.tp.stats
    before = (stats.all_reduce_seconds, stats.all_reduce_calls, stats.broadcast_seconds)
    level = run_level(engine, first_index, n, prompt, gen)
    steps = max(level.steps, 1)
    return Row(
        name,
        level,
        1000 * (stats.all_reduce_seconds - before[0]) / steps,
        (stats.all_reduce_calls - before[1]) / steps,
        1000 * (stats.broadcast_seconds - before[2]) / steps,
    )


def _all_reduce_rank(
    rank: int, world_size: int, port: int, shapes: list[tuple[int, int]], iters: int, out: dict
) -> None:
    torch.set_num_threads(1)
    tp = TensorParallel(rank, world_size)
    tp.init_process_group(f"tcp://127.0.0.1:{port}", "gloo", 60, shared_memory=True)
    assert tp._shm is not None
    for name, reduce in (("gloo", dist.all_reduce), ("shared memory", tp._shm.all_reduce)):
        for rows, cols in shapes:
            x = torch.randn(rows, cols)
            times = []
            for _ in range(iters):
                started = time.perf_counter()
                reduce(x)
                times.append(time.perf_counter() - started)
            if rank == 0:
                times.sort()
                out[(name, rows, cols)] = (statistics.median(times), times[int(0.9 * len(times))])
    dist.destroy_process_group()


def all_reduce_latency(world_size: int, shapes: list[tuple[int, int]], iters: int = 300) -> dict:
    """(median, p90) seconds of one all-reduce per (gloo or shared memory, shape), between world_size fresh
    processes doing nothing else."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_reduce_rank, args=(world_size, port, shapes, iters, out), nprocs=world_size)
        return dict(out)


def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="streams per level")
    parser.add_argument("--prompt-tokens", type=int, default=146)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="levels run this many times per engine, alternating")
    parser.add_argument("--quick", action="store_true", help="--gen-tokens 32")
    args = parser.parse_args(own)
    gen = 32 if args.quick else args.gen_tokens
    ranks, per_rank = args.ranks, args.threads_per_rank

    # dense float32 and eager steps in both, whatever the single-process defaults are (ranks run that way); a long
    # timeout, since the parallel engine's ranks wait idle while the other engine runs its level (no engine thread
    # sends heartbeats here)
    flags = ["serve", "--dtype", "float32", "--quantization", "none", "--no-torch-compile", "--distributed-timeout",
             "3600", *server_flags]  # fmt: skip
    single = Engine(bench_settings([*flags, "--num-threads", str(ranks * per_rank)]))
    parallel = Engine(bench_settings([*flags, "--num-threads", str(per_rank), "--tensor-parallel-size", str(ranks)]))
    engines = [(f"1 process x {ranks * per_rank} threads", single, ranks * per_rank),
               (f"{ranks} ranks x {per_rank} thread{'s' if per_rank > 1 else ''}", parallel, per_rank)]  # fmt: skip
    print(f"# tensor parallelism, CPU\n\n{parallel.describe()}, all-reduce: {parallel.runner.tp.all_reduce_backend}")
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"prompt ~{args.prompt_tokens} tokens, {gen} generated (greedy, EOS ignored), {time.strftime('%Y-%m-%d')}\n"
    )
    for _, engine, threads in engines:  # warm-up: first-call allocations and kernel selection
        torch.set_num_threads(threads)
        run_level(engine, -1, 1, args.prompt_tokens, 8)
    rows: list[Row] = []
    index = 0
    for n in args.concurrency:
        for _ in range(args.repeats):
            for name, engine, threads in engines:
                rows.append(measure(name, engine, threads, index, n, args.prompt_tokens, gen))
                index += n
                print(f"  {name}, {n} streams: {rows[-1].level.output_tps:.1f} tok/s", file=sys.stderr, flush=True)
    print("| setup | streams | output tok/s | decode tok/s | ms/decode step | all-reduce ms/step | all-reduces/step "
          "| step broadcast ms/step |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lv = r.level
        print(
            f"| {r.name} | {lv.concurrency} | {lv.output_tps:.1f} | {lv.decode_tps:.1f} | {lv.ms_per_decode_step:.1f} "
            f"| {r.all_reduce_ms:.2f} | {r.all_reduces:.0f} | {r.broadcast_ms:.2f} |"
        )
    for _, engine, _ in engines:
        engine.shutdown()

    hidden = parallel.runner.config.hidden_size
    shapes = [(1, hidden), (16, hidden), (146, hidden)]  # a decode row, 16 decode rows, a prompt chunk
    print(f"\nbare all-reduce, {ranks} processes, float32, load average {os.getloadavg()[0]:.1f}:\n")
    print("| all-reduce | shape | median us | p90 us |\n|---|---|---:|---:|")
    for (name, rows, cols), (median, p90) in all_reduce_latency(ranks, shapes).items():
        print(f"| {name} | [{rows}, {cols}] | {1e6 * median:.0f} | {1e6 * p90:.0f} |")


if __name__ == "__main__":
    main()
