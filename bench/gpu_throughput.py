"""Generation throughput on one GPU: llmserve's engine (CUDA graphs on and off) against transformers' own generate
(static batch) and its continuous batching (generate_batch), at several numbers of concurrent streams.

    python bench/gpu_throughput.py run --model llama-1b --backend llmserve --jsonl out.jsonl
    python bench/gpu_throughput.py report --jsonl out.jsonl --out bench/RESULTS-gpu.md

Each `run` is one (model, backend) in its own process, so scripts/gpu-check.sh can bound each with `timeout` and a
crash or hang costs one column, not the run; it appends one JSON row per level as soon as the level ends.

Models: `smollm2` is the embedded model (models/SmolLM2-135M-Instruct.Q4_1.gguf) when that file is present, else a
random model of its shape; `llama-1b` is a random model of Llama-3.2-1B's shape (1.24B parameters). Prompts are
random token ids of --prompt-tokens each, all different; --gen-tokens are generated greedily, EOS ignored."""

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from config.default_model import FILENAME  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
}  # fmt: skip
BACKENDS = ("llmserve", "llmserve-eager", "hf-generate", "hf-cb")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def model_path(name: str, work: Path, device: str) -> Path:
    """The GGUF of the embedded model when present; else a random bfloat16 checkpoint of the shape, saved once."""
    gguf = ROOT / "models" / FILENAME
    if name == "smollm2" and gguf.exists():
        return gguf
    folder = work / name
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**SHAPES[name], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        with torch.device(device):  # initialized on the GPU: seconds instead of a minute for 1B parameters
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
    return folder


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def word_tokenizer(vocab: int) -> Any:
    """Ids only (the engine never detokenizes): a word-level tokenizer built in-process, for the random models."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from model.tokenizer import Tokenizer

    raw = RawTokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", eos_token="t2"), {2})


def run_engine(path: Path, eager: bool, levels: list[int], args: argparse.Namespace, emit: Any) -> None:
    from config import Settings
    from model.engine.engine import Engine
    from model.engine.sequence import SamplingParams

    settings = Settings(model=str(path), device=args.device, dtype="bfloat16", enforce_eager=eager,
                        max_num_seqs=max(levels), max_num_batched_tokens=args.max_batched_tokens,
                        kv_cache_memory=args.kv_cache_gib * 2**30, max_model_len=4096)  # fmt: skip
    started = time.perf_counter()
    tokenizer = None if path.suffix == ".gguf" else word_tokenizer(SHAPES[args.model]["vocab_size"])
    engine = Engine(settings, tokenizer=tokenizer)
    graphs = engine.runner.decode_graphs
    meta = dict(
        start_seconds=round(time.perf_counter() - started, 1),
        attention=engine.runner.attention_backend,
        graphs=len(graphs.sizes) if graphs else 0,
        capture_seconds=round(graphs.capture_seconds, 1) if graphs else 0,
    )
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    vocab = engine.runner.config.vocab_size
    for seed, n in enumerate([1, *levels]):  # the first, one short stream, is a warm-up and not reported
        batch = prompts(n, args.prompt_tokens, vocab, seed)
        sync(args.device)
        started = time.perf_counter()
        for i, ids in enumerate(batch):
            engine.add_request(f"{seed}-{i}", ids, params)
        engine._drain_inbox(False)
        steps = decode_steps = tokens = 0
        first_all = 0.0  # when every stream had its first token
        seen: set[str] = set()
        while engine.scheduler.has_work():
            outs = engine.step()
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
            if first_all:
                decode_steps += 1
            else:
                seen.update(o.request_id for o in outs)
                first_all = time.perf_counter() - started if len(seen) == n else 0.0
        seconds = time.perf_counter() - started
        if seed:
            decode_ms = 1000 * (seconds - first_all) / max(decode_steps, 1)
            emit(n, tokens, seconds, dict(meta, steps=steps, ms_per_decode_step=round(decode_ms, 2)))


def run_hf(path: Path, continuous: bool, levels: list[int], args: argparse.Namespace, emit: Any) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs: dict[str, Any] = dict(dtype=torch.bfloat16)
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
    model = AutoModelForCausalLM.from_pretrained(path.parent if path.suffix == ".gguf" else path, **kwargs)
    model = model.to(args.device).eval()
    vocab = model.config.vocab_size
    config = GenerationConfig(max_new_tokens=args.gen_tokens, min_new_tokens=args.gen_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
    for seed, n in enumerate([1, *levels]):
        batch = prompts(n, args.prompt_tokens, vocab, seed)
        sync(args.device)
        started = time.perf_counter()
        with torch.inference_mode():
            if continuous:
                try:  # generate_batch warms up on every call unless told not to: once is enough, as for ours
                    outputs = model.generate_batch(inputs=batch, generation_config=config, warmup=not seed)
                except TypeError:  # a transformers without the flag
                    outputs = model.generate_batch(inputs=batch, generation_config=config)
                tokens = sum(len(o.generated_tokens) for o in outputs.values())
            else:  # equal prompt lengths: no padding, so this is generate's best case
                out = model.generate(torch.tensor(batch, device=args.device), generation_config=config)
                tokens = (out.shape[1] - args.prompt_tokens) * n
        sync(args.device)
        if seed:
            emit(n, tokens, time.perf_counter() - started, {})


def report(jsonl: Path, out: Path) -> None:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if not rows:
        out.write_text("# GPU throughput\n\nNo results: every run failed (see the log).\n")
        return
    first = rows[0]
    lines = [
        "# GPU throughput",
        "",
        f"{first['date']}, {first['gpu']}; torch {first['torch']}, triton {first['triton']}, "
        f"transformers {first['transformers']}. Prompts of {first['prompt_tokens']} random tokens, "
        f"{first['gen_tokens']} generated per stream (greedy, EOS ignored); output tok/s = generated tokens / "
        "wall time from submission to the last token, prefill included. Written by bench/gpu_throughput.py "
        "(scripts/gpu-check.sh).",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        backends = [b for b in BACKENDS if any(r["backend"] == b for r in mine)]
        levels = sorted({r["streams"] for r in mine})
        lines += ["", f"## {model} ({mine[0]['model_path']})", ""]
        lines.append("| streams | " + " | ".join(f"{b} tok/s" for b in backends) + " |")
        lines.append("|---:|" + "---:|" * len(backends))
        for n in levels:
            cells = []
            for b in backends:
                hit = [r for r in mine if r["backend"] == b and r["streams"] == n]
                cells.append(f"{hit[0]['tok_s']:.0f}" if hit else "-")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        for r in mine:
            if r["backend"].startswith("llmserve") and r["streams"] == levels[0]:
                extra = {k: r[k] for k in ("attention", "graphs", "capture_seconds", "start_seconds") if k in r}
                lines.append(f"\n{r['backend']}: {extra}")
        steps = [
            f"{r['backend']}@{r['streams']}: {r['ms_per_decode_step']} ms" for r in mine if "ms_per_decode_step" in r
        ]
        lines.append("\nms per decode step: " + ", ".join(steps))
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one (model, backend), every level")
    run.add_argument("--model", choices=list(SHAPES), required=True)
    run.add_argument("--backend", choices=BACKENDS, required=True)
    run.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    run.add_argument("--prompt-tokens", type=int, default=128)
    run.add_argument("--gen-tokens", type=int, default=64)
    run.add_argument("--max-batched-tokens", type=int, default=8192, help="the engine's prefill budget per step")
    run.add_argument("--kv-cache-gib", type=int, default=8)
    run.add_argument("--work", type=Path, default=Path("/tmp/llmserve-bench"), help="where random models are saved")
    run.add_argument("--jsonl", type=Path, required=True)
    run.add_argument("--device", default="cuda", help="cpu: a smoke test of this script, not a measurement")
    rep = sub.add_parser("report", help="the JSON rows as a markdown file")
    rep.add_argument("--jsonl", type=Path, required=True)
    rep.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "report":
        report(args.jsonl, args.out)
        return

    import transformers
    import triton

    path = model_path(args.model, args.work, args.device)
    common = dict(
        model=args.model,
        backend=args.backend,
        model_path=str(path),
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )

    def emit(streams: int, tokens: int, seconds: float, extra: dict[str, Any]) -> None:
        row = dict(common, streams=streams, tokens=tokens, seconds=round(seconds, 3), tok_s=tokens / seconds, **extra)
        with args.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.model} {args.backend} {streams} streams: {tokens / seconds:.0f} tok/s", flush=True)

    if args.backend.startswith("llmserve"):
        run_engine(path, args.backend == "llmserve-eager", args.streams, args, emit)
    else:
        run_hf(path, args.backend == "hf-cb", args.streams, args, emit)
    gc.collect()


if __name__ == "__main__":
    main()
