"""Paged attention on the torch path against a float64 reference over the same context (GQA, sliding window)."""

import pytest
import torch

from model.batch import Batch
from model.layers.attention import PagedAttention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    # q: [H, D] for the last position; k, v: [S, KVH, D] -> [H, D], in float64
    h, kvh, s = q.shape[0], k.shape[1], k.shape[0]
    k64 = k.double().repeat_interleave(h // kvh, dim=1)  # [S, H, D]
    v64 = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("hd,shd->hs", q.double(), k64) * q.shape[-1] ** -0.5
    if window is not None:
        scores[:, : max(0, s - window)] = float("-inf")
    return torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 5])
def test_batched_decode_matches_float64(dtype: torch.dtype, tol: float, window: int | None) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 4, 12
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5, window)
    attn.k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    attn.v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    tables = [[3, 7, 1], [5, 0], [9, 2, 11]]  # context 10, 6 and 12 tokens, blocks scattered in the pool
    ctx = [10, 6, 12]
    q = torch.randn(3, heads, dim).to(dtype)
    k_new = torch.randn(3, kv_heads, dim).to(dtype)
    v_new = torch.randn(3, kv_heads, dim).to(dtype)
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size for t, c in zip(tables, ctx, strict=True)]
    padded = [t + [-1] * (3 - len(t)) for t in tables]
    nb = 3
    batch = Batch(
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=torch.tensor([c - 1 for c in ctx]),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        query_start_loc=torch.arange(4, dtype=torch.int32),
        logits_indices=torch.arange(3),
        num_decode=3,
        max_query_len=1,
        max_context_len=12,
        query_lens_cpu=[1, 1, 1],
        context_lens_cpu=ctx,
        decode_block_ids=torch.tensor([b for t in padded for b in t]).clamp(min=0),
        decode_blocks=nb,
        decode_mask=(torch.arange(nb * block_size)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :],
    )
    out = attn(q, k_new, v_new, batch)
    for i, (table, c) in enumerate(zip(tables, ctx, strict=True)):
        k = attn.k_cache[table].reshape(-1, kv_heads, dim)[:c]  # includes the K just written through slot_mapping
        v = attn.v_cache[table].reshape(-1, kv_heads, dim)[:c]
        assert torch.equal(k[-1], k_new[i]) and torch.equal(v[-1], v_new[i])
        expected = reference(q[i], k, v, window)
        assert (out[i].double() - expected).abs().max().item() <= tol


@pytest.mark.parametrize("chunk", [20, 70])  # below and above the row count that takes the additive float mask
@pytest.mark.parametrize("window", [None, 30])
def test_a_prompt_chunk_over_its_cached_prefix_matches_float64(chunk: int, window: int | None) -> None:
    torch.manual_seed(1)
    heads, kv_heads, dim, block_size = 6, 2, 16, 8
    prefix, total = 50, 50 + chunk
    num_blocks = -(-total // block_size)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5, window)
    attn.k_cache = torch.randn(num_blocks + 3, block_size, kv_heads, dim)
    attn.v_cache = torch.randn(num_blocks + 3, block_size, kv_heads, dim)
    table = torch.randperm(num_blocks + 3)[:num_blocks]  # the sequence's blocks, scattered in the pool
    q = torch.randn(chunk, heads, dim)
    k_new, v_new = torch.randn(chunk, kv_heads, dim), torch.randn(chunk, kv_heads, dim)
    positions = torch.arange(prefix, total)
    batch = Batch(
        input_ids=torch.zeros(chunk, dtype=torch.int64),
        positions=positions,
        slot_mapping=table[positions // block_size] * block_size + positions % block_size,
        block_tables=table[None].to(torch.int32),
        context_lens=torch.tensor([total], dtype=torch.int32),
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        logits_indices=torch.tensor([chunk - 1]),
        num_decode=0,
        max_query_len=chunk,
        max_context_len=total,
        query_lens_cpu=[chunk],
        context_lens_cpu=[total],
    )
    out = attn(q, k_new, v_new, batch)
    k = attn.k_cache[table].reshape(-1, kv_heads, dim)[:total]
    v = attn.v_cache[table].reshape(-1, kv_heads, dim)[:total]
    for i in range(chunk):  # query i sits at position prefix + i and sees keys up to there
        expected = reference(q[i], k[: prefix + i + 1], v[: prefix + i + 1], window)
        assert (out[i].double() - expected).abs().max().item() <= 1e-5
