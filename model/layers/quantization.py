"""Weight-only int8 (per output channel, symmetric), as gpt-fast does: weights are read at a quarter of float32's
bytes, which is what bounds single-stream decode on a CPU. Activations go through the kernel in bfloat16, the
input type torch's CPU int8 kernel is fast for (AVX512-BF16 / AMX)."""

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(module: nn.Module) -> None:
    """Replace every nn.Linear below `module` (the LM head included) with an Int8Linear, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            quantize_int8(child)
