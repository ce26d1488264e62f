"""Batched sampling on a [B, V] logits tensor. Per-row parameters arrive as tensors (SamplingBatch); the sampler
knows no Sequence."""

from dataclasses import dataclass

import torch
from torch import nn

from model.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; vocab size = off
    top_p: torch.Tensor  # [B] float32
    all_greedy: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(p.greedy for p in params),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per row, None where not asked


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()  # [B, V]
        greedy_ids = logits.argmax(dim=-1)
        if batch.all_greedy:
            return SamplerOutput(greedy_ids)
        temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        mask = ranks >= batch.top_k[:, None]
        cumulative = sorted_probs.cumsum(dim=-1)
        mask |= (cumulative - sorted_probs) >= batch.top_p[:, None]  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(mask, 0.0)
        choice = torch.multinomial(sorted_probs, 1).squeeze(-1)
        sampled_ids = sorted_ids.gather(-1, choice[:, None]).squeeze(-1)
        return SamplerOutput(torch.where(batch.temperature > 0, sampled_ids, greedy_ids))
