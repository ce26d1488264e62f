"""The default model's matrix shapes through each CPU path for a 4-bit (and the head's 8-bit) weight: our grouped
kernel (model/layers/group_gemm.cpp), torch's int4/int8 kernels with bfloat16 activations (the fallback), and a
dense float32 matmul of the dequantized weight (MKL), at decode and prefill row counts. Prints ms per call and the
largest error against a float64 product, relative to the largest output.

    .venv/bin/python bench/group_kernels.py
    .venv/bin/python bench/group_kernels.py --rows 1 16 --repeats 50
    .venv/bin/python bench/group_kernels.py --against HEAD~1 --rows 1 2 8 16   # this kernel against a revision's

--against REV builds group_gemm.cpp as it was at git revision REV (under another op namespace, into a temp folder)
and times the two in turn, best of several rounds each, in one process: on a shared machine a change of 10-20 %
is lost in the noise between runs, not within one. --their-env NAME=VALUE sets a variable for that build alone
(each build reads its settings once), so one source's two settings run side by side:

    .venv/bin/python bench/group_kernels.py --against HEAD --their-env LLMSERVE_INT16_PROMPTS=0 --rows 16 64 256
"""

import argparse
import functools
import os
import subprocess
import sys
import tempfile
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


def build_revision(revision: str) -> Callable[..., torch.Tensor]:
    """group_gemm.cpp at `revision`, built as the op namespace llmserve_revision."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{revision}:model/layers/group_gemm.cpp"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="group-gemm-"))
    (folder / "revision.cpp").write_text(source.replace("llmserve_kernels", "llmserve_revision"))
    cpp_extension.load(
        name="llmserve_revision",
        sources=[str(folder / "revision.cpp")],
        extra_cflags=group_kernels._build_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return torch.ops.llmserve_revision.group_linear


def best_of(fn: Callable[[], torch.Tensor], repeats: int, rounds: int = 5) -> float:
    return min(timed(fn, repeats) for _ in range(rounds))


def random_weight(k: int, n: int, bits: int, g: torch.Generator) -> tuple[GroupQuantized, torch.Tensor]:
    """An [n, k] weight quantized to `bits`, and its q as the kernel takes it (4 bits: two per byte)."""
    dense = torch.randn(n, k, generator=g) * 0.05
    weight = GroupQuantized.int4_from_float(dense) if bits == 4 else GroupQuantized.int8_from_float(dense)
    return weight, weight.data


def latch_settings(namespace: str) -> None:
    """Call the build's queries, so that every setting it reads from the environment is read now."""
    ops = getattr(torch.ops, namespace)
    for bits in (4, 8):
        ops.fused_rows(bits)
    ops.bfloat16_prompts()
    ops.amx_takes(16)
    if hasattr(ops, "int16_rows"):
        ops.int16_rows(4)


def against(revision: str, rows: list[int], repeats: int, their_env: list[str]) -> None:
    theirs = build_revision(revision)
    latch_settings("llmserve_kernels")
    saved = dict(os.environ)
    os.environ.update(setting.split("=", 1) for setting in their_env)
    latch_settings("llmserve_revision")
    os.environ.clear()
    os.environ.update(saved)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {group_kernels.instruction_set()}")
    print(f"{revision} with {' '.join(their_env) or 'the same environment'}\n")
    print(f"| in x out | bits | rows | this tree ms | {revision} ms | ratio | this tree error | {revision} error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for k, n, bits in SHAPES:
        weight, q = random_weight(k, n, bits, g)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            reference = x.double() @ weight.dequantize().double().T
            errors = [
                ((kernel(x, q, weight.scale, weight.minimum, bits).double() - reference).abs().max()
                 / reference.abs().max()).item()
                for kernel in (group_kernels.group_linear, theirs)
            ]  # fmt: skip
            args = (x, q, weight.scale, weight.minimum, bits)
            calls = {
                "ours": functools.partial(group_kernels.group_linear, *args),
                "theirs": functools.partial(theirs, *args),
            }
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            count = max(3, repeats // 8) if n > 10_000 else repeats
            for _ in range(3):  # in turn, so a change in the machine's load hits both
                for name, call in calls.items():
                    times[name].append(best_of(call, count))
            a, b = min(times["ours"]), min(times["theirs"])
            print(f"| {k} x {n} | {bits} | {m} | {a:.4f} | {b:.4f} | {a / b:.2f} | {errors[0]:.1e} | {errors[1]:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 128])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--against", default="", help="a git revision whose kernel to time against this tree's")
    parser.add_argument("--their-env", nargs="*", default=[], help="NAME=VALUE settings for --against's build only")
    args = parser.parse_args()
    if not group_kernels.load():
        sys.exit("the grouped kernel could not be built here (see the log)")
    if args.against:
        against(args.against, args.rows, args.repeats, args.their_env)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| in x out | bits | rows | ours ms | torch kernel ms | dense float32 ms | ours error | torch error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for k, n, bits in SHAPES:
        weight, q = random_weight(k, n, bits, g)
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
