"""The default model's matrix shapes through each CPU path for a 4-bit (and the head's 8-bit) weight: our grouped
kernel (model/layers/group_gemm.cpp), torch's int4/int8 kernels with bfloat16 activations (the fallback), and a
dense float32 matmul of the dequantized weight (MKL), at decode and prefill row counts. Prints ms per call and the
largest error against a float64 product, relative to the largest output.

    .venv/bin/python bench/group_kernels.py
    .venv/bin/python bench/group_kernels.py --rows 1 16 --repeats 50
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from model.layers import group_kernels  # noqa: E402
from model.qtensor import GroupQuantized  # noqa: E402

# (in, out, bits): q/k/v fused, o, gate/up fused, down, the tied 8-bit LM head
SHAPES = [(576, 960, 4), (576, 576, 4), (576, 3072, 4), (1536, 576, 4), (576, 49152, 8)]


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1000


def torch_kernel(weight: GroupQuantized) -> Callable[[torch.Tensor], torch.Tensor]:
    if weight.bits == 8:  # per-row scales, as the fallback requantizes Q8_0
        dense = weight.dequantize()
        scales = dense.abs().amax(1).clamp(min=1e-8) / 127
        q = (dense / scales[:, None]).round().to(torch.int8)
        return lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, scales.bfloat16())
    assert weight.minimum is not None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
    zero = weight.minimum + 8 * weight.scale
    sz = torch.stack([weight.scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 128])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not group_kernels.load():
        sys.exit("the grouped kernel could not be built here (see the log)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| in x out | bits | rows | ours ms | torch kernel ms | dense float32 ms | ours error | torch error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for k, n, bits in SHAPES:
        dense = torch.randn(n, k, generator=g) * 0.05
        weight = GroupQuantized.int4_from_float(dense) if bits == 4 else GroupQuantized.int8_from_float(dense)
        q = group_kernels.pack_nibbles(weight.q) if bits == 4 else weight.q
        theirs = torch_kernel(weight)
        for rows in args.rows:
            print(row(k, n, bits, torch.randn(rows, k, generator=g), q, weight, theirs, args.repeats))


def row(
    k: int,
    n: int,
    bits: int,
    x: torch.Tensor,
    q: torch.Tensor,
    weight: GroupQuantized,
    theirs: Callable[[torch.Tensor], torch.Tensor],
    repeats: int,
) -> str:
    reference_weight = weight.dequantize()
    reference = x.double() @ reference_weight.double().T
    scale = reference.abs().max().item()

    def ours() -> torch.Tensor:
        return group_kernels.group_linear(x, q, weight.scale, weight.minimum, bits)

    ours_ms = timed(ours, repeats)
    theirs_ms = timed(lambda: theirs(x), repeats)
    dense_ms = timed(lambda: torch.nn.functional.linear(x, reference_weight), repeats)
    ours_error = (ours().double() - reference).abs().max().item() / scale
    theirs_error = (theirs(x).double() - reference).abs().max().item() / scale
    return (f"| {k} x {n} | {bits} | {x.shape[0]} | {ours_ms:.3f} | {theirs_ms:.3f} | {dense_ms:.3f} | "
            f"{ours_error:.1e} | {theirs_error:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
