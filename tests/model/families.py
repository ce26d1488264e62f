"""Tiny random models of every supported family, built with transformers' own config classes (no hub), and the
helpers that run them through our decoder."""

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    SiglipVisionConfig,
)

from model.batch import Batch
from model.decoder import Decoder
from model.engine.model_runner import build_decoder
from model.loaders import load_config
from model.tokenizer import Tokenizer

VOCAB = 96
WINDOW = 16
# Common shape: 2-4 layers, hidden 64, GQA 4 query heads over 2 KV heads.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip

FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    # Llama 3.2: tied LM head, llama3 rope scaling
    "llama3": lambda: LlamaConfig(
        **BASE,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),  # fmt: skip
    # Llama 2 style: untied head, linear rope scaling, biases on attention and MLP
    "llama2-linear": lambda: LlamaConfig(
        **BASE,
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "mistral": lambda: MistralConfig(**BASE, sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**BASE, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(
        **{**BASE, "num_hidden_layers": 3}, sliding_window=WINDOW, partial_rotary_factor=0.5, tie_word_embeddings=False
    ),
    # Gemma 3: MQA, local layers with window 16 and theta 10k, global layers with theta 1M and linear scaling
    "gemma3": lambda: gemma3_text(),
    # Gemma 3 4B+ layout: the same text decoder inside Gemma3ForConditionalGeneration, next to a vision tower
    # (no logit soft-capping: real Gemma 3 has none, and transformers' multimodal class would not apply it)
    "gemma3-vision": lambda: Gemma3Config(
        text_config=gemma3_text(final_logit_softcapping=None).to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        vision_config=SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ).to_dict(),
    ),  # fmt: skip
}


# LongRoPE (Phi-3.5 / Phi-4-mini layout: partial rotary): pretraining length 64, so decoding from a 61-token prompt
# crosses from short_factor to long_factor. Kept apart from FAMILIES: a prefill longer than 64 tokens is where
# transformers' choice of table (by the length of the whole forward) and ours (by position) part.
LONGROPE: dict[str, Callable[[], PretrainedConfig]] = {
    "phi3-longrope": lambda: Phi3Config(
        **{**BASE, "num_hidden_layers": 2},
        partial_rotary_factor=0.5,
        original_max_position_embeddings=64,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0],
        },
    ),  # fmt: skip
}


def gemma3_text(final_logit_softcapping: float | None = 30.0) -> Gemma3TextConfig:
    return Gemma3TextConfig(**{**BASE, "num_hidden_layers": 4, "num_key_value_heads": 1}, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=final_logit_softcapping,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        })  # fmt: skip


def randomize(model: PreTrainedModel, seed: int = 0) -> None:
    """Weights with O(1) activations and distinct logits; norm weights away from their init so a wrong norm
    formula (1 + w vs w) or a missing q/k norm cannot pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(p + 0.2 * noise)
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_hf(family: str, seed: int = 0) -> PreTrainedModel:
    config = {**FAMILIES, **LONGROPE}[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    randomize(model, seed)
    return model


def save_hf(model: PreTrainedModel, folder: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def load_ours(folder: Path, max_positions: int = 256) -> Decoder:
    return build_decoder(folder, load_config(folder), max_positions, torch.float32, torch.device("cpu"))


def prefill_batch(prompts: list[list[int]]) -> Batch:
    """Whole prompts as one step with no KV pool: every position's logits (attention uses the fresh K/V)."""
    lens = [len(p) for p in prompts]
    total = sum(lens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return Batch(
        input_ids=torch.tensor([t for p in prompts for t in p]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=torch.arange(total),
        block_tables=torch.zeros(len(prompts), 1, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.arange(total),
        num_decode=0,
        max_query_len=max(lens),
        max_context_len=max(lens),
        query_lens_cpu=lens,
        context_lens_cpu=lens,
    )


def our_logits(decoder: Decoder, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: [len, vocab] float32 logits at every position."""
    with torch.inference_mode():
        logits = decoder.compute_logits(decoder(prefill_batch(prompts)))
    return list(logits.split([len(p) for p in prompts]))


def hf_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def make_tokenizer(vocab_size: int = VOCAB, eos_id: int = 2) -> Tokenizer:
    """A word-level tokenizer built in-process (the engine only needs its ids and eos set)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    raw = RawTokenizer(WordLevel(vocab, unk_token="t0"))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", eos_token=f"t{eos_id}")
    return Tokenizer(hf, {eos_id})


def prompts(seed: int = 1, lengths: tuple[int, ...] = (5, 23, 50)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
