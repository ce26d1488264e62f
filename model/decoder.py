"""One decoder for every supported family: embed -> N x (norm, RoPE attention, norm, gated MLP) -> norm -> LM head.
Architecture differences are ModelConfig fields; checkpoint names are mapped by tables in load_weights."""

from collections.abc import Callable, Iterable
from typing import ClassVar, cast

import torch
from torch import nn

from model.batch import Batch
from model.config import ModelConfig
from model.layers.attention import PagedAttention
from model.layers.mlp import GatedMLP
from model.layers.norm import RMSNorm
from model.layers.rotary import RotaryEmbedding
from model.qtensor import GroupQuantized


class WeightError(ValueError):
    pass


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_unit_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # rows: [q (H*D); k (KVH*D); v (KVH*D)]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scale, window)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        # x: [T, hidden]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = self.rotary(batch.positions, qk, batch.rotary_cache)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KVH, D]
        o = self.attn(q, k, v, batch)  # [T, H, D]
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.attn_norm = _norm(config, config.hidden_size)
        self.self_attn = Attention(config, rotary, window)
        # Gemma 3 also norms each sub-block's output before it joins the residual stream
        self.attn_out_norm = _norm(config, config.hidden_size) if config.sandwich_norms else None
        self.mlp_norm = _norm(config, config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.mlp_out_norm = _norm(config, config.hidden_size) if config.sandwich_norms else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the previous sub-block's output [T, hidden]; residual: the running sum, None before the first layer
        if residual is None:
            residual, h = x, self.attn_norm(x)
        else:
            h, residual = self.attn_norm(x, residual)
        h = self.self_attn(h, batch)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        h, residual = self.mlp_norm(h, residual)
        h = self.mlp(h)
        return (h if self.mlp_out_norm is None else self.mlp_out_norm(h)), residual


class Decoder(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard index); checkpoints that are already
    # fused (Phi-3's qkv_proj, gate_up_proj) match our names directly and fill every shard at once
    PACKED: ClassVar[dict[str, tuple[str, int]]] = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        c = config
        global_rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling, c.rotary_dim)
        local_rope = global_rope
        if c.local_rope_theta is not None:
            local_rope = RotaryEmbedding(
                c.head_dim, max_positions, c.local_rope_theta, c.local_rope_scaling, c.rotary_dim
            )
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, global_rope if w is None else local_rope, w) for w in c.layer_windows
        )
        self.norm = _norm(c, c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def allocate(cls, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> "Decoder":
        """Uninitialized parameters in `dtype` on `device`, ready for load_weights. The dtype is set while still on
        the meta device: to_empty() in float32 then .to(bfloat16) would touch (make resident) the float32 copy."""
        with torch.device("meta"):
            decoder = cls(config, max_positions)
        decoder = decoder.to(dtype).to_empty(device=device)
        decoder.tie_weights()
        return decoder

    def attention_layers(self) -> list[PagedAttention]:
        """Each layer's paged attention, in layer order: where the ModelRunner puts the KV pool."""
        # nn.ModuleList's items are typed nn.Module; these are the DecoderLayers built in __init__
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.layers]

    def tie_weights(self) -> None:
        # to_empty() re-creates parameters, which unties them: call again after moving off the meta device
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: Batch) -> torch.Tensor:
        """All new tokens of the batch -> hidden states of the tokens that sample: [S, hidden]."""
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]
        if self.config.embed_scale != 1.0:
            # in the weights' dtype, as transformers does (Gemma: sqrt(3072) becomes 55.5 in bfloat16)
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [S, V]
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | GroupQuantized]],
        on_quantized: Callable[[str, GroupQuantized], None] | None = None,
    ) -> None:
        """Copy checkpoint tensors (transformers names) into our parameters; every parameter must be filled once.
        Raises WeightError naming the tensor on an unexpected, missing or wrongly shaped tensor.

        A quantized tensor goes to `on_quantized` (our parameter name, all its shards joined) once every shard of
        the parameter has come quantized alike; shards of a parameter the checkpoint mixes are dequantized into it."""
        params = dict(self.named_parameters())  # a tied lm_head.weight is listed once, as embed_tokens.weight
        filled: dict[str, set[int]] = {name: set() for name in params}
        pending: dict[str, dict[int, GroupQuantized]] = {}  # quantized shards of parameters not yet complete
        for hf_name, tensor in weights:
            if "rotary_emb." in hf_name:
                continue
            if self.config.ignored_weights and hf_name.startswith(self.config.ignored_weights):
                continue  # a multimodal checkpoint's vision tower and projector
            name, shard = self._our_name(hf_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            if name not in params:
                raise WeightError(f"unexpected tensor {hf_name!r} in the checkpoint")
            target = params[name].data
            if shard is not None:
                sizes = self._shard_sizes(name)
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            shards = {shard} if shard is not None else set(range(len(self._shard_sizes(name))))
            if isinstance(tensor, GroupQuantized) and on_quantized is not None and not filled[name]:
                parts = pending.setdefault(name, {})
                parts[min(shards)] = tensor
                if shard is not None and len(parts) < len(self._shard_sizes(name)):
                    continue  # the other shards of this fused parameter are still to come
                del pending[name]
                joined = [parts[i] for i in sorted(parts)]
                if len({p.bits for p in joined}) == 1:
                    on_quantized(name, GroupQuantized.cat(joined) if len(joined) > 1 else joined[0])
                    filled[name] = set(range(len(self._shard_sizes(name))))
                    continue
                for i, part in parts.items():  # 4- and 8-bit shards in one matrix: dense
                    self._fill(params[name].data, name, i, part.dequantize())
                filled[name] = set(parts)
                continue
            target.copy_(tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor)
            filled[name] |= shards
            for i, part in pending.pop(name, {}).items():  # quantized shards beside a dense one: all dense
                self._fill(params[name].data, name, i, part.dequantize())
                filled[name].add(i)
        missing = [
            self._checkpoint_name(name, shard if len(self._shard_sizes(name)) > 1 else None)
            for name, shards in filled.items()
            for shard in range(len(self._shard_sizes(name)))
            if shard not in shards
        ]
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise WeightError(f"missing tensors in the checkpoint: {', '.join(missing[:8])}{more}")

    def _fill(self, param: torch.Tensor, name: str, shard: int, tensor: torch.Tensor) -> None:
        sizes = self._shard_sizes(name)
        param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)

    def _our_name(self, hf_name: str) -> tuple[str, int | None]:
        """transformers name -> (our parameter name, shard index within a fused parameter or None)."""
        name = hf_name
        for theirs, ours in self.config.weight_prefixes:  # e.g. language_model.model. -> model.
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
                break
        name = name.removeprefix("model.")
        for theirs, ours in self.config.weight_names:
            if theirs in name:
                name = name.replace(theirs, ours)
                break
        for fragment, (fused, index) in self.PACKED.items():
            if fragment in name:
                return name.replace(fragment, fused), index
        return name, None

    def _checkpoint_name(self, name: str, shard: int | None) -> str:
        """Our parameter name (and shard) -> the transformers name a checkpoint would carry, for messages."""
        if shard is not None:
            name = next(
                name.replace(fused, part) for part, (fused, i) in self.PACKED.items() if fused in name and i == shard
            )
        for theirs, ours in self.config.weight_names:
            if ours in name:
                name = name.replace(ours, theirs)
                break
        return name if name.startswith("lm_head.") else f"model.{name}"

    def _shard_sizes(self, name: str) -> list[int]:
        """Rows of each checkpoint tensor fused into parameter `name`, in order ([-1] when it is not fused)."""
        c = self.config
        if ".qkv_proj." in name:
            return [c.q_size, c.kv_size, c.kv_size]
        if ".gate_up_proj." in name:
            return [c.intermediate_size, c.intermediate_size]
        return [-1]
