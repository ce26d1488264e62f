"""Linear layers of the default model's shapes through each CPU matmul backend torch offers, side by side.

    .venv/bin/python bench/gemm_backends.py                     # float32, 1 / 16 / 64 rows
    .venv/bin/python bench/gemm_backends.py --dtype bfloat16 --rows 1 16

Each shape is timed over 30 distinct weight matrices (one per layer; the LM head once), so weights stream from
memory as they do in a decode step instead of sitting in cache. GB/s counts weight bytes read."""

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# SmolLM2-135M: [out, in] of the fused qkv, o, fused gate_up, down, and the LM head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="activation rows (batch tokens)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| rows | matrix | aten F.linear ms | oneDNN packed ms | speed-up | packed GB/s |")
    print("|---:|---|---:|---:|---:|---:|")
    totals = {"aten": 0.0, "packed": 0.0}
    for rows in args.rows:
        for name, (out_features, in_features) in SHAPES.items():
            layers = 1 if name == "lm_head" else 30
            weights = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(layers)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
            x = torch.randn(rows, in_features, dtype=dtype)
            # The lambdas run inside seconds_per_call, in this iteration: late binding of x, weights, packed is moot.
            with torch.inference_mode():
                aten = seconds_per_call(lambda: [F.linear(x, w) for w in weights], args.repeats)  # noqa: B023
                onednn = seconds_per_call(
                    lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],  # noqa: B023
                    args.repeats,
                )
            gb = layers * out_features * in_features * dtype.itemsize / 1e9
            print(
                f"| {rows} | {name} x{layers} | {aten * 1e3:.2f} | {onednn * 1e3:.2f} "
                f"| x{aten / onednn:.2f} | {gb / onednn:.1f} |"
            )
            if rows == args.rows[0]:
                totals["aten"] += aten
                totals["packed"] += onednn
    print(
        f"\n{args.rows[0]} row(s), all matrices of one forward: aten {totals['aten'] * 1e3:.1f} ms, "
        f"oneDNN packed {totals['packed'] * 1e3:.1f} ms (x{totals['aten'] / totals['packed']:.2f})"
    )


if __name__ == "__main__":
    main()
