"""A checkpoint's quantized tensor as the loaders hand it over: integer values with one scale (and a minimum) per
group of input columns, exactly as the file stores them, so that a quantized layer runs on the file's own numbers
instead of a float copy requantized."""

from dataclasses import dataclass

import torch

# GGUF's Q4_0, Q4_1 and Q8_0 blocks are 32 consecutive input columns of one row
GROUP = 32


@dataclass(slots=True)
class GroupQuantized:
    """weight[r, c] = q[r, c] * scale[r, c // GROUP] + minimum[r, c // GROUP] (minimum 0 where None).

    bits 4: q uint8 in 0..15; bits 8: q int8 in -127..127. scale and minimum are float32 [out, in / GROUP]."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

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
        return cls(4, q.view(out_features, in_features), scale, minimum)

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
            parts[0].bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), minimum
        )

    def rows(self, index: torch.Tensor) -> "GroupQuantized":
        """The same rows reordered (llama.cpp's Q/K row permutation undone)."""
        minimum = None if self.minimum is None else self.minimum[index]
        return GroupQuantized(self.bits, self.q[index], self.scale[index], minimum)
