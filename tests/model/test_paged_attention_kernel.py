"""Our CPU decode attention over the paged KV cache (model/layers/paged_attention.cpp) against a float64 softmax
attention over the same keys and values gathered by hand: GQA, MQA and MHA shapes, sliding windows, block sizes,
caches in float32, bfloat16 and float16, sequences of very different lengths in one call (one split of the
longest, several of the others), a context of one token; and the decoder's layer taking it in eager and compiled
steps."""

import math

import pytest
import torch

from model.layers import group_kernels
from model.layers.attention import PagedAttention
from model.layers.tracing import compiling_here

pytestmark = pytest.mark.skipif(not group_kernels.load(), reason="our CPU kernels could not be built here")


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    rows, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for b in range(rows):
        n = int(positions[b]) + 1
        slots = [int(tables[b, t // block_size]) * block_size + t % block_size for t in range(n)]
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].double()
        values = v_cache.reshape(-1, kv_heads, dim)[slots].double()
        first = max(0, n - window) if window else 0
        for h in range(heads):
            kv = h // (heads // kv_heads)
            probs = torch.softmax(keys[first:, kv] @ q[b, h].double() * scale, 0)
            out[b, h] = probs @ values[first:, kv]
    return out


def paged_inputs(
    lengths: list[int], heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_each) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool, as the BlockManager leaves them
    tables = torch.full((len(lengths), max(blocks_each)), -1, dtype=torch.int32)
    at = 0
    for row, count in enumerate(blocks_each):
        tables[row, :count] = order[at : at + count].to(torch.int32)
        at += count
    q = torch.randn(len(lengths), heads, dim, generator=g)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int64)
    return q, k_cache, v_cache, tables, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lengths, heads, kv_heads, dim, block_size, window",
    [
        ([210], 9, 3, 64, 16, None),  # the default model, one stream
        ([1], 9, 3, 64, 16, None),  # a one-token context
        ([300, 5, 47, 16, 1], 8, 8, 32, 4, None),  # MHA, very different lengths
        ([129, 64], 4, 1, 128, 16, 7),  # MQA, a window shorter than a block
        ([500, 33], 6, 2, 64, 8, 100),  # a window over several splits
        (list(range(1, 60, 3)), 4, 2, 16, 16, None),  # more rows than threads
        ([90, 13], 14, 2, 64, 16, None),  # groups of 7 query heads: the values for 4 heads at a time, then 3
        ([40], 10, 2, 80, 16, None),  # groups of 5, head size 80: 4 heads, then 1
        ([77, 20], 4, 2, 36, 16, None),  # a head size with no vector kernel: the generic loop
    ],
)
def test_matches_float64_reference(
    dtype: torch.dtype,
    lengths: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    window: int | None,
) -> None:
    q, k_cache, v_cache, tables, positions = paged_inputs(lengths, heads, kv_heads, dim, block_size, dtype, seed=dim)
    scale = 1 / math.sqrt(dim)
    out = group_kernels.paged_decode_attention(q, k_cache, v_cache, tables, positions, scale, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # the cache's values are used exactly as stored; only float32 sums and the exp polynomial differ
    expected = reference(q, k_cache, v_cache, tables, positions, scale, window)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


def test_bfloat16_queries_come_back_in_bfloat16() -> None:
    q, k_cache, v_cache, tables, positions = paged_inputs([40, 9], 4, 2, 32, 16, torch.bfloat16, seed=1)
    out = group_kernels.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, positions, 0.2, None)
    expected = reference(q.bfloat16().float(), k_cache, v_cache, tables, positions, 0.2, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-3)


def test_queries_may_be_a_strided_view() -> None:
    # as the decoder passes them: the query heads of a fused qkv projection's output
    q, k_cache, v_cache, tables, positions = paged_inputs([50, 7], 4, 2, 32, 16, torch.float32, seed=5)
    qkv = torch.cat([q.flatten(1), torch.randn(2, 2 * 2 * 32)], dim=1)
    view = qkv[:, : 4 * 32].view(2, 4, 32)
    assert not view.is_contiguous()
    out = group_kernels.paged_decode_attention(view, k_cache, v_cache, tables, positions, 0.2, None)
    expected = reference(q, k_cache, v_cache, tables, positions, 0.2, None)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


def test_rejects_mismatched_inputs() -> None:
    q, k_cache, v_cache, tables, positions = paged_inputs([20], 4, 2, 32, 16, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="index dtypes"):
        group_kernels.paged_decode_attention(q, k_cache, v_cache, tables.long(), positions, 0.2, None)
    with pytest.raises(RuntimeError, match="does not match the cache"):
        group_kernels.paged_decode_attention(q[..., :16], k_cache, v_cache, tables, positions, 0.2, None)


class _Batch:  # what PagedAttention reads of a decode-only Batch
    def __init__(self, tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> None:
        self.block_tables = tables
        self.positions = positions
        rows = torch.arange(len(positions))
        self.slot_mapping = tables[rows, positions // block_size].long() * block_size + positions % block_size
        self.num_decode = self.num_seqs = len(positions)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_layer_writes_the_new_keys_and_attends_through_the_kernel(compiled: bool) -> None:
    lengths, heads, kv_heads, dim, block_size = [37, 3, 16], 6, 2, 32, 16
    q, k_cache, v_cache, tables, positions = paged_inputs(lengths, heads, kv_heads, dim, block_size, torch.float32, 3)
    attn = PagedAttention(heads, kv_heads, dim, 1 / math.sqrt(dim), window=None)
    attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()
    attn.use_cpu_kernel = True
    g = torch.Generator().manual_seed(4)
    new_k, new_v = torch.randn(3, kv_heads, dim, generator=g), torch.randn(3, kv_heads, dim, generator=g)
    batch = _Batch(tables, positions, block_size)
    with torch.inference_mode():
        if compiled:
            with compiling_here():
                out = torch.compile(attn, fullgraph=True)(q, new_k, new_v, batch)
        else:
            out = attn(q, new_k, new_v, batch)
    # the new keys and values went to each row's own slot, and the row saw them
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    flat_k[batch.slot_mapping], flat_v[batch.slot_mapping] = new_k, new_v
    torch.testing.assert_close(attn.k_cache, k_cache, rtol=0, atol=0)
    expected = reference(q, k_cache, v_cache, tables, positions, 1 / math.sqrt(dim), None)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
