"""Batched sampling on a [B, V] logits tensor. Per-row parameters arrive as tensors (SamplingBatch); the sampler
knows no Sequence.

Order (vLLM's): logit_bias -> repetition penalty -> presence/frequency penalties -> min_tokens mask -> grammar
bitmask (structured output) -> greedy argmax
or temperature -> min_p -> top_k -> top_p (each on the distribution the previous steps left) -> one inverse-CDF draw.
Logprobs come from log_softmax of the raw logits, before any of that (vLLM's default "raw" logprobs).

Cost matters more than elegance here (2 CPU cores, B up to 64, V = 49152): a full sort of [16, 49152] costs ~35 ms and
torch.multinomial / exponential noise ~15-35 ms, so the sampler never sorts the vocabulary unless a nucleus is huge,
and draws one uniform per row (a two-level inverse CDF) instead of V exponentials.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.sampling_params import SamplingParams, TokenLogprob

_MIN_TEMPERATURE = 1e-5  # below this a row is greedy: logits / T would overflow and the result is argmax anyway
_FIRST_NUCLEUS_GUESS = 128  # top-p first looks at the top 128 tokens, then wider until the nucleus fits
_BLOCK = 128  # ids per block of the two-level inverse-CDF draw
_TOPK_BLOCK = 64  # ids per block of top_k_of's first pass
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so division is harmless
    top_k: torch.Tensor  # [B] int64; vocab size = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    all_greedy: bool
    greedy: torch.Tensor  # [B] bool
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    generators: list[torch.Generator | None]  # per row; None draws from torch's default generator
    any_greedy: bool = False
    any_top_k: bool = False  # among sampled rows
    any_top_p: bool = False
    any_min_p: bool = False
    # Sparse edits: (row index [N], token id [N], value [N]); None when no row needs them.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) set to -inf: eos/stop ids under min_tokens
    # Penalties as sparse (row, token id) lists: only tokens that occurred can be penalized, so no [B, V] tensor.
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, count in the output) [N]
    presence: torch.Tensor | None = None  # [B] float32
    frequency: torch.Tensor | None = None  # [B] float32
    seen: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) [M]: in prompt or output, repetition rows only
    repetition: torch.Tensor | None = None  # [B] float32
    logprobs: list[int | None] | None = None  # per row: None or how many top alternatives; None when no row asks
    # Grammar constraints: xgrammar's packed bitmask [R, ceil(V / 32)] int32 of allowed ids, for batch rows `rows`.
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None

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
        def tensor(values: Sequence[object], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        greedy = [p.temperature < _MIN_TEMPERATURE for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        batch = cls(
            temperature=tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            ),
            top_k=tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            greedy=tensor(greedy, torch.bool),
            min_p=tensor([p.min_p for p in params], torch.float32),
            generators=list(generators),
            any_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            any_min_p=any(p.min_p > 0.0 for p in sampled),
        )
        if any(p.logprobs is not None for p in params):
            batch.logprobs = [p.logprobs for p in params]

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if 0 <= t < vocab_size]
        if bias:
            bias_rows, bias_ids, bias_values = zip(*bias, strict=True)
            batch.logit_bias = (
                tensor(bias_rows, torch.int64),
                tensor(bias_ids, torch.int64),
                tensor(bias_values, torch.float32),
            )

        # min_tokens: the row may not end yet, so every id that would end it is banned (ignore_eos does not matter).
        # A constrained row ends where its grammar does: banning the end there would leave it no token at all.
        banned = [
            (i, t)
            for i, (p, out) in enumerate(zip(params, output_token_ids, strict=True))
            if len(out) < p.min_tokens and p.constraint is None
            for t in {*eos_token_ids, *p.stop_token_ids}
            if 0 <= t < vocab_size
        ]
        if banned:
            banned_rows, banned_ids = zip(*banned, strict=True)
            batch.banned = (tensor(banned_rows, torch.int64), tensor(banned_ids, torch.int64))

        pen = [i for i, p in enumerate(params) if p.presence_penalty != 0 or p.frequency_penalty != 0]
        if pen:
            rows, ids, counts = _occurrences([output_token_ids[i] for i in pen], pen, vocab_size, device)
            batch.counted = (rows, ids, counts.float())
            batch.presence = tensor([p.presence_penalty for p in params], torch.float32)
            batch.frequency = tensor([p.frequency_penalty for p in params], torch.float32)
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            ids_per_row = [prompt_token_ids[i] + output_token_ids[i] for i in rep]
            batch.seen = _occurrences(ids_per_row, rep, vocab_size, device)[:2]
            batch.repetition = tensor([p.repetition_penalty for p in params], torch.float32)
        return batch


def _occurrences(
    ids_per_row: list[list[int]], row_index: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, ids, counts), each [N]: every distinct in-vocabulary id of each row, how often it occurs, and the row's
    index in the batch (row_index[r] for ids_per_row[r])."""
    ids = torch.tensor(list(itertools.chain.from_iterable(ids_per_row)), dtype=torch.int64)  # [T], on CPU for unique
    rows = torch.repeat_interleave(torch.tensor(row_index), torch.tensor([len(r) for r in ids_per_row]))  # [T]
    valid = (ids >= 0) & (ids < vocab_size)
    keys, counts = torch.unique(rows[valid] * vocab_size + ids[valid], return_counts=True)  # [N]
    return (keys // vocab_size).to(device), (keys % vocab_size).to(device), counts.to(device)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprob | None] | None = None  # per row, None where not asked; None when no row asked


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits  # [B, V]; logprobs are taken from these, before any processing
        logits = apply_penalties(logits.float(), batch)
        if batch.all_greedy:
            token_ids = greedy(logits)
        elif batch.any_greedy:
            token_ids = torch.where(batch.greedy, greedy(logits), sample(logits, batch))
        else:
            token_ids = sample(logits, batch)
        logprobs = None if batch.logprobs is None else compute_logprobs(raw, token_ids, batch.logprobs)
        return SamplerOutput(token_ids, logprobs)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, the first index on ties (as argmax). torch.max's reduction is vectorized on CPU
    where argmax's is not: [16, 49152] float32 on 2 threads 0.17 against 0.52 ms."""
    return logits.max(dim=-1).indices


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, repetition (HF), presence/frequency (OpenAI), min_tokens bans, grammar bitmask: edits of a [B, V]
    copy."""
    if (
        batch.logit_bias is None
        and batch.seen is None
        and batch.counted is None
        and batch.banned is None
        and batch.token_bitmask is None
    ):
        return logits
    logits = logits.clone()
    if batch.logit_bias is not None:
        logits.index_put_(batch.logit_bias[:2], batch.logit_bias[2], accumulate=True)
    if batch.seen is not None and batch.repetition is not None:  # divide positive logits, multiply negative ones
        rows, ids = batch.seen
        values, penalty = logits[rows, ids], batch.repetition[rows]  # [M]
        logits.index_put_((rows, ids), torch.where(values > 0, values / penalty, values * penalty))
    if batch.counted is not None and batch.frequency is not None and batch.presence is not None:
        rows, ids, counts = batch.counted  # over generated tokens only; every listed id occurred (count >= 1)
        penalty = counts * batch.frequency[rows] + batch.presence[rows]  # [N]
        logits.index_put_((rows, ids), -penalty, accumulate=True)
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.token_bitmask is not None:  # disallowed ids -> -inf, in place, on the masked rows only
        bitmask, masked_rows = batch.token_bitmask
        import xgrammar  # only once a constrained request runs (see structured_output.py)

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=masked_rows)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] token ids drawn from the filtered distribution. Greedy rows get a harmless draw (the caller drops it).

    The kept set is a threshold in vocabulary order and the draw is an inverse-CDF search over the vocabulary, so a
    seeded row's token depends only on its own logits and its own generator, never on which rows share the batch."""
    return draw(filtered_probs(logits, batch), draw_uniform(batch.generators, logits.device))


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] softmax(logits / T) with what min_p, top_k and top_p drop set to 0 (not renormalized: draw() scales)."""
    probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)  # [B, V]
    if batch.any_min_p:  # p < min_p * p_max; the ratio is the same before and after renormalizing
        probs = drop_below(probs, batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True))
    if batch.any_top_k or batch.any_top_p:
        probs = drop_below(probs, truncation_threshold(probs, batch))
    return probs


def drop_below(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """probs [B, V] with entries below their row's threshold [B, 1] set to 0; ties are kept.

    Four elementwise ops instead of `probs.masked_fill(probs < threshold, 0)`, which costs ~6x more on CPU (building
    the bool mask is the slow part). Kept entries come back as (p - t) + t, within an ulp of p."""
    shifted = F.threshold(probs - threshold, -_TINY, -1.0, inplace=True)  # p >= t -> p - t (>= 0); p < t -> -1
    return shifted.add_(threshold).clamp_min_(0.0)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] ids: for each row the first id whose cumulative (unnormalized) probability exceeds u * total.

    Two levels, blocks of 128 ids and then ids inside the chosen block, so there is no [B, V] cumsum (float64 over
    49152 ids costs ~5 ms). Cumulative sums are float64 (a tiny probability keeps its width) and searches take the
    first cdf value strictly above the target, so an id of probability 0 is never picked."""
    rows, vocab = probs.shape
    n_blocks = -(-vocab // _BLOCK)
    if n_blocks * _BLOCK != vocab:
        probs = F.pad(probs, (0, n_blocks * _BLOCK - vocab))
    blocks = probs.view(rows, n_blocks, _BLOCK)
    mass = blocks.sum(dim=-1).double()  # [B, NB]
    cdf = mass.cumsum(dim=-1)  # [B, NB]
    target = u[:, None] * cdf[:, -1:]  # [B, 1] in [0, total)
    block = torch.searchsorted(cdf, target, right=True).clamp_max_(n_blocks - 1)  # [B, 1], a block of mass > 0
    block_mass = mass.gather(1, block)
    # Where inside the block the target falls, as a fraction of the block (< 1, so never past its last non-zero).
    frac = ((target - (cdf.gather(1, block) - block_mass)) / block_mass).clamp_(0.0, 1.0 - 2.0**-40)  # [B, 1]
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1).double().cumsum(dim=-1)  # [B, 128]
    within = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_max_(_BLOCK - 1)  # [B, 1]
    return (block * _BLOCK + within).squeeze(-1).clamp_max_(vocab - 1)


def truncation_threshold(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, 1] smallest probability each row keeps under top_k then top_p (on the top-k-renormalized distribution).

    top_k alone needs the k-th value; top_p needs the sorted head up to the nucleus edge. Both come from topk() on
    the head only, widened for rows whose nucleus does not fit yet (a full sort costs ~35 ms at [16, 49152]; only a
    flat row, e.g. top_p 0.9 at a high temperature, ends up there). Ties at the edge are all kept.
    Row results never depend on the head width K (cumsums are sequential), so batch neighbours cannot change them."""
    vocab = probs.shape[-1]
    threshold = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)  # 0 = keep everything
    truncated = ~batch.greedy & ((batch.top_k < vocab) | (batch.top_p < 1.0))
    pending = truncated.nonzero().squeeze(-1)  # [P] rows whose edge is not found yet
    k_guess = _FIRST_NUCLEUS_GUESS
    while pending.numel() > 0:
        top_k, top_p = batch.top_k[pending], batch.top_p[pending]  # [P]
        # Head width: each row's top_k when set, else the current nucleus guess.
        k_head = min(vocab, int(torch.where(top_k < vocab, top_k, k_guess).max()))
        rows = probs if pending.numel() == probs.shape[0] else probs.index_select(0, pending)  # [P, V]
        head = top_k_of(rows, k_head).values  # [P, K] sorted descending
        in_top_k = torch.arange(k_head, device=probs.device)[None, :] < top_k[:, None]  # [P, K]
        head = head.masked_fill(~in_top_k, 0.0)
        cum = head.cumsum(dim=-1)  # [P, K]
        # Mass the nucleus is measured against: the top-k mass when top_k is on (renormalized), else all of it.
        k_mass = cum.gather(1, (top_k.clamp_max(k_head) - 1)[:, None]).squeeze(-1)
        mass = torch.where(top_k < vocab, k_mass, rows.sum(dim=-1))  # [P]; < 1 after min_p
        inside = (cum - head) < top_p[:, None] * mass[:, None]  # [P, K] mass strictly above the rank < top_p
        keep = in_top_k & (inside | (top_p[:, None] >= 1.0))  # top_p = 1 keeps all, whatever the rounding
        keep[:, 0] = True  # the most likely token always survives
        # Fits: the nucleus edge lies inside the head, or the head already is the whole kept set.
        fits = (~keep[:, -1]) | (top_k <= k_head) | (k_head == vocab)
        last = keep.sum(dim=-1) - 1  # [P] rank of the least likely kept token
        threshold[pending[fits]] = head[fits].gather(1, last[fits][:, None])
        # Widen 8x, or more where the head holds only a small part of the mass the nucleus needs (a flat row):
        # straight to the whole vocabulary rather than paying for several ever larger topk calls.
        short = (top_p * mass / cum[:, -1].clamp_min(_TINY))[~fits]  # [P'] needed / held, >= 1 for the pending
        pending = pending[~fits]
        wider = k_head * max(8.0, 2.0 * float(short.max())) if short.numel() else vocab
        k_guess = vocab if wider > vocab // 4 else int(wider)
    return threshold


def top_k_of(x: torch.Tensor, k: int) -> torch.return_types.topk:
    """x.topk(k, dim=-1), faster for small k: the top k entries all lie in the k blocks (of 64) with the largest
    maxima, so topk runs on block maxima [R, V/64] and then on those blocks' entries [R, 64k]. Same values; tied
    entries may come back as other ids of the same value."""
    rows, vocab = x.shape
    if vocab % _TOPK_BLOCK or k * 4 * _TOPK_BLOCK > vocab:
        return x.topk(k, dim=-1)
    blocks = x.reshape(rows, vocab // _TOPK_BLOCK, _TOPK_BLOCK)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [R, k] block numbers
    candidates = blocks.gather(1, best[:, :, None].expand(rows, k, _TOPK_BLOCK)).reshape(rows, k * _TOPK_BLOCK)
    values, at = candidates.topk(k, dim=-1)  # [R, k]
    ids = best.gather(1, at // _TOPK_BLOCK) * _TOPK_BLOCK + at % _TOPK_BLOCK
    return torch.return_types.topk((values, ids))


def draw_uniform(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[B] float64 in [0, 1): one number per row, seeded rows from their own generator (one draw per step)."""
    u = torch.rand(len(generators), dtype=torch.float64, device=device)
    seeded = [(i, gen) for i, gen in enumerate(generators) if gen is not None]
    if seeded:  # no .item() per row: on a GPU that would be one sync per seeded request
        draws = [torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device) for _, gen in seeded]
        u[torch.tensor([i for i, _ in seeded], device=device)] = torch.cat(draws)
    return u


def compute_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Sampled token's logprob and the top-k alternatives from log_softmax of the raw logits, for rows that asked."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    logprobs = torch.log_softmax(raw[rows].float(), dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids[rows][:, None]).squeeze(-1).tolist()  # [R]
    k_max = max(wanted[i] or 0 for i in rows)
    top = top_k_of(logprobs, k_max)  # [R, k_max], sorted descending
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[TokenLogprob | None] = [None] * len(wanted)
    for j, i in enumerate(rows):
        k = wanted[i] or 0
        out[i] = TokenLogprob(int(token_ids[i]), chosen[j], list(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return out
