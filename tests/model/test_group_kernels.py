"""Our grouped int4/int8 CPU kernel (model/layers/group_gemm.cpp) against a float64 product of the same dequantized
weights, for decode-sized and prefill-sized row counts, group counts that do and do not fill its 8-wide loops, with
and without minimums; and compiled graphs calling it."""

import pytest
import torch

from model.layers import group_kernels
from model.layers.tracing import compiling_here
from model.qtensor import GroupQuantized, pack_nibbles, unpack_nibbles

pytestmark = pytest.mark.skipif(not group_kernels.load(), reason="the grouped kernel could not be built here")


def grouped(bits: int, n: int, k: int, with_minimum: bool, seed: int) -> GroupQuantized:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3
    minimum = -torch.rand(n, k // 32, generator=g) * 0.3 if with_minimum else None
    return GroupQuantized.from_values(bits, q, scale, minimum)


def error_bound(x: torch.Tensor, weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Up to fused_rows(bits) rows (and float32 rows up to int16_rows(bits)), activations are rounded to int16
    steps of their group's largest magnitude / 32767 (8-bit weights from int8_rows() up to fused_rows(8) rows, and
    float32 rows beyond up to int8_max_rows(): int8 steps, / 127): each by at most half a step, times the weights it
    multiplies; plus float32's rounding of the sums. bfloat16 rows: the output's own rounding (half an ulp, 2^-9
    relative) and, on the tiled path, each weight's; float32 rows on the tiled path of a CPU with AVX512-BF16, or on
    AMX's, round x as well."""
    rows, w = x.shape[0], weight.double().abs()
    amx = group_kernels.amx_takes(rows)
    fused = rows <= group_kernels.fused_rows(bits) and not amx
    # 8-bit weights' float32 rows beyond the fused path's, up to int8_max_rows(): int8, as the fused path's
    int8_path = (
        bits == 8 and not fused and not amx and x.dtype == torch.float32 and rows <= group_kernels.int8_max_rows()
    )
    int8 = (fused and bits == 8 and 0 < group_kernels.int8_rows() <= rows) or int8_path
    # float32 rows beyond the fused path's up to int16_rows(bits) (all of them where the CPU has neither AVX512-BF16
    # nor AMX; batched decode on an AMD CPU with it): int16, as the fused path
    int16_path = (
        not fused and not amx and not int8_path and x.dtype == torch.float32 and rows <= group_kernels.int16_rows(bits)
    )
    step = x.double().abs().view(rows, -1, 32).amax(-1) / (127 if int8 else 32767)  # [rows, groups]
    rounded = fused or int16_path or int8_path
    rounding = (step / 2) @ w.view(w.shape[0], -1, 32).sum(-1).T if rounded else 0
    magnitude = x.double().abs() @ w.T
    bound = rounding + 1e-6 * magnitude
    if x.dtype == torch.bfloat16:
        exact = x.double() @ weight.double().T
        bound = bound + exact.abs() * 2**-8 + (0 if fused else magnitude * 2**-8)
    elif not rounded and (amx or group_kernels.bfloat16_prompts()):  # x, the weights (and output) rounded to bfloat16
        exact = x.double() @ weight.double().T
        bound = bound + exact.abs() * 2**-8 + magnitude * 2**-7
    return bound


def run(weight: GroupQuantized, x: torch.Tensor) -> torch.Tensor:
    return group_kernels.group_linear(x, weight.data, weight.scale, weight.minimum, weight.bits)


@pytest.mark.parametrize("bits, with_minimum", [(4, True), (4, False), (8, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 19, 32, 33, 40, 64, 70])
# 3 groups (no full 8-wide pass over the minimums; an odd one), 5 (AVX512: a last pass of four holding one), 8, 18
@pytest.mark.parametrize("k", [96, 160, 256, 576])
def test_matches_float64_reference(bits: int, with_minimum: bool, rows: int, k: int) -> None:
    weight = grouped(bits, 50, k, with_minimum, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] *= 100  # one group far larger than the rest: each group has its own activation scale
    reference = x.double() @ weight.dequantize().double().T
    out = run(weight, x)
    assert out.dtype == torch.float32 and out.shape == (rows, 50)
    assert bool(((out.double() - reference).abs() <= error_bound(x, weight.dequantize(), weight.bits)).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_bfloat16_rows_come_back_in_bfloat16(bits: int, rows: int) -> None:
    weight = grouped(bits, 70, 96, bits == 4, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    reference = x.double() @ weight.dequantize().double().T
    out = run(weight, x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 70)
    assert bool(((out.double() - reference).abs() <= error_bound(x, weight.dequantize(), weight.bits)).all())


@pytest.mark.parametrize("bits, with_minimum", [(4, True), (4, False), (8, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 40, 64, 70, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float16_scales_as_a_gguf_stores_them(bits: int, with_minimum: bool, rows: int, dtype: torch.dtype) -> None:
    """A GGUF's own float16 scales and minimums, read as they are: the same product as their float32 widening on
    every path, within the float64 reference's bound. 18 groups: the scales go into tiles 16 groups at a time."""
    weight = grouped(bits, 70, 576, with_minimum, seed=rows)
    half = GroupQuantized(
        bits, weight.data, weight.scale.half(), None if weight.minimum is None else weight.minimum.half()
    )
    widened = GroupQuantized(
        bits, weight.data, half.scale.float(), None if half.minimum is None else half.minimum.float()
    )
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = run(half, x)
    assert out.dtype == dtype and out.shape == (rows, 70)
    assert torch.equal(out, run(widened, x))
    reference = x.double() @ widened.dequantize().double().T
    assert bool(((out.double() - reference).abs() <= error_bound(x, widened.dequantize(), bits)).all())


def test_rejects_a_minimum_of_another_dtype() -> None:
    weight = grouped(4, 16, 64, True, seed=0)
    with pytest.raises(RuntimeError, match="minimum must match"):
        group_kernels.group_linear(torch.randn(1, 64), weight.data, weight.scale.half(), weight.minimum, 4)


def test_pack_nibbles_is_ggmls_block_layout() -> None:
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = pack_nibbles(q)
    # byte j of each group: value j in the low nibble, value j + 16 in the high one
    expected = [(j % 16) | (((j + 16) % 16) << 4) for j in range(16)] * 2
    assert packed.tolist() == [expected]
    assert torch.equal(unpack_nibbles(packed), q)


def test_rejects_shapes_that_are_not_whole_groups() -> None:
    weight = grouped(4, 8, 64, True, seed=0)
    with pytest.raises(RuntimeError, match="whole groups"):
        group_kernels.group_linear(torch.randn(2, 48), weight.data, weight.scale[:, :1],
                                   weight.minimum, 4)  # fmt: skip


def test_a_compiled_graph_calls_the_kernel() -> None:
    from torch import nn

    from model.layers.quantization import GroupLinear

    linear = nn.Linear(576, 64, bias=True)
    weight = GroupQuantized.int4_from_float(linear.weight)
    layer = GroupLinear(linear, weight)
    x = torch.randn(1, 576)
    reference = x.double() @ weight.dequantize().double().T + linear.bias.double()
    with torch.inference_mode(), compiling_here():
        out = torch.compile(layer, dynamic=False, fullgraph=True)(x)
    assert bool(((out.double() - reference).abs() <= error_bound(x, weight.dequantize(), weight.bits) + 1e-6).all())


@pytest.mark.parametrize("mode", ["inference", "no_grad"])
def test_many_rows_in_inference_mode_and_out_of_it(mode: str) -> None:
    # the tiled path multiplies in the thread pool's threads, which do not inherit the caller's inference mode
    weight = grouped(4, 300, 576, True, seed=5)
    x = torch.randn(64, 576)
    with torch.inference_mode() if mode == "inference" else torch.no_grad():
        out = run(weight, x)
    reference = x.double() @ weight.dequantize().double().T
    assert bool(((out.double() - reference).abs() <= error_bound(x, weight.dequantize(), weight.bits)).all())
