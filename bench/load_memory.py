"""Peak resident memory while loading a ~500 MB safetensors folder into our decoder.

    .venv/bin/python bench/load_memory.py [--folder DIR] [--dtype bfloat16 float32] [--reader ours safe_open] \
        [--build build_decoder allocate]

Writes a random Llama-shaped checkpoint (bfloat16, sharded, with an index) unless --folder already holds one, then
loads it in a fresh process per target dtype and reports VmHWM (the kernel's peak RSS) against the model's size in
that dtype. The baseline (python + torch + our modules, before loading) is reported apart: the 1.3x budget is for
what loading adds. `--reader safe_open` runs the same load through safetensors' own safe_open for comparison."""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ~250M parameters: 500 MB in bfloat16, 1 GB in float32
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, kv = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"],
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
                                          "lm_head.weight": (c["vocab_size"], h)}  # fmt: skip
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}  # fmt: skip
    return shapes


def write_checkpoint(folder: Path, shard_mb: int) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict[str, torch.Tensor]]] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append((name, {}))
        shard.clear()

    for name, shape in tensor_shapes(CONFIG).items():
        shard[name] = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        if sum(t.nbytes for t in shard.values()) >= shard_mb * 2**20:
            flush()
    if shard:
        flush()
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def peak_rss_kib() -> tuple[int, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def measure(folder: Path, dtype_name: str, reader: str, build: str) -> dict:
    """Runs in a fresh process: import everything, note the baseline, load, note the peak."""
    import torch

    import model.engine.model_runner as runner
    from model.decoder import Decoder
    from model.engine.model_runner import build_decoder
    from model.loaders import load_config

    if reader == "safe_open":  # safetensors' own reader, for comparison
        from safetensors import safe_open

        def read_weights(path: Path, config: object):  # type: ignore[no-untyped-def]
            for f in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open handles have keys(), no __iter__
                        yield name, handle.get_tensor(name)

        runner.read_weights = read_weights  # type: ignore[assignment]
    dtype = getattr(torch, dtype_name)
    config = load_config(folder)
    baseline, _ = peak_rss_kib()
    if build == "allocate":  # Decoder.allocate (dtype set on the meta device) + load_weights
        decoder = Decoder.allocate(config, 2048, dtype, torch.device("cpu"))
        decoder.load_weights(runner.read_weights(folder, config))
    else:  # the engine's build_decoder as it stands
        decoder = build_decoder(folder, config, 2048, dtype, torch.device("cpu"))
    after, peak = peak_rss_kib()
    model_kib = sum(p.numel() for p in decoder.parameters()) * dtype.itemsize // 1024
    return {"dtype": dtype_name, "reader": reader, "build": build, "model_mib": model_kib / 1024,
            "baseline_mib": baseline / 1024, "peak_mib": peak / 1024, "after_mib": after / 1024,
            "added_over_model": (peak - baseline) / model_kib}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--reader", nargs="+", default=["ours"], choices=["ours", "safe_open"])
    parser.add_argument(
        "--build", nargs="+", default=["build_decoder", "allocate"], choices=["build_decoder", "allocate"]
    )
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--child", nargs=4, metavar=("FOLDER", "DTYPE", "READER", "BUILD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), args.child[1], args.child[2], args.child[3])))
        return
    folder = args.folder or Path(tempfile.gettempdir()) / "llmserve-load-memory"
    if not (folder / "model.safetensors.index.json").exists():
        write_checkpoint(folder, args.shard_mb)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {folder} ({size:.0f} MiB of safetensors, {len(list(folder.glob('*.safetensors')))} shards)")
    print("| build | reader | dtype | model MiB | baseline MiB | peak MiB | (peak - baseline) / model |")
    print("|---|---|---|---|---|---|---|")
    for build in args.build:
        for reader in args.reader:
            for dtype in args.dtype:
                out = subprocess.run([sys.executable, __file__, "--child", str(folder), dtype, reader, build],
                                     capture_output=True, text=True, check=True)  # fmt: skip
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {build} | {reader} | {dtype} | {r['model_mib']:.0f} | {r['baseline_mib']:.0f} | "
                      f"{r['peak_mib']:.0f} | {r['added_over_model']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
