"""Linear layers whose weights are reordered once, at load, into oneDNN's blocked layout (CPU only).

torch's F.linear sends float32 to MKL, whose GEMV/GEMM runs at about half of memory bandwidth on the AMD EPYC
machines here (one row: ~11 GB/s of weights against ~24 GB/s for a plain read). oneDNN's JIT kernels, on a weight
laid out for them ahead of time, read ~21 GB/s at one row and are about twice MKL at 16 rows, in float32 and in
bfloat16 (bench/gemm_backends.py prints the comparison)."""

import torch
from torch import nn

# oneDNN picks the blocked layout for this many rows; measured the same from 1 to 512 rows (bench/gemm_backends.py)
BATCH_HINT = 16


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a plain attribute, not a buffer: the blocked tensor has no strides, and nothing may .to() or save it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear below `module` (the LM head included) with a PackedLinear, in place. A tied LM head
    gets its own packed copy; the embedding keeps the plain one."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
