"""Weight-only quantization of linear layers, as gpt-fast does: single-stream decode on a CPU is bound by the bytes
of weights read per token, and these read a quarter (int8) or an eighth (int4) of float32's. Activations go through
the kernels in bfloat16, the input type torch's CPU int8/int4 kernels are fast for (AVX512-BF16 / AMX); in float32
and float16 they are 20-100x slower here."""

import torch
from torch import nn

from model.layers.linear import PackedLinear, is_one_row, one_row_linear, onednn_usable

# int4 group: 32 input columns share a scale and a zero, as in GGUF's Q4_0/Q4_1 and the sub-blocks of Q4_K
INT4_GROUP = 32


class WeightOnlyLinear(nn.Module):
    """What int8 and int4 layers share: inputs flattened and cast to bfloat16 for the kernel, outputs cast back to
    the model's dtype, and the bias added in that dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # [N, in] bfloat16 -> [N, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        y = self.matmul(x.reshape(-1, self.in_features).to(torch.bfloat16))
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(WeightOnlyLinear):
    weight: torch.Tensor  # buffers (register_buffer below)
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_one_row(x):  # a GEMV over the int8 bytes, dequantized in the loop, in the activations' dtype
            y = one_row_linear(x.reshape(1, -1), self.weight) * self.scales.to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def int4_quantize(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q [out, in] int32 in 0..15, scale [out, in/group], minimum [out, in/group]), with
    weight ~= q * scale + minimum. Asymmetric min/max per group: a GGUF Q4_1 tensor (d * q + m, whose quantizer
    puts the group's minimum at q=0 and maximum at q=15) comes back as its own q, d and m."""
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group, group)
    minimum, maximum = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((maximum - minimum) / 15).clamp(min=1e-10)
    q = ((w - minimum[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(out_features, in_features), scale, minimum


class Int4Linear(WeightOnlyLinear):
    """Group-wise asymmetric int4 through torch's CPU kernel (`_weight_int4pack_mm_for_cpu`), whose dequantization
    is (q - 8) * scale + zero: zero = minimum + 8 * scale gives q * scale + minimum."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scale, minimum = int4_quantize(linear.weight)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # [out, in/2] uint8
        zero = minimum + 8 * scale
        self.register_buffer(
            "scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        )

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        # the kernel's constraints: whole groups along the input, output rows in multiples of 16
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


def quantize(module: nn.Module, method: str) -> None:
    """Replace the linear layers below `module` in place.

    int8: every nn.Linear, the LM head included. int4: the decoder layers' linears; the LM head (and any linear the
    kernel's shape rules exclude) runs in bfloat16 through oneDNN instead, because the vocabulary projection is where
    int4's error shows most, and a tied head is the embedding, which GGUF files keep at 8 bits or more."""
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r}; supported: int8, int4")
    if method == "int4" and not onednn_usable(torch.device("cpu"), torch.bfloat16):
        raise ValueError("--quantization int4 needs torch's CPU kernels (oneDNN); it runs on CPU only")
    for name, child in list(module.named_modules()):
        for attr, linear in list(child.named_children()):
            if not isinstance(linear, nn.Linear):
                continue
            if method == "int8":
                replacement: nn.Module = Int8Linear(linear)
            elif Int4Linear.supports(linear) and not (name == "" and attr == "lm_head"):
                replacement = Int4Linear(linear)
            else:
                replacement = PackedLinear(linear, torch.bfloat16)
            setattr(child, attr, replacement)
