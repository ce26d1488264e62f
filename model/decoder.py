"""One decoder for every supported family: embed -> N x (norm, RoPE attention, norm, gated MLP) -> norm -> LM head.
Architecture differences are ModelConfig fields; checkpoint names are mapped by tables in load_weights.
Under tensor parallelism each rank allocates only its slice of every layer (model/parallel.py) and load_weights
copies only that slice out of each checkpoint tensor."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import nn

from model.batch import Batch
from model.config import ModelConfig
from model.layers.attention import PagedAttention
from model.layers.mlp import GatedMLP
from model.layers.norm import RMSNorm
from model.layers.rotary import RotaryEmbedding
from model.parallel import SINGLE, Span, TensorParallel, VocabParallelEmbedding, head_shard, split, vocab_shard
from model.qtensor import GroupQuantized


class WeightError(ValueError):
    pass


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_unit_offset)


@dataclass(frozen=True, slots=True)
class Split:
    """How one parameter is cut across ranks. Along `dim`, each checkpoint tensor fused into it (q, k, v; gate, up;
    a single one otherwise) is `(rows in the checkpoint, this rank's span of them)`; no parts = replicated.
    `first_rank_only`: a row-parallel layer's bias, which the all-reduce would otherwise add world_size times."""

    dim: int = 0
    parts: tuple[tuple[int, Span], ...] = ()
    first_rank_only: bool = False


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        shard = head_shard(config.num_heads, config.num_kv_heads, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads = shard.q.size, shard.kv.size  # this rank's
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # rows: [q (H*D); k (KVH*D); v (KVH*D)] of this rank's heads; o_proj: their columns, summed over ranks
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
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None, tp: TensorParallel) -> None:
        super().__init__()
        self.attn_norm = _norm(config, config.hidden_size)
        self.self_attn = Attention(config, rotary, window, tp)
        # Gemma 3 also norms each sub-block's output before it joins the residual stream
        self.attn_out_norm = _norm(config, config.hidden_size) if config.sandwich_norms else None
        self.mlp_norm = _norm(config, config.hidden_size)
        intermediate = split(config.intermediate_size, tp.world_size, tp.rank).size  # this rank's columns
        self.mlp = GatedMLP(config.hidden_size, intermediate, config.hidden_act, config.mlp_bias, tp.all_reduce)
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

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        c = config
        global_rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling, c.rotary_dim)
        local_rope = global_rope
        if c.local_rope_theta is not None:
            local_rope = RotaryEmbedding(
                c.head_dim, max_positions, c.local_rope_theta, c.local_rope_scaling, c.rotary_dim
            )
        # this rank's vocabulary rows; kept here as well, since quantization may replace the embedding module
        self.vocab = vocab_shard(c.vocab_size, tp.world_size, tp.rank)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(c, global_rope if w is None else local_rope, w, tp) for w in c.layer_windows
        )
        self.norm = _norm(c, c.hidden_size)
        # this rank's vocabulary rows, like the embedding's (tied or not); compute_logits gathers them on rank 0
        self.lm_head = nn.Linear(c.hidden_size, self.vocab.size, bias=False)
        self.tie_weights()

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel = SINGLE,
    ) -> "Decoder":
        """Uninitialized parameters in `dtype` on `device` (this rank's slices), ready for load_weights. The dtype is
        set while still on the meta device: to_empty() in float32 then .to(bfloat16) would touch (make resident) the
        float32 copy. torch.empty rather than to_empty(): its empty_like of a meta tensor imports sympy (~50 MiB
        resident in a server that never traces)."""
        with torch.device("meta"):
            decoder = cls(config, max_positions, tp)
        decoder = decoder.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
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
        """[S, hidden] -> [S, V] float32 logits on rank 0 (the other ranks get their vocabulary slice, unused)."""
        # [:, :V] drops the last vocabulary slice's padding rows (a no-op at world size 1)
        logits = self.tp.gather_last_dim(self.lm_head(hidden))[:, : self.config.vocab_size].float()
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
            param, layout = params[name].data, self._split(name)
            shards = [shard] if shard is not None else list(range(self._num_shards(name)))
            expected = list(param.shape)  # the checkpoint's whole tensor, not this rank's slice of it
            if layout.parts:
                expected[layout.dim] = sum(layout.parts[i][0] for i in shards)
            if tuple(tensor.shape) != tuple(expected):
                raise WeightError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
            if isinstance(tensor, GroupQuantized) and on_quantized is not None and not filled[name]:
                # kept quantized: one process only (a rank loads dense, model_runner.tensor_parallel_settings)
                assert self.tp.world_size == 1, "quantized weights are not split across ranks"
                parts = pending.setdefault(name, {})
                parts[min(shards)] = tensor
                if shard is not None and len(parts) < self._num_shards(name):
                    continue  # the other shards of this fused parameter are still to come
                del pending[name]
                joined = [parts[i] for i in sorted(parts)]
                if len({p.bits for p in joined}) == 1:
                    on_quantized(name, GroupQuantized.cat(joined) if len(joined) > 1 else joined[0])
                    filled[name] = set(range(self._num_shards(name)))
                    continue
                for i, part in parts.items():  # 4- and 8-bit shards in one matrix: dense
                    self._copy_slice(param, part.dequantize(), layout, [i])
                filled[name] = set(parts)
                continue
            self._copy_slice(
                param, tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor, layout, shards
            )
            filled[name] |= set(shards)
            for i, part in pending.pop(name, {}).items():  # quantized shards beside a dense one: all dense
                self._copy_slice(param, part.dequantize(), layout, [i])
                filled[name].add(i)
        missing = [
            self._checkpoint_name(name, shard if self._num_shards(name) > 1 else None)
            for name, shards in filled.items()
            for shard in range(self._num_shards(name))
            if shard not in shards
        ]
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise WeightError(f"missing tensors in the checkpoint: {', '.join(missing[:8])}{more}")

    def _copy_slice(self, param: torch.Tensor, tensor: torch.Tensor, layout: Split, shards: list[int]) -> None:
        """Copy this rank's rows of checkpoint `tensor` (parts `shards` of a fused parameter, in order) into `param`.
        Only the slice is read: a loader's memory-mapped tensor is never copied whole."""
        if not layout.parts:
            if layout.first_rank_only and self.tp.rank != 0:
                param.zero_()
            else:
                param.copy_(tensor)
            return
        dim, read_at = layout.dim, 0  # read_at: where the next part starts in the checkpoint tensor
        for i in shards:
            full, span = layout.parts[i]
            local_at = sum(s.size for _, s in layout.parts[:i])  # where part i starts in our parameter
            rows = max(0, min(span.stop, full) - span.start)  # short of span.size only in the vocabulary's padding
            target = param.narrow(dim, local_at, span.size)
            target.narrow(dim, 0, rows).copy_(tensor.narrow(dim, read_at + span.start, rows))
            target.narrow(dim, rows, span.size - rows).zero_()
            read_at += full

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

    def _num_shards(self, name: str) -> int:
        """Checkpoint tensors fused into parameter `name` (q, k, v: 3; gate, up: 2; else 1)."""
        return max(1, len(self._split(name).parts))

    def _split(self, name: str) -> Split:
        """How our parameter `name` is cut across ranks (whole, Split(), at world size 1 and for norms)."""
        c, tp = self.config, self.tp
        heads = head_shard(c.num_heads, c.num_kv_heads, tp.world_size, tp.rank)
        q = Span(heads.q.start * c.head_dim, heads.q.size * c.head_dim)  # rows of q_proj, columns of o_proj
        kv = Span(heads.kv.start * c.head_dim, heads.kv.size * c.head_dim)
        intermediate = split(c.intermediate_size, tp.world_size, tp.rank)
        if ".qkv_proj." in name:  # column parallel, weight and bias
            return Split(0, ((c.q_size, q), (c.kv_size, kv), (c.kv_size, kv)))
        if ".gate_up_proj." in name:
            return Split(0, ((c.intermediate_size, intermediate),) * 2)
        for fragment, part in ((".o_proj.", (c.q_size, q)), (".down_proj.", (c.intermediate_size, intermediate))):
            if fragment in name:  # row parallel: the weight's columns; the bias once
                return Split(1, (part,)) if name.endswith(".weight") else Split(first_rank_only=True)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return Split(0, ((c.vocab_size, self.vocab),))
        return Split()
