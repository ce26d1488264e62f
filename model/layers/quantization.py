"""Weight-only quantization of linear layers, as gpt-fast does: single-stream decode on a CPU is bound by the bytes
of weights read per token, and these read a quarter (int8) or an eighth (int4) of float32's. Activations go through
the kernels in bfloat16, the input type torch's CPU int8/int4 kernels are fast for (AVX512-BF16 / AMX); in float32
and float16 they are 20-100x slower here.

Two ways in: `quantize` turns a loaded float model's linears into int8 or int4 (--quantization int8 / int4), and
`install_quantized` builds a layer straight from a checkpoint's own quantized tensor (--quantization auto: a GGUF's
Q4_0 / Q4_1 / Q4_K run as int4 on their own values, scales and minimums, Q8_0 as int8), with no float copy."""

import torch
from torch import nn

from model.layers import group_kernels
from model.layers.linear import PackedLinear, is_one_row, one_row_linear, onednn_usable
from model.qtensor import GROUP, GroupQuantized

# int4 group: 32 input columns share a scale and a zero, as in GGUF's Q4_0/Q4_1 and the sub-blocks of Q4_K
INT4_GROUP = GROUP
# rows requantized at a time from a grouped int8 tensor to per-row scales (bounds the float32 temporary)
REQUANT_ROWS = 4096


class WeightOnlyLinear(nn.Module):
    """What int8 and int4 layers share: inputs flattened and cast to bfloat16 for the kernel, outputs cast back to
    the model's dtype, and the bias added in that dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the same Parameter: a checkpoint's bias may be loaded into it after the layer was replaced
        self.bias = linear.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # [N, in] bfloat16 -> [N, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        y = self.matmul(x.reshape(-1, self.in_features).to(torch.bfloat16))
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def int8_per_row(weight: torch.Tensor | GroupQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale per row), symmetric; a grouped tensor (Q8_0) is dequantized and
    requantized REQUANT_ROWS rows at a time, since torch's int8 kernel takes one scale per row."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0])
    for start in range(0, weight.shape[0], REQUANT_ROWS):
        end = min(start + REQUANT_ROWS, weight.shape[0])
        if isinstance(weight, GroupQuantized):
            part = GroupQuantized(8, weight.data[start:end], weight.scale[start:end]).dequantize()
        else:
            part = weight[start:end].detach().float()
        row_scales = part.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q[start:end] = torch.round(part / row_scales[:, None]).clamp(-127, 127)
        scales[start:end] = row_scales
    return q, scales


def kernel_scales(t: torch.Tensor) -> torch.Tensor:
    """Scales or minimums as our kernel reads them: float16 (a GGUF's own) or float32 kept as they are, held once
    (a tied embedding and LM head share one tensor), anything else widened to float32."""
    return (t if t.dtype in (torch.float16, torch.float32) else t.float()).contiguous()


class GroupLinear(WeightOnlyLinear):
    """A checkpoint's own groups (or a float weight's, grouped at load) through our kernel (group_kernels.py):
    scales and minimums in float32, or float16 where the checkpoint stores them so, float32 sums; 4-bit values packed
    two to a byte, 8-bit ones as they are."""

    weight: torch.Tensor  # buffers (register_buffer below)
    scale: torch.Tensor
    minimum: torch.Tensor | None

    def __init__(self, linear: nn.Linear, weight: GroupQuantized) -> None:
        super().__init__(linear)
        self.bits = weight.bits
        q = weight.data if weight.bits == 4 else weight.data.to(torch.int8)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", kernel_scales(weight.scale))
        self.register_buffer("minimum", None if weight.minimum is None else kernel_scales(weight.minimum))

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % GROUP == 0 and group_kernels.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()
        y = group_kernels.group_linear(rows, self.weight, self.scale, self.minimum, self.bits)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} groups of {GROUP}"


class Int8Linear(WeightOnlyLinear):
    weight: torch.Tensor  # buffers (register_buffer below)
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear, weight: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """weight: (int8 [out, in], float32 scale per row) to use instead of quantizing linear's own weight."""
        super().__init__(linear)
        q, scales = weight if weight is not None else int8_per_row(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 activations: a compiled GEMV over the int8 bytes, dequantized in the loop, beats a bfloat16 round
        # trip through the kernel; with bfloat16 activations the kernel wins (one stream, int8 LM head: a compiled
        # step of 9.5 ms with the GEMV, 6.7 with the kernel)
        if x.dtype == torch.float32 and is_one_row(x):
            y = one_row_linear(x.reshape(1, -1), self.weight) * self.scales.to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q [out, in] int32 in 0..15, scale [out, in/32], minimum [out, in/32]), with
    weight ~= q * scale + minimum (GroupQuantized.int4_from_float)."""
    g = GroupQuantized.int4_from_float(weight)
    assert g.minimum is not None
    return g.q.to(torch.int32), g.scale, g.minimum


class Int4Linear(WeightOnlyLinear):
    """Group-wise asymmetric int4 through torch's CPU kernel (`_weight_int4pack_mm_for_cpu`), whose dequantization
    is (q - 8) * scale + zero: zero = minimum + 8 * scale gives q * scale + minimum."""

    def __init__(self, linear: nn.Linear, weight: GroupQuantized | None = None) -> None:
        """weight: a checkpoint's own 4-bit tensor to use instead of quantizing linear's weight."""
        super().__init__(linear)
        g = weight if weight is not None else GroupQuantized.int4_from_float(linear.weight)
        scale = g.scale.float()
        minimum = g.minimum.float() if g.minimum is not None else torch.zeros_like(scale)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), 1)  # [out, in/2] uint8
        self.register_buffer("weight", packed)
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

    int8: every nn.Linear, the LM head included. int4: the decoder layers' linears; the LM head stays at 8 bits
    (our kernel) or bfloat16 (oneDNN, without it), because the vocabulary projection is where int4's error shows most,
    and a tied head is the embedding, which GGUF files keep at 8 bits or more. A linear whose shape no kernel takes
    stays dense."""
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r}; supported: int8, int4")
    # heads without our kernel, and shapes no kernel takes, go to oneDNN in bfloat16 where it packs that, else dense
    dense_dtype = torch.bfloat16 if onednn_usable(torch.device("cpu"), torch.bfloat16) else None
    for name, child in list(module.named_modules()):
        for attr, linear in list(child.named_children()):
            if not isinstance(linear, nn.Linear):
                continue
            head = name == "" and attr == "lm_head"
            if GroupLinear.supports(linear):
                grouped = GroupQuantized.int8_from_float if method == "int8" or head else GroupQuantized.int4_from_float
                replacement: nn.Module = GroupLinear(linear, grouped(linear.weight))
            elif method == "int8":
                replacement = Int8Linear(linear)
            elif Int4Linear.supports(linear) and not head:
                replacement = Int4Linear(linear)
            else:
                replacement = PackedLinear(linear, dense_dtype)
            setattr(child, attr, replacement)


class GroupEmbedding(nn.Module):
    """Token embeddings kept as a checkpoint's 8-bit groups (Q8_0); a tied LM head (GroupLinear) reads the same
    tensors, so the vocabulary matrix is held once, in the file's own values."""

    weight: torch.Tensor  # buffers (register_buffer below)
    scale: torch.Tensor

    def __init__(self, weight: GroupQuantized, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight.data.to(torch.int8))  # [vocab, hidden]
        self.register_buffer("scale", kernel_scales(weight.scale))  # [vocab, hidden / 32]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.weight[ids].float()
        rows = q.view(*q.shape[:-1], -1, GROUP) * self.scale[ids].float()[..., None]
        return rows.view(q.shape).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, int8 groups of {GROUP}"


class Int8Embedding(nn.Module):
    """Token embeddings kept as int8 with a float32 scale per row; a tied LM head (Int8Linear) reads the same int8
    tensor, so the vocabulary matrix is held once."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [vocab, hidden] int8
        self.register_buffer("scales", scales)  # [vocab] float32
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[ids].float() * self.scales[ids, None]).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, int8 per-row"


def install_quantized(decoder: nn.Module, name: str, weight: GroupQuantized, dtype: torch.dtype) -> None:
    """Replace the module whose parameter `name` (e.g. layers.3.mlp.down_proj.weight) the checkpoint holds
    quantized: a linear becomes Int4Linear (4 bits, when the kernel takes its shape) or Int8Linear (8 bits); the
    token embedding becomes Int8Embedding, and a tied LM head the Int8Linear on the same int8 tensor. A shape the
    kernels do not take keeps a dense weight, dequantized."""
    path, _, attr = name.rpartition(".")
    module = decoder.get_submodule(path)
    parent_path, _, child = path.rpartition(".")
    parent = decoder.get_submodule(parent_path)
    if isinstance(module, nn.Embedding) and weight.bits == 8 and group_kernels.load():
        embedding = GroupEmbedding(weight, dtype)
        parent.register_module(child, embedding)
        lm_head = decoder.get_submodule("lm_head")
        if isinstance(lm_head, nn.Linear) and lm_head.weight is module.weight:  # tied
            head = GroupLinear(lm_head, weight)  # int8 and float32 already: the embedding's tensors, held once
            assert head.weight is embedding.weight and head.scale is embedding.scale
            decoder.register_module("lm_head", head)
        return
    if isinstance(module, nn.Embedding):
        q, scales = int8_per_row(weight)
        parent.register_module(child, Int8Embedding(q, scales, dtype))
        lm_head = decoder.get_submodule("lm_head")
        if isinstance(lm_head, nn.Linear) and lm_head.weight is module.weight:  # tied
            decoder.register_module("lm_head", Int8Linear(lm_head, (q, scales)))
        return
    assert isinstance(module, nn.Linear) and attr == "weight"
    if GroupLinear.supports(module):
        parent.register_module(child, GroupLinear(module, weight))
    elif weight.bits == 4 and Int4Linear.supports(module):
        parent.register_module(child, Int4Linear(module, weight))
    elif weight.bits == 8:
        parent.register_module(child, Int8Linear(module, int8_per_row(weight)))
    else:
        module.weight.data.copy_(weight.dequantize())
