"""llmserve's engine against OpenVINO GenAI's, in process (no HTTP), on the same GGUF and the same prompts: one
stream's decode tok/s and N prompts' output tok/s, greedy, EOS ignored. Each round starts each engine afresh in a
child process of its own, alternating, so that neither engine's threads spin while the other runs; medians of rounds.

    .venv/bin/pip install openvino-genai==2026.4.1.0   # the peer only: llmserve does not depend on it
    .venv/bin/python bench/openvino_versus.py                         # 2 rounds, 1 and 16 prompts, 128 tokens
    .venv/bin/python bench/openvino_versus.py --rounds 3 -- --quantization none   # llmserve flags after `--`

The prompts are chat-templated text rendered once by llmserve's tokenizer (distinct per level and round);
OpenVINO GenAI gets that text with `apply_chat_template = False` and tokenizes it with the GGUF's own tokenizer.
OpenVINO runs its continuous-batching pipeline (a SchedulerConfig, prefix caching off) with an f16 KV cache.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

DEFAULT_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def level_result(n: int, prompt_tokens: float, seconds: float, decode_tps: float, ttft_s: float, gen: int) -> dict:
    return {"n": n, "prompt_tokens": prompt_tokens, "output_tps": n * gen / seconds, "decode_tps": decode_tps,
            "ttft_s": ttft_s, "seconds": seconds}  # fmt: skip


def child_llmserve(job: dict) -> dict:
    from engine_throughput import bench_settings, run_prompts

    from model.engine.engine import Engine

    started = time.perf_counter()
    # the default model named as the server names it, so that its compiled step (keyed by the settings) is reused
    model = [] if Path(job["gguf"]) == DEFAULT_GGUF else ["--model", job["gguf"]]
    engine = Engine(bench_settings(["serve", *model, *job["llmserve_args"]]))
    engine.runner.wait_compiled()  # the steady state: a server serves eagerly until its compiled step is ready
    load_s = time.perf_counter() - started
    encode = engine.tokenizer.encode
    run_prompts(engine, [encode(job["warmup"], add_special_tokens=False)], 8, "warm")
    levels = []
    for index, texts in enumerate(job["levels"]):
        prompts = [encode(text, add_special_tokens=False) for text in texts]
        r = run_prompts(engine, prompts, job["gen_tokens"], f"level-{index}")
        assert r.output_tokens == len(prompts) * job["gen_tokens"], r
        levels.append(level_result(len(prompts), r.prompt_tokens, r.seconds, r.decode_tps, r.prefill_seconds,
                                   job["gen_tokens"]))  # fmt: skip
    return {"engine": engine.describe(), "load_s": load_s, "rss_mib": rss_mib(), "levels": levels}


def child_openvino(job: dict) -> dict:
    import openvino_genai as ov_genai

    started = time.perf_counter()
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 1  # GB of KV cache: room for every level's sequences at once
    scheduler.enable_prefix_caching = False
    pipe = ov_genai.LLMPipeline(job["gguf"], "CPU", scheduler_config=scheduler, KV_CACHE_PRECISION="f16")
    load_s = time.perf_counter() - started

    def config(tokens: int) -> "ov_genai.GenerationConfig":
        c = ov_genai.GenerationConfig()
        c.max_new_tokens, c.min_new_tokens = tokens, tokens
        c.ignore_eos, c.do_sample, c.apply_chat_template = True, False, False
        return c

    pipe.generate([job["warmup"]], config(8))
    levels = []
    for texts in job["levels"]:
        t = time.perf_counter()
        result = pipe.generate(texts, config(job["gen_tokens"]))
        seconds = time.perf_counter() - t
        metrics = result.perf_metrics
        generated = metrics.get_num_generated_tokens()
        assert generated == len(texts) * job["gen_tokens"], (generated, len(texts))
        tpot_ms = metrics.get_tpot().mean
        decode_tps = 1000 / tpot_ms if tpot_ms else float("nan")
        prompt_tokens = metrics.get_num_input_tokens() / len(texts)
        levels.append(level_result(len(texts), prompt_tokens, seconds, decode_tps, float("nan"), job["gen_tokens"]))
    return {"engine": f"openvino-genai {ov_genai.__version__}", "load_s": load_s, "rss_mib": rss_mib(),
            "levels": levels}  # fmt: skip


def templated_texts(tokenizer: "Tokenizer", first_index: int, n: int, prompt_tokens: int) -> list[str]:
    """The chat-templated text of requests first_index.. (engine_throughput's prompts, as text)."""
    from engine_throughput import prompt_words
    from serve_bench import chat_messages

    texts = []
    for index in range(first_index, first_index + n):
        messages = chat_messages(index, prompt_words(tokenizer, index, prompt_tokens))
        texts.append(tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def run_child(name: str, job: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", name], input=json.dumps(job), capture_output=True,
                         text=True, cwd=ROOT)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{name} child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    argv = sys.argv[1:]
    llmserve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=146)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--child", choices=["llmserve", "openvino"], help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    if args.child:
        job = json.loads(sys.stdin.read())
        print(json.dumps((child_llmserve if args.child == "llmserve" else child_openvino)(job)))
        return

    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.gguf, cache_dir=Path.home() / ".cache" / "llmserve")
    names = ["llmserve", "openvino"]
    rows: dict[str, list[dict]] = {name: [] for name in names}
    index = 0
    for round_number in range(args.rounds):
        levels = []
        for n in args.concurrency:
            levels.append(templated_texts(tokenizer, index, n, args.prompt_tokens))
            index += n
        job = {"gguf": str(args.gguf), "gen_tokens": args.gen_tokens, "levels": levels,
               "warmup": templated_texts(tokenizer, 10_000_000 + round_number, 1, 32)[0],
               "llmserve_args": llmserve_args}  # fmt: skip
        for name in names if round_number % 2 == 0 else names[::-1]:
            rows[name].append(run_child(name, job))
            summary = ", ".join(f"{lv['n']}: {lv['output_tps']:.1f} tok/s" for lv in rows[name][-1]["levels"])
            print(f"round {round_number + 1} {name}: {summary}", file=sys.stderr, flush=True)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")  # fmt: skip
    print(f"# llmserve vs OpenVINO GenAI, in process\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{cpu}, {os.cpu_count()} CPUs; {args.rounds} rounds alternating; medians.\n")  # fmt: skip
    for name in names:
        print(f"- {name}: {rows[name][0]['engine']}")
    print(f"\nModel `{args.gguf.name}`; ~{args.prompt_tokens}-token chat prompts, {args.gen_tokens} greedy tokens "
          "(EOS ignored), all of a level's prompts submitted at once.\n")  # fmt: skip
    print("| prompts | llmserve output tok/s | OpenVINO output tok/s | ratio | llmserve decode tok/s "
          "| OpenVINO decode tok/s | ratio | llmserve prefill s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")

    def med(name: str, i: int, key: str) -> float:
        return statistics.median(r["levels"][i][key] for r in rows[name])

    for i, n in enumerate(args.concurrency):
        ours, theirs = med("llmserve", i, "output_tps"), med("openvino", i, "output_tps")
        decode = "| - | - | - "  # OpenVINO reports a batch's time per output token per sequence, not in all
        if n == 1:
            our_decode, their_decode = med("llmserve", i, "decode_tps"), med("openvino", i, "decode_tps")
            decode = f"| {our_decode:.1f} | {their_decode:.1f} | {our_decode / their_decode:.2f}x "
        print(f"| {n} | {ours:.1f} | {theirs:.1f} | **{ours / theirs:.2f}x** {decode}"
              f"| {med('llmserve', i, 'ttft_s'):.2f} |")  # fmt: skip
    print(
        "\n| engine | load s (to ready; llmserve: its compiled step loaded or built) | resident MiB after the levels |"
    )
    print("|---|---:|---:|")
    for name in names:
        load = statistics.median(r["load_s"] for r in rows[name])
        rss = statistics.median(r["rss_mib"] for r in rows[name])
        print(f"| {name} | {load:.1f} | {rss:.0f} |")
    print(
        "\nDecode tok/s (one prompt): llmserve's tokens after the first over the time after it; OpenVINO's 1000 / its "
        "mean time per output token. Prefill: until every prompt had its first token (OpenVINO's TTFT of a batch is "
        "not the same measure, so it is left out)."
    )


if __name__ == "__main__":
    main()
