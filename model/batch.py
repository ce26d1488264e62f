"""Batch: the tensors one forward step needs. Tokens of all scheduled sequences are flattened into one
dimension T (no padding); decode rows (one new token) and prefill rows (a chunk of a prompt) are grouped
so the attention backend can treat each group its fastest way."""

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64, all new tokens of all sequences, sequence after sequence
    positions: torch.Tensor  # [T] int64, absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64, flat KV-cache slot (block * block_size + offset) each token's K/V goes to
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded; row i = sequence i's KV blocks
    context_lens: torch.Tensor  # [B] int32, tokens with KV after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] int32, sequence i's new tokens are input_ids[q[i]:q[i+1]]
    logits_indices: torch.Tensor  # [S] int64, flat index of the last token of each sequence that samples this step
    num_decode: int  # the first num_decode sequences each have exactly one new token
    max_query_len: int
    max_context_len: int
    # Host copies, so the torch attention path never syncs with the device.
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # Decode rows read their context as whole blocks; shared by every layer, so built once per step.
    decode_block_ids: torch.Tensor | None = None  # [num_decode * decode_blocks] int64, block tables flattened
    decode_blocks: int = 0  # blocks per decode row (the longest row's), the rest padded with block 0
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, decode_blocks * block_size] bool, True = attend
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the same, per sliding window
    rotary_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # cos, sin at positions

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)
