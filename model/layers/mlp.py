from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class GatedMLP(nn.Module):
    """SwiGLU / GeGLU: down(act(gate(x)) * up(x)), with gate and up fused into one matmul. Under tensor parallelism
    it holds a slice of the intermediate columns, and `reduce` (an all-reduce) sums down's partial products."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)  # rows: [gate; up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[hidden_act]
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        out = self.down_proj(self.act(gate) * up)
        return out if self.reduce is None else self.reduce(out)
