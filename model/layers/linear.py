"""Linear layers whose weights are reordered once, at load, into oneDNN's blocked layout (CPU only).

torch's F.linear sends float32 to MKL, whose GEMV/GEMM runs at about half of memory bandwidth on the AMD EPYC
machines here (one row: ~11 GB/s of weights against ~24 GB/s for a plain read). oneDNN's JIT kernels, on a weight
laid out for them ahead of time, read ~21 GB/s at one row and are about twice MKL at 16 rows, in float32 and in
bfloat16 (bench/gemm_backends.py prints the comparison).

The blocked weight is opaque to torch.compile, so a compiled forward calls each layer through the custom op
`llmserve::packed_linear`, which names the layer by its index in a registry.

A compiled forward of one row does without oneDNN: `one_row_linear` is a multiply-and-sum that inductor turns into
one GEMV loop reading the plain weight at 25-32 GB/s, against oneDNN's 16-21 at one row (bench/gemm_backends.py).
Layers keep their plain weight for it only when asked (`keep_weight`, under --torch-compile)."""

import functools
import weakref

import torch
from torch import nn

from model.layers.tracing import traced

# oneDNN picks the blocked layout for this many rows; measured the same from 1 to 512 rows (bench/gemm_backends.py)
BATCH_HINT = 16


@torch.library.custom_op("llmserve::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy the compiler cannot see through, so x becomes a buffer of its own."""
    return x.clone()


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[1, in] x [out, in] -> [1, out] in x's dtype, for compiled graphs only (eager, it would materialize the
    product). An integer weight is converted inside the loop: a quantized GEMV reads its 1-byte weights."""
    if weight.dtype != torch.float32:
        # Inductor would inline x's producer (RMSNorm, residual add) into the loop, recomputing it for every output
        # row. Free while float32 weights keep the loop waiting on memory; int8 and bfloat16 loops are bound by
        # their conversions, and a buffer takes an int8 step from 12.5 to 8.1 ms, a bfloat16 one from 18.0 to 11.5.
        x = materialize(x)
    return (x.unsqueeze(-2) * weight.to(x.dtype)).sum(-1)


def is_one_row(x: torch.Tensor) -> bool:
    """True only in a graph traced for a single row (x: [1, ...]); False in eager code and for a row count left
    symbolic."""
    if not traced():
        return False
    # imported here: it brings sympy (~50 MiB resident) into a serving process that never traces
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(x.shape[0] == 1)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN reorders bfloat16 weights only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere it
    raises, so ask it once with a tiny tensor."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and _onednn_packs(dtype)
    )


def row_bucket(rows: int) -> int:
    """The row count a matmul runs at: exact up to 16 (decode batches), then 4 sizes per octave (20, 24, 28, 32, 40,
    ..., at most 25% padding). oneDNN builds and caches a primitive (JIT code and buffers, ~0.3-1 MB) for every
    distinct row count; unbucketed, a server's prefill chunk lengths and batch sizes made new ones for hours (RSS
    +450 MB over 1,600 shapes in bench/soak.py's diagnosis, and the cache's churn past its 1,024 entries fragmented
    the heap). Bucketed, a weight shape has at most 16 + 4 per octave: ~50 up to 8,192 rows."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


# index -> layer; weak, so decoders that are dropped (tests build many) free their weights
_LAYERS: list[weakref.ref["PackedLinear"]] = []


@torch.library.custom_op("llmserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, index: int) -> torch.Tensor:
    layer = _LAYERS[index]()
    assert layer is not None
    return layer.matmul(x)


@packed_linear.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    layer = _LAYERS[index]()
    assert layer is not None
    return x.new_empty(*x.shape[:-1], layer.out_features)


class PackedLinear(nn.Module):
    """`dtype`: the weights' and the matmul's type when it differs from the model's (a bfloat16 LM head beside
    int4 layers); inputs are cast to it and outputs back."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype or linear.weight.dtype
        # a plain attribute, not a buffer: the blocked tensor has no strides, and nothing may .to() or save it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(self.dtype), BATCH_HINT)
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # the plain weight as well, for one_row_linear (a tied LM head's is the embedding: no copy)
        self.weight = linear.weight.detach().to(self.dtype) if keep_weight else None
        self.index = len(_LAYERS)
        _LAYERS.append(weakref.ref(self))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if rows and (padded := row_bucket(rows)) != rows:  # zero rows, whose outputs are dropped
            return self.matmul(torch.nn.functional.pad(x, (0, 0, 0, padded - rows)))[:rows]
        if x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and is_one_row(x):
            y = one_row_linear(x.to(self.dtype), self.weight).to(x.dtype)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        if traced():
            return packed_linear(x, self.index)
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed {self.dtype}"


def pack_linears(module: nn.Module, keep_weights: bool = False) -> None:
    """Replace every nn.Linear below `module` (the LM head included) with a PackedLinear, in place. A tied LM head
    gets its own packed copy; the embedding keeps the plain one."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, keep_weight=keep_weights))
        else:
            pack_linears(child, keep_weights)
