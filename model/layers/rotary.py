"""Rotary position embedding (the "rotate half" layout of transformers), with llama3 and linear rope scaling."""

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 exactly as transformers computes it, so positions far into the context rotate identically
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]  # type: ignore[index]
    if kind == "llama3":
        assert rope_scaling is not None
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        inv_freq = inverse_frequencies(head_dim, theta, None)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, longrope")


def longrope_tables(
    rotary_dim: int, theta: float, scaling: dict[str, Any], positions: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): (angles [P, R/2], cos/sin multiplier). Positions below the pretraining
    length use short_factor, the rest long_factor: what transformers computes for each new token when decoding
    with its cache (it picks the table by the sequence length so far). A single prefill longer than the
    pretraining length differs: transformers then uses long_factor for all of its positions."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim
    short, long = (
        1.0 / (torch.tensor(scaling[key], dtype=torch.float32, device=positions.device) * theta**exponent)
        for key in ("short_factor", "long_factor")
    )
    angles = torch.where(positions[:, None] < original, torch.outer(positions, short), torch.outer(positions, long))
    return angles, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin table for positions [0, max_positions); rotates the first `rotary_dim` dims of each head.

    The table is a plain attribute, not a buffer: `.to(dtype)` must never round it, and it is (re)built on the
    device of the first positions it sees, so decoders built on the meta device need no extra call."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict[str, Any] | None, rotary_dim: int = 0
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.cos_sin = torch.empty(0)

    def build_cache(self, device: torch.device | str = "cpu") -> None:
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        if (self.rope_scaling or {}).get("rope_type") == "longrope":
            assert self.rope_scaling is not None
            freqs, scale = longrope_tables(self.rotary_dim, self.theta, self.rope_scaling, t)  # [P, R/2]
            self.cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)  # [P, R]
            return
        inv_freq = inverse_frequencies(self.rotary_dim, self.theta, self.rope_scaling).to(device)
        freqs = torch.outer(t, inv_freq)  # [P, R/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, R]

    def forward(
        self, positions: torch.Tensor, qk: torch.Tensor, cache: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """qk: [T, heads, D], the query and key heads side by side, rotated in one pass. `cache` (one per step,
        shared by all layers) holds this table's cos and sin at `positions`, looked up once instead of per layer."""
        cos_sin = cache.get(id(self))
        if cos_sin is None:
            if self.cos_sin.numel() == 0 or self.cos_sin.device != positions.device:
                self.build_cache(positions.device)
            cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
            cos_sin = cache[id(self)] = (cos, sin)
        cos, sin = cos_sin
        if self.rotary_dim == self.head_dim:
            return _rotate(qk, cos, sin)
        # partial rotary (Phi): the first rotary_dim dims of each head rotate, the rest pass through
        return torch.cat([_rotate(qk[..., : self.rotary_dim], cos, sin), qk[..., self.rotary_dim :]], dim=-1)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, scaling={self.rope_scaling}"
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
