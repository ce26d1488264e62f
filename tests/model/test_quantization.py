"""Weight-only int8 against a float64 reference of the same quantized weights."""

import torch
from torch import nn

from model.layers.quantization import Int8Linear, quantize_int8


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


def test_quantize_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32, bias=False)))
    quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2
