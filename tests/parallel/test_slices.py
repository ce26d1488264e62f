"""Which slice each rank holds, with literal expectations, and that the ranks' slices of every parameter tile the
checkpoint tensor exactly (loaded without a process group: the collectives are only in the forward)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from config import Settings
from model.decoder import Decoder
from model.engine.model_runner import tensor_parallel_settings
from model.loaders import load_config, read_weights
from model.parallel import TensorParallel, head_shard, split, vocab_shard
from tests.model.families import BASE, randomize, save_hf


def test_split_is_contiguous_and_balanced() -> None:
    assert [(s.start, s.size) for s in (split(10, 3, r) for r in range(3))] == [(0, 3), (3, 3), (6, 4)]


def test_head_shard_splits_kv_heads_and_their_query_groups() -> None:
    # SmolLM2: 9 query heads over 3 KV heads, on 2 ranks: KV heads 1 + 2, query heads 3 + 6
    r0, r1 = head_shard(9, 3, 2, 0), head_shard(9, 3, 2, 1)
    assert (r0.q.start, r0.q.size, r0.kv.start, r0.kv.size, r0.max_kv) == (0, 3, 0, 1, 2)
    assert (r1.q.start, r1.q.size, r1.kv.start, r1.kv.size, r1.max_kv) == (3, 6, 1, 2, 2)


def test_head_shard_replicates_kv_heads_when_fewer_than_ranks() -> None:
    # 8 query heads over 2 KV heads on 4 ranks: each KV head on 2 ranks, which split its 4 query heads
    shards = [head_shard(8, 2, 4, r) for r in range(4)]
    assert [(s.q.start, s.q.size) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv.start, s.kv.size) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="KV heads"):
        head_shard(6, 2, 4, 0)  # 4 ranks cannot split 6 query heads


def test_vocab_shards_are_equal_and_the_last_is_padded() -> None:
    assert [(s.start, s.size) for s in (vocab_shard(97, 2, r) for r in range(2))] == [(0, 49), (49, 49)]
    assert (vocab_shard(49152, 2, 1).start, vocab_shard(49152, 2, 1).size) == (24576, 24576)


def test_ranks_run_dense_float32_eager_steps_on_cpu() -> None:
    tp = TensorParallel(0, 2)
    for quantization in ("auto", "int8"):
        rank = tensor_parallel_settings(Settings(quantization=quantization, dtype="auto", torch_compile=True), tp)
        assert (rank.quantization, rank.dtype, rank.torch_compile, rank.enforce_eager) == (
            "none",
            "float32",
            False,
            True,
        )
    assert tensor_parallel_settings(Settings(dtype="bfloat16"), tp).dtype == "bfloat16"  # an explicit --dtype holds
    one = Settings(quantization="int8")
    assert tensor_parallel_settings(one, TensorParallel()) is one


@pytest.mark.parametrize("tied", [True, False])
def test_rank_slices_tile_every_checkpoint_tensor(tmp_path: Path, tied: bool) -> None:
    config = LlamaConfig(**{**BASE, "vocab_size": 97, "hidden_size": 48, "intermediate_size": 99,
                            "num_attention_heads": 6, "num_key_value_heads": 3}, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=tied)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    folder = save_hf(model, tmp_path / "model")
    ours = load_config(folder)
    full = dict(model.state_dict())

    def load(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        decoder = Decoder.allocate(ours, 64, torch.float32, torch.device("cpu"), TensorParallel(rank, world_size))
        decoder.load_weights(read_weights(folder, ours))
        return {name: p.detach() for name, p in decoder.named_parameters()}

    one, ranks = load(0, 1), [load(r, 2) for r in range(2)]
    layer = "layers.0."
    # vocabulary rows: 49 + 49, the last row of rank 1 is padding
    embed = torch.cat([r["embed_tokens.weight"] for r in ranks])
    assert embed.shape[0] == 98 and torch.equal(embed[:97], full["model.embed_tokens.weight"])
    assert not embed[97].any()
    if not tied:
        assert torch.equal(torch.cat([r["lm_head.weight"] for r in ranks])[:97], full["lm_head.weight"])
    # column parallel: q, k, v rows of each rank's heads (KV heads 1 + 2, query heads 2 + 4, head_dim 8)
    for part, (sizes, hf) in {"weight": ((16, 8, 8), (32, 16, 16)), "bias": ((16, 8, 8), (32, 16, 16))}.items():
        r0 = ranks[0][f"{layer}self_attn.qkv_proj.{part}"].split(list(sizes))
        r1 = ranks[1][f"{layer}self_attn.qkv_proj.{part}"].split(list(hf))
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            assert torch.equal(torch.cat([r0[i], r1[i]]), full[f"model.{layer}self_attn.{name}.{part}"])
    # row parallel: columns of o_proj and down_proj; their bias once, on rank 0
    o = torch.cat([r[f"{layer}self_attn.o_proj.weight"] for r in ranks], dim=1)
    assert torch.equal(o, full[f"model.{layer}self_attn.o_proj.weight"])
    down = torch.cat([r[f"{layer}mlp.down_proj.weight"] for r in ranks], dim=1)  # 49 + 50 columns
    assert ranks[0][f"{layer}mlp.down_proj.weight"].shape[1] == 49
    assert torch.equal(down, full[f"model.{layer}mlp.down_proj.weight"])
    assert torch.equal(ranks[0][f"{layer}mlp.down_proj.bias"], full[f"model.{layer}mlp.down_proj.bias"])
    assert not ranks[1][f"{layer}mlp.down_proj.bias"].any() and not ranks[1][f"{layer}self_attn.o_proj.bias"].any()
    gate_up = [r[f"{layer}mlp.gate_up_proj.weight"].split(r[f"{layer}mlp.gate_up_proj.weight"].shape[0] // 2)
               for r in ranks]  # fmt: skip
    assert torch.equal(torch.cat([gate_up[0][0], gate_up[1][0]]), full[f"model.{layer}mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([gate_up[0][1], gate_up[1][1]]), full[f"model.{layer}mlp.up_proj.weight"])
    # replicated: norms, identical to one rank's
    for name in ("norm.weight", f"{layer}attn_norm.weight", f"{layer}mlp_norm.weight"):
        assert torch.equal(ranks[0][name], one[name]) and torch.equal(ranks[1][name], one[name])
