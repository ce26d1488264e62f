"""A checkpoint's quantized tensor as the loaders hand it over: integer values with one scale (and a minimum) per
group of input columns, exactly as the file stores them, so that a quantized layer runs on the file's own numbers
instead of a float copy requantized."""

from dataclasses import dataclass

import torch

# GGUF's Q4_0, Q4_1 and Q8_0 blocks are 32 consecutive input columns of one row
GROUP = 32


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 2] uint8 in ggml's block layout (group value j low, j + 16 high)."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles undone: [N, K / 2] uint8 -> [N, K] values 0..15."""
    n = packed.shape[0]
    g = packed.view(n, -1, GROUP // 2)
    return torch.cat([g & 0x0F, g >> 4], dim=-1).view(n, -1)


@dataclass(slots=True)
class GroupQuantized:
    """weight[r, c] = q[r, c] * scale[r, c // GROUP] + minimum[r, c // GROUP] (minimum 0 where None).

    bits 4: `data` holds q (0..15) two to a byte in ggml's block layout (pack_nibbles), uint8 [out, in / 2]: a GGUF
    Q4 tensor's own bytes, which our kernel reads as they are; bits 8: `data` is q itself, int8 [out, in] in
    -127..127. scale and minimum are float32 [out, in / GROUP], or float16 (a GGUF's own, as it stores them)."""

    bits: int
    data: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None

    @classmethod
    def from_values(
        cls, bits: int, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None
    ) -> "GroupQuantized":
        return cls(bits, pack_nibbles(q) if bits == 4 else q, scale, minimum)

    @property
    def shape(self) -> torch.Size:
        rows, columns = self.data.shape
        return torch.Size((rows, columns * 2 if self.bits == 4 else columns))

    @property
    def q(self) -> torch.Tensor:
        """The values one per element, [out, in]."""
        return unpack_nibbles(self.data) if self.bits == 4 else self.data

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.q.shape
        w = self.q.float().view(out_features, -1, GROUP) * self.scale[..., None]
        if self.minimum is not None:
            w += self.minimum[..., None]
        return w.view(out_features, in_features)

    @classmethod
    def int4_from_float(cls, weight: torch.Tensor) -> "GroupQuantized":
        """Asymmetric min/max per group: a GGUF Q4_1 tensor (whose quantizer puts each group's minimum at q=0 and
        maximum at q=15) comes back as its own q, scale and minimum; another 4-bit grid (Q4_K's sub-blocks) as
        nearly its own."""
        out_features, in_features = weight.shape
        w = weight.detach().float().view(out_features, in_features // GROUP, GROUP)
        minimum, maximum = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((maximum - minimum) / 15).clamp(min=1e-10)
        q = ((w - minimum[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls.from_values(4, q.view(out_features, in_features), scale, minimum)

    @classmethod
    def int8_from_float(cls, weight: torch.Tensor) -> "GroupQuantized":
        """Symmetric per group, as GGUF's Q8_0: q in -127..127, scale = the group's largest magnitude / 127."""
        out_features, in_features = weight.shape
        w = weight.detach().float().view(out_features, in_features // GROUP, GROUP)
        scale = (w.abs().amax(dim=-1) / 127).clamp(min=1e-10)
        q = (w / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(8, q.view(out_features, in_features), scale)

    @staticmethod
    def cat(parts: "list[GroupQuantized]") -> "GroupQuantized":
        """Row blocks of one fused matrix (q, k, v) as one."""
        minimum = None
        if any(p.minimum is not None for p in parts):
            minimum = torch.cat([torch.zeros_like(p.scale) if p.minimum is None else p.minimum for p in parts])
        return GroupQuantized(
            parts[0].bits, torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), minimum
        )

    def rows(self, index: torch.Tensor) -> "GroupQuantized":
        """The same rows reordered (llama.cpp's Q/K row permutation undone)."""
        minimum = None if self.minimum is None else self.minimum[index]
        return GroupQuantized(self.bits, self.data[index], self.scale[index], minimum)
