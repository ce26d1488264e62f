"""Engine throughput without HTTP: N concurrent requests of ~P chat-templated prompt tokens and G generated tokens
(greedy, EOS ignored) run through `Engine.step()` directly, one concurrency level after another in one process.

    .venv/bin/python bench/engine_throughput.py                       # concurrency 1, 4, 16
    .venv/bin/python bench/engine_throughput.py --concurrency 1 16 --gen-tokens 64 -- --quantization int8
    .venv/bin/python bench/engine_throughput.py --threads 1 2 --concurrency 1 16   # thread counts side by side
    .venv/bin/python bench/engine_throughput.py --profile             # top torch ops over decode steps
    .venv/bin/python bench/engine_throughput.py --profile-prefill --skip-levels   # ... over a 16-prompt prefill

Flags after `--` are `llmserve serve` flags (Settings). Numbers on a shared 2-core machine are noisy: compare
levels measured in the same run (the ratio line), not runs taken at different times."""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `config`, `model` and `serve_bench` import
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from serve_bench import chat_messages  # noqa: E402  (same prompt text as the HTTP benchmark)

from config.settings import Settings, load_settings  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.sequence import SamplingParams  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    prompt_tokens: int  # mean per request
    output_tokens: int  # total
    seconds: float  # first add_request to last token
    prefill_seconds: float  # until every request had its first token
    decode_tokens: int  # tokens sampled after prefill_seconds
    steps: int
    decode_steps: int
    mean_batch: float  # sequences per decode step

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / max(self.seconds - self.prefill_seconds, 1e-9)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def ms_per_decode_step(self) -> float:
        return 1000 * (self.seconds - self.prefill_seconds) / max(self.decode_steps, 1)


def prompt_words(tokenizer: Tokenizer, index: int, target_tokens: int) -> int:
    """How many words request `index`'s message takes to chat-template within a few tokens of target_tokens (the
    last guess of eight where none comes that close). Each index gets different text, so no level reuses another's
    prefix from the cache."""
    words = max(1, int(target_tokens * 0.6))  # a first guess; the loop corrects it on the real tokenizer
    for attempt in range(8):
        count = len(tokenizer.apply_chat_template(chat_messages(index, words)))
        if abs(count - target_tokens) <= 1 or attempt == 7:
            break
        words = max(1, words + round((target_tokens - count) / 1.3))  # ~1.3 tokens per word of this text
    return words


def prompt_ids(engine: Engine, index: int, target_tokens: int) -> list[int]:
    """Chat-templated ids of request `index`, within a few tokens of target_tokens."""
    words = prompt_words(engine.tokenizer, index, target_tokens)
    return engine.tokenizer.apply_chat_template(chat_messages(index, words))


def add_requests(engine: Engine, first_index: int, n: int, prompt_tokens: int, gen_tokens: int) -> list[list[int]]:
    prompts = [prompt_ids(engine, first_index + i, prompt_tokens) for i in range(n)]
    submit(engine, prompts, gen_tokens, f"bench-{first_index}")
    return prompts


def submit(engine: Engine, prompts: list[list[int]], gen_tokens: int, tag: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    engine._drain_inbox(False)  # the step loop's own intake, without its worker thread


def run_level(engine: Engine, first_index: int, n: int, prompt_tokens: int, gen_tokens: int) -> LevelResult:
    prompts = [prompt_ids(engine, first_index + i, prompt_tokens) for i in range(n)]
    return run_prompts(engine, prompts, gen_tokens, f"bench-{first_index}")


def run_prompts(engine: Engine, prompts: list[list[int]], gen_tokens: int, tag: str) -> LevelResult:
    """Submit every prompt at once and step the engine until all are done."""
    n = len(prompts)
    submit(engine, prompts, gen_tokens, tag)
    started = time.perf_counter()
    first_token_seen: set[str] = set()
    prefill_done = 0.0
    steps = decode_steps = output_tokens = decode_tokens = batch_sum = 0
    while engine.scheduler.has_work():
        outs = engine.step()
        steps += 1
        new_tokens = sum(len(o.new_token_ids) for o in outs)
        output_tokens += new_tokens
        if prefill_done:  # every prompt is in: this was a pure decode step
            decode_steps += 1
            decode_tokens += new_tokens
            batch_sum += len(outs)
        else:
            first_token_seen.update(o.request_id for o in outs)
            if len(first_token_seen) == n:
                prefill_done = time.perf_counter() - started
    seconds = time.perf_counter() - started
    return LevelResult(
        concurrency=n,
        prompt_tokens=sum(map(len, prompts)) // n,
        output_tokens=output_tokens,
        seconds=seconds,
        prefill_seconds=prefill_done,
        decode_tokens=decode_tokens,
        steps=steps,
        decode_steps=decode_steps,
        mean_batch=batch_sum / max(decode_steps, 1),
    )


def print_table(results: list[LevelResult]) -> None:
    print(
        "| streams | prompt tok | output tok/s | decode tok/s | steps/s "
        "| ms/decode step | mean batch | prefill s | total s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.concurrency} | {r.prompt_tokens} | {r.output_tps:.1f} | {r.decode_tps:.1f} | {r.steps_per_s:.1f} | "
            f"{r.ms_per_decode_step:.1f} | {r.mean_batch:.1f} | {r.prefill_seconds:.2f} | {r.seconds:.1f} |"
        )
    base = next((r for r in results if r.concurrency == 1), None)
    top = max(results, key=lambda r: r.concurrency)
    if base is not None and top is not base:
        print(
            f"\n{top.concurrency} vs 1 streams: output tok/s x{top.output_tps / base.output_tps:.2f}, "
            f"decode tok/s x{top.decode_tps / base.decode_tps:.2f} "
            "(issue 3 target: decode x6; single stream >= 35 tok/s)"
        )


def profile_prefill(engine: Engine, n: int, prompt_tokens: int, row_limit: int) -> None:
    """torch.profiler over the steps that prefill n requests submitted at once (chunks of max_num_batched_tokens,
    with the decodes of those already prefilled)."""
    from torch.profiler import ProfilerActivity, profile

    add_requests(engine, 2_000_000, n, prompt_tokens, gen_tokens=2)
    steps = 0
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        while (
            any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            engine.step()
            steps += 1
        wall = time.perf_counter() - started
    while engine.scheduler.has_work():
        engine.step()
    averages = prof.key_averages()
    op_cpu_us = sum(e.self_cpu_time_total for e in averages)
    print(f"\n## torch.profiler: prefill of {n} x ~{prompt_tokens} tokens, {steps} steps, {wall:.2f} s wall")
    print(f"(self CPU time of all recorded ops: {op_cpu_us / 1e6:.2f} s; the rest is Python outside torch ops)\n")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=row_limit))
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40
        )
    )


def profile_decode(engine: Engine, n: int, prompt_tokens: int, num_steps: int, row_limit: int) -> None:
    """Prefill n requests, then run torch.profiler over num_steps pure decode steps."""
    from torch.profiler import ProfilerActivity, profile

    add_requests(engine, 1_000_000, n, prompt_tokens, gen_tokens=num_steps + 8)
    while (
        any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - started
    while engine.scheduler.has_work():  # finish the rest so the engine is left empty
        engine.step()
    averages = prof.key_averages()
    op_cpu_us = sum(e.self_cpu_time_total for e in averages)
    print(f"\n## torch.profiler: {num_steps} decode steps at {n} streams, {1000 * wall / num_steps:.1f} ms/step wall")
    print(
        f"(self CPU time of all recorded ops: {op_cpu_us / 1000 / num_steps:.1f} ms/step; "
        "the rest is Python outside torch ops)\n"
    )
    print(averages.table(sort_by="self_cpu_time_total", row_limit=row_limit))
    # The same ops split by input shapes: which matrix product (LM head, MLP, QKV) the time goes to.
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40
        )
    )


def bench_settings(argv: list[str]) -> Settings:
    """Settings from `llmserve serve` flags, with the default model fetched when none is named."""
    _, settings = load_settings(argv)
    if not settings.model:
        from config.default_model import ensure_default_model

        ensure_default_model(settings.models_dir)
    return settings


def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="streams per level")
    parser.add_argument("--prompt-tokens", type=int, default=146, help="chat-templated prompt tokens per request")
    parser.add_argument("--gen-tokens", type=int, default=128, help="generated tokens per request (EOS ignored)")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[], help="torch thread counts to compare, level by level, in one run"
    )
    parser.add_argument(
        "--profile", action="store_true", help="after the levels, profile decode steps with torch.profiler"
    )
    parser.add_argument(
        "--profile-prefill", action="store_true", help="after the levels, profile a prefill with torch.profiler"
    )
    parser.add_argument("--profile-concurrency", type=int, default=16, help="streams while profiling")
    parser.add_argument("--profile-steps", type=int, default=20, help="decode steps to profile")
    parser.add_argument("--skip-levels", action="store_true", help="only profile")
    args = parser.parse_args(own)

    settings = bench_settings(["serve", *server_flags])
    engine = Engine(settings)
    # the decode step compiles in the background while a server would serve eagerly; measure the steady state
    engine.runner.wait_compiled()
    print(f"# engine throughput\n\n{engine.describe()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"prompt ~{args.prompt_tokens} tokens, {args.gen_tokens} generated (greedy, EOS ignored), "
        f"max_num_batched_tokens={settings.max_num_batched_tokens}\n"
    )

    run_level(engine, -1, 1, args.prompt_tokens, 8)  # warm-up: first-call allocations and kernel selection
    # Thread counts alternate within each level, so a change in machine load hits all of them alike.
    thread_counts = args.threads or [torch.get_num_threads()]
    results: dict[int, list[LevelResult]] = {t: [] for t in thread_counts}
    next_index = 0
    for n in [] if args.skip_levels else args.concurrency:
        for t in thread_counts:
            torch.set_num_threads(t)
            results[t].append(run_level(engine, next_index, n, args.prompt_tokens, args.gen_tokens))
            next_index += n
            print(
                f"  {n} streams, {t} threads: {results[t][-1].output_tps:.1f} output tok/s", file=sys.stderr, flush=True
            )
    for t, rows in results.items():
        if rows:
            print(f"\n## {t} threads\n" if len(results) > 1 else "")
            print_table(rows)
    torch.set_num_threads(thread_counts[0])
    if args.profile_prefill:
        profile_prefill(engine, args.profile_concurrency, args.prompt_tokens, row_limit=20)
    if args.profile:
        profile_decode(engine, args.profile_concurrency, args.prompt_tokens, args.profile_steps, row_limit=15)


if __name__ == "__main__":
    main()
