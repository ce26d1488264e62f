"""Paged attention. K/V of the new tokens are written into the block pool through `slot_mapping`; queries read
the context through `block_tables`. Three backends: flash-attn's paged varlen kernel on CUDA when it is installed,
our Triton FlashAttention kernel (triton_attention.py) on CUDA otherwise, and an exact torch path
(scaled_dot_product_attention) everywhere else.

Under torch.compile (decode-only steps) the attention is traced into the graph instead (`_traced_decode`): the cache
write as an index_put_ on the layer's own pool buffer, which inductor keeps in place, and keys and values read
through the block table inside its loops, with no gathered copy and no Python between layers."""

import torch
import torch.nn.functional as F
from torch import nn

from model.batch import Batch
from model.layers import group_kernels
from model.layers.tracing import traced
from model.layers.triton_attention import paged_attention

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
except ImportError:
    flash_attn_varlen_func = None


def flash_attn_usable(device: torch.device) -> bool:
    return flash_attn_varlen_func is not None and device.type == "cuda"


class PagedAttention(nn.Module):
    k_cache: torch.Tensor  # buffers (register_buffer below)
    v_cache: torch.Tensor

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window  # attend to the last `window` tokens, this one included; None = all
        # [num_blocks, block_size, num_kv_heads, head_dim] each; set by the ModelRunner once the pool is allocated.
        # Buffers, one allocation each: a compiled graph updates them in place only if they alias nothing.
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)
        self.use_flash = False
        self.use_triton = False  # set by the ModelRunner on CUDA without flash-attn
        self.use_cpu_kernel = False  # set by the ModelRunner on CPU where our paged_attention.cpp is built

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]
        if traced():  # compiled graphs run decode-only steps
            return self._traced_decode(q, k, v, batch)
        if self.k_cache.numel():
            # the pool may be 16-bit under a float32 model (--kv-cache-dtype); .to() is free when they agree
            self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                0, batch.slot_mapping, k.to(self.k_cache.dtype)
            )
            self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                0, batch.slot_mapping, v.to(self.v_cache.dtype)
            )
        if self.use_flash:
            return self._flash(q, batch)
        if self.use_triton:
            return paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                batch.block_tables,
                batch.context_lens,
                batch.query_start_loc,
                batch.num_decode,
                batch.max_query_len,
                self.scale,
                self.window,
            )
        return self._torch(q, k, v, batch)

    def _flash(self, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        window = (self.window - 1, 0) if self.window else (-1, -1)
        cu_seqlens_k = F.pad(batch.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            q,
            self.k_cache,
            self.v_cache,
            cu_seqlens_q=batch.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_context_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=window,
            block_table=batch.block_tables,
        )

    def _torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        nd = batch.num_decode
        if nd == batch.num_seqs:  # decode only: the common step, no copy into a shared output
            return self._decode(q, batch)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], batch)
        start = nd
        for i in range(nd, batch.num_seqs):
            q_len, ctx_len = batch.query_lens_cpu[i], batch.context_lens_cpu[i]
            # [1, heads, len, D]: torch's fused CPU kernel takes 4-D inputs only; 3-D falls back to the unfused
            # math path, 3-6x slower for a prompt chunk (measured at 508 queries x 1,508 keys)
            qi = q[start : start + q_len].transpose(0, 1)[None]
            if ctx_len == q_len:
                # the whole context is this chunk: use the fresh K/V, no gather from the pool
                ki, vi = k[start : start + q_len].transpose(0, 1)[None], v[start : start + q_len].transpose(0, 1)[None]
            else:
                ki, vi = self._gather(batch.block_tables[i : i + 1], ctx_len)
                ki, vi = ki[:, :, :ctx_len].to(q.dtype), vi[:, :, :ctx_len].to(q.dtype)  # [1, KVH, C, D]
            if self.window is None and ctx_len == q_len:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                mask = _causal_mask(q_len, ctx_len, self.window, q.device)
                if q_len >= _ADDITIVE_MASK_ROWS:
                    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out

    def _decode(self, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        # q: [B, H, D]; one query per sequence, batched over sequences with a padding mask.
        if self.use_cpu_kernel:
            nd = q.shape[0]
            return group_kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, batch.block_tables[:nd], batch.positions[:nd], self.scale, self.window
            )
        nd, nb = q.shape[0], batch.decode_blocks
        assert batch.decode_block_ids is not None and batch.decode_mask is not None
        bs = self.k_cache.shape[1]
        # index_select on the block dimension: one contiguous copy per block, faster than advanced indexing
        k = self.k_cache.index_select(0, batch.decode_block_ids).view(nd, nb * bs, self.num_kv_heads, self.head_dim)
        v = self.v_cache.index_select(0, batch.decode_block_ids).view(nd, nb * bs, self.num_kv_heads, self.head_dim)
        k, v = k.to(q.dtype), v.to(q.dtype)
        mask = batch.decode_mask if self.window is None else self._window_mask(batch)  # [B, 1, 1, S]
        # the query heads that share a KV head are that head's queries: no K/V expansion for GQA (torch's CPU
        # kernel is 5x faster so in bfloat16 than with enable_gqa at B=16-64, and 10 % in float32)
        groups = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.view(nd, self.num_kv_heads, groups, self.head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )  # [B, KVH, G, D]
        return o.reshape(nd, self.num_heads, self.head_dim)

    def _traced_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        # traced only: decode rows, q [B, H, D]; products and sums in float32 whatever the cache's dtype
        block_size = self.k_cache.shape[1]
        block, offset = batch.slot_mapping // block_size, batch.slot_mapping % block_size
        self.k_cache.index_put_((block, offset), k.to(self.k_cache.dtype))
        self.v_cache.index_put_((block, offset), v.to(self.v_cache.dtype))
        if self.use_cpu_kernel:
            return group_kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, batch.block_tables, batch.positions, self.scale, self.window
            )
        tables = batch.block_tables.clamp(min=0).long()  # [B, blocks], -1 padding read as block 0 and masked
        torch._check(tables.shape[0] == q.shape[0])
        rows = q.shape[0]
        keys = self.k_cache[tables].flatten(1, 2).permute(0, 2, 1, 3)[:, :, None]  # [B, KVH, 1, S, D]
        values = self.v_cache[tables].flatten(1, 2).permute(0, 2, 1, 3)[:, :, None]
        pos = torch.arange(keys.shape[3], device=q.device)
        last = batch.positions[:, None]  # [B, 1]: each row's own position
        visible = pos <= last
        if self.window is not None:
            visible &= pos > last - self.window
        groups = self.num_heads // self.num_kv_heads
        queries = q.view(rows, self.num_kv_heads, groups, 1, self.head_dim).float()
        scores = (queries * keys.float()).sum(-1) * self.scale  # [B, KVH, G, S]
        probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
        out = (probs[..., None] * values.float()).sum(-2)  # [B, KVH, G, D]
        return out.reshape(rows, self.num_heads, self.head_dim).to(q.dtype)

    def _window_mask(self, batch: Batch) -> torch.Tensor:
        assert self.window is not None and batch.decode_mask is not None
        mask = batch.window_masks.get(self.window)
        if mask is None:
            pos = torch.arange(batch.decode_mask.shape[-1], device=batch.decode_mask.device)
            ctx = batch.context_lens[: batch.num_decode, None, None, None]  # [B, 1, 1, 1]
            mask = batch.window_masks[self.window] = batch.decode_mask & (pos >= ctx - self.window)
        return mask

    def _gather(self, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: [B, max_blocks] -> K, V: [B, KVH, S, D] with S = length rounded up to whole blocks
        block_size = self.k_cache.shape[1]
        num_blocks = -(-length // block_size)
        blocks = block_tables[:, :num_blocks]
        b = blocks.shape[0]
        k = self.k_cache[blocks].view(b, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        v = self.v_cache[blocks].view(b, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, window={self.window}"


# From this many queries a prompt chunk's mask goes to SDPA as an additive float one: torch's CPU kernel then ran
# 256 queries x 512 / 1,500 keys in 9.2 / 14.7 ms against 15.3 / 17.4 with the boolean mask (100 x 300: 1.1 / 1.7),
# the same result; 16 queries x 1,000 keys ran 1.4 against 0.9 (Zen 3, 2 threads)
_ADDITIVE_MASK_ROWS = 64


def _causal_mask(q_len: int, ctx_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    # [L, S] bool: query i sits at position ctx_len - q_len + i and sees keys j <= that (and > that - window)
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
