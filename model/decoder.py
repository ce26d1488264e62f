"""One decoder for the Llama family: embed -> N x (RMSNorm, RoPE attention, RMSNorm, gated MLP) -> norm -> LM head.
Architecture differences are ModelConfig fields; checkpoint names are mapped by a table in load_weights."""

from collections.abc import Iterable

import torch
from torch import nn

from model.batch import Batch
from model.config import ModelConfig
from model.layers.attention import PagedAttention
from model.layers.mlp import GatedMLP
from model.layers.norm import RMSNorm
from model.layers.rotary import RotaryEmbedding


class WeightError(ValueError):
    pass


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        o = self.attn(q, k, v, batch)  # [T, H, D]
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Decoder(nn.Module):
    # checkpoint (transformers) name fragment -> (our parameter fragment, shard index) for fused matrices
    PACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, w) for w in config.layer_windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # to_empty() re-creates parameters, which unties them: call again after moving off the meta device
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: Batch) -> torch.Tensor:
        """All new tokens of the batch -> hidden states of the tokens that sample: [S, hidden]."""
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [S, V]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into our parameters; every parameter must be filled once."""
        params = dict(self.named_parameters())
        pending = {name: self._shard_count(name) for name in params}
        for hf_name, tensor in weights:
            if "rotary_emb." in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = None
            for fragment, (fused, index) in self.PACKED.items():
                if f".{fragment}." in name:
                    name, shard = name.replace(f".{fragment}.", f".{fused}."), index
                    break
            if name not in params:
                raise WeightError(f"unexpected tensor {hf_name!r} in the checkpoint")
            target = params[name].data
            if shard is not None:
                target = target.narrow(0, *self._shard_range(name, shard))
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            pending[name] -= 1
        missing = [name for name, count in pending.items() if count > 0]
        if missing:
            raise WeightError(f"missing tensors in the checkpoint: {', '.join(missing[:8])}")

    def _shard_count(self, name: str) -> int:
        if ".qkv_proj." in name:
            return 3
        if ".gate_up_proj." in name:
            return 2
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return 0
        return 1

    def _shard_range(self, name: str, shard: int) -> tuple[int, int]:
        c = self.config
        if ".qkv_proj." in name:
            sizes = [c.q_size, c.kv_size, c.kv_size]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        return sum(sizes[:shard]), sizes[shard]
