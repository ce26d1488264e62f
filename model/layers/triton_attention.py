"""FlashAttention over the paged KV cache, in Triton: the CUDA attention backend when flash-attn is not installed.

One program per (sequence, KV head, tile of query tokens). The tile's rows are (query token, query head) pairs of
the query heads that share the KV head, so GQA/MQA load each key once for the whole group. Keys and values are read
through the block table BLOCK_N positions at a time, straight from the pool ([num_blocks, block_size, KVH, D]); the
softmax is online (running max and sum, rescaled per tile), so no [queries, keys] matrix is ever stored.

Prefill chunks and decodes share the kernel: a sequence's new tokens sit at the end of its context, query i of a
chunk of L at position context_len - L + i, and sees keys at positions <= its own (and > its own - window). A mixed
step launches twice, decodes with one query token per tile, chunks with many.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1 when the kernel is jit-decorated): that is how the
tests check it against a float64 reference without a GPU."""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install may lack it; PagedAttention then never selects this backend
    triton = None


def triton_usable(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    # pointer and scalar arguments stay unannotated: triton reads annotations as type and specialization hints
    @triton.jit
    def paged_attention_kernel(  # type: ignore[no-untyped-def]
        out_ptr,  # [T, H, D]
        q_ptr,  # [T, H, D], last dim contiguous
        k_cache_ptr,  # [num_blocks, block_size, KVH, D], last dim contiguous
        v_cache_ptr,
        block_tables_ptr,  # [B, max_blocks] int32
        context_lens_ptr,  # [B] int32: tokens with KV after this step
        query_start_loc_ptr,  # [B + 1] int32
        first_seq,  # this launch covers sequences first_seq + program_id(0)
        scale_log2,  # softmax scale * log2(e): the kernel exponentiates with exp2
        window,  # sliding window (used when USE_WINDOW)
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_k_block,
        stride_k_slot,
        stride_k_head,
        stride_v_block,
        stride_v_slot,
        stride_v_head,
        stride_table,
        GROUP: tl.constexpr,  # query heads per KV head
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange needs one)
        BLOCK_SIZE: tl.constexpr,  # tokens per block of the pool
        BLOCK_Q: tl.constexpr,  # query tokens per tile
        BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q * GROUP rounded up to a power of two, >= 16 for tl.dot
        BLOCK_N: tl.constexpr,  # key positions per iteration
        USE_WINDOW: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: exact dots (tl.dot would otherwise use TF32 on Ampere and later)
    ):
        seq = first_seq + tl.program_id(0)
        kv_head = tl.program_id(1)
        tile_start = tl.program_id(2) * BLOCK_Q
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if tile_start >= q_len:  # the grid is sized for the longest chunk of the launch
            return
        first_pos = tl.load(context_lens_ptr + seq) - q_len  # position of the sequence's first new token

        rows = tl.arange(0, BLOCK_M)
        tok = tile_start + rows // GROUP  # [M] query token within the chunk
        head = kv_head * GROUP + rows % GROUP  # [M] query head
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D]
        q_pos = first_pos + tok  # [M]

        # keys this tile can see: up to its last query's position; from its first query's window start
        hi = first_pos + tl.minimum(tile_start + BLOCK_Q, q_len)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(first_pos + tile_start - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scaled scores (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_table
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [N] key positions
            pos_ok = pos < hi
            block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            k_offsets = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head  # [N]
            k_mask = pos_ok[None, :] & dim_ok[:, None]
            k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None], mask=k_mask, other=0.0)  # [D, N]
            if IEEE:  # noqa: SIM108 - a constexpr branch: triton compiles the taken side only
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale_log2  # [M, N]
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if USE_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no visible key yet (a padding row, or before its window) keeps max -inf:
            # subtracting 0 instead makes its exponentials 0 rather than NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)  # [M] rescales what was summed under the old max
            p = tl.exp2(s - m_safe[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v_offsets = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
            v_mask = pos_ok[:, None] & dim_ok[None, :]
            v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=v_mask, other=0.0)  # [N, D]
            if IEEE:  # noqa: SIM108 - as above
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_o_tok + head[:, None] * stride_o_head
        tl.store(
            out_ptr + o_offsets + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def tile_config(group: int, head_dim: int, dtype: torch.dtype, decode: bool) -> dict[str, int]:
    """Tile sizes of one launch. A tile of a decode launch is one query token (its group of heads); of a prefill
    launch, about 64 rows (64 / group tokens). Wider rows (head dim x element size) take fewer keys and rows per
    tile, so that the tiles of Q, K, V and the float32 accumulator stay within the 99 KiB of shared memory that
    every GPU since sm_80 gives a block (checked by compiling for sm_90, in tests/model/test_triton_attention.py)."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.arange takes powers of two; tl.dot K >= 16
    row_bytes = head_dim_pad * dtype.itemsize
    rows = 64 if row_bytes <= 512 else 32
    block_q = 1 if decode else max(1, rows // group)
    return dict(
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),  # tl.dot needs M >= 16
        BLOCK_N=64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16,
        num_warps=4 if head_dim_pad <= 128 else 8,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decode: int,
    max_query_len: int,
    scale: float,
    window: int | None,
    block_n: int = 0,
) -> torch.Tensor:
    """q: [T, H, D] (the new tokens, sequence after sequence; the first num_decode sequences one token each) ->
    [T, H, D]. K/V of every context position, the new ones included, must already be in the pool. No host sync:
    the grid comes from host ints, so a decode launch can be captured in a CUDA graph. block_n: keys per iteration,
    0 = tile_config's (tests set it small to get many iterations from short contexts)."""
    assert triton is not None, "triton is not installed"
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    args = (out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    # (first sequence, sequences, decode?, longest chunk) of each launch
    launches = []
    if num_decode:
        launches.append((0, num_decode, True, 1))
    if num_seqs > num_decode:
        launches.append((num_decode, num_seqs - num_decode, False, max_query_len))
    for first_seq, seqs, decode, longest in launches:
        config = tile_config(group, head_dim, q.dtype, decode)
        if block_n:
            config["BLOCK_N"] = block_n
        grid = (seqs, num_kv_heads, triton.cdiv(longest, config["BLOCK_Q"]))
        paged_attention_kernel[grid](
            *args,
            first_seq,
            scale * math.log2(math.e),
            window or 0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            USE_WINDOW=window is not None,
            IEEE=q.dtype == torch.float32,
            enable_fp_fusion=True,  # fused multiply-adds, said outright: triton 3.9 warns on its default, 3.10 flips it
            **config,
        )
    return out
