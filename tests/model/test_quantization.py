"""Weight-only int8 and int4 against float64 references of the same quantized weights."""

import pytest
import torch
from torch import nn

from model.engine.model_runner import c_compiler_found, cpu_has_bfloat16
from model.layers import group_kernels
from model.layers.linear import PackedLinear
from model.layers.quantization import INT4_GROUP, GroupLinear, Int4Linear, Int8Linear, int4_quantize, quantize
from model.layers.tracing import compiling_here


def test_int8_weights_round_within_half_a_step() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    q = Int8Linear(linear)
    scales = q.scales.double()[:, None]
    dequant = q.weight.double() * scales
    # bfloat16 scales round the step itself by up to 2**-8 relative; the error stays within half a step plus that
    bound = scales * (0.5 + 127 * 2**-8)
    assert bool(((dequant - linear.weight.double()).abs() <= bound).all())


def test_int8_linear_matches_float64_reference() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(576, 200, bias=True)
    q = Int8Linear(linear)
    x = torch.randn(5, 576)
    ref = x.bfloat16().double() @ (q.weight.double() * q.scales.double()[:, None]).T + linear.bias.double()
    out = q(x)
    assert out.dtype == torch.float32 and out.shape == (5, 200)
    assert (out.double() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_int8_quantize_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32, bias=False)))
    quantize(model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    kind = GroupLinear if group_kernels.load() else Int8Linear
    assert sum(isinstance(m, kind) for m in model.modules()) == 2


def test_int4_recovers_a_q4_1_tensor_exactly() -> None:
    # GGUF Q4_1: w = d * q + m per group of 32, d and m stored in float16, and llama.cpp's quantizer puts each
    # group's minimum at q=0 and its maximum at q=15; requantizing the dequantized tensor must give back q, d, m
    g = torch.Generator().manual_seed(2)
    out_features, groups = 48, 576 // INT4_GROUP
    q = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=g)
    q[..., 3], q[..., 17] = 0, 15
    d = (torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out_features, groups, generator=g) * 0.2).half().float()
    w = (q.float() * d[..., None] + m[..., None]).view(out_features, -1)
    q2, scale, minimum = int4_quantize(w)
    assert torch.equal(q2.view_as(q), q.to(torch.int32))
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(minimum, m, rtol=0, atol=0)


def test_int4_linear_matches_float64_reference() -> None:
    torch.manual_seed(3)
    linear = nn.Linear(576, 96, bias=True)
    layer = Int4Linear(linear)
    q, _, _ = int4_quantize(linear.weight)
    # the kernel's own (bfloat16) scales and zeros, dequantized in float64: (q - 8) * scale + zero
    sz = layer.scales_and_zeros.double()  # [in/32, out, 2]
    scale = sz[..., 0].T.repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    zero = sz[..., 1].T.repeat_interleave(INT4_GROUP, dim=1)
    dequant = (q.double() - 8) * scale + zero
    assert (dequant - linear.weight.double()).abs().max() < 0.1 * linear.weight.abs().max()  # 4 bits: coarse
    x = torch.randn(7, 576)
    ref = x.bfloat16().double() @ dequant.T + linear.bias.double()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (7, 96)
    assert (out.double() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()


def test_int4_quantize_keeps_the_lm_head_and_odd_shapes_in_bfloat16() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 96), nn.Linear(40, 64))])
            self.lm_head = nn.Linear(64, 128, bias=False)

    model = Tiny()
    reference = model.lm_head.weight.detach().clone()
    quantize(model, "int4")
    assert isinstance(model.layers[0][1], PackedLinear)  # 40 inputs: not whole groups of 32, dense
    x = torch.randn(3, 64)
    if group_kernels.load():  # the head in 8-bit groups of its own, float32 activations
        assert isinstance(model.layers[0][0], GroupLinear) and model.layers[0][0].bits == 4
        assert isinstance(model.lm_head, GroupLinear) and model.lm_head.bits == 8
        ref = x.double() @ reference.double().T
    else:
        assert isinstance(model.layers[0][0], Int4Linear)
        assert isinstance(model.lm_head, PackedLinear) and model.lm_head.dtype == torch.bfloat16
        ref = x.bfloat16().double() @ reference.bfloat16().double().T
    assert (model.lm_head(x).double() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()


@pytest.mark.skipif(not c_compiler_found(), reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_compiled_one_row_gemv_matches_float64_reference(kind: str) -> None:
    # a graph traced for one row runs these layers as GEMV loops over their plain (or int8) weights, the 16-bit
    # and int8 ones behind the materialize op
    torch.manual_seed(2)
    linear = nn.Linear(576, 200, bias=True)
    x = torch.randn(1, 576)
    if kind == "int8":
        layer: nn.Module = Int8Linear(linear)
        weight = layer.weight.double() * layer.scales.double()[:, None]
    else:
        dtype = getattr(torch, kind)
        if dtype == torch.bfloat16 and not cpu_has_bfloat16():
            pytest.skip("oneDNN packs bfloat16 weights only on CPUs with AVX512 or AVX-NE-CONVERT")
        layer = PackedLinear(linear.to(dtype), keep_weight=True)
        weight, x = linear.weight.double(), x.to(dtype)
    ref = x.double() @ weight.T + linear.bias.double()
    with torch.inference_mode(), compiling_here():
        out = torch.compile(layer, dynamic=False, fullgraph=True)(x)
    assert out.dtype == x.dtype and out.shape == (1, 200)
    # float32 activations for int8: far closer than the eager int8 kernel's bfloat16 ones (0.02 of the range above);
    # a bfloat16 output rounds by up to 2**-8 of its value
    atol, rtol = (1e-3, 2**-8) if kind == "bfloat16" else (1e-4, 1e-4)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
