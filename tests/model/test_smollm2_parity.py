"""Our decoder on the real default model against transformers' implementation of the same GGUF."""

from pathlib import Path
from typing import Any

import pytest
import torch

from model.batch import Batch
from model.engine.model_runner import build_decoder
from model.loaders import load_config
from model.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime, in a short paragraph.",
]


def single_sequence_batch(ids: list[int]) -> Batch:
    t = len(ids)
    return Batch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(t),
        slot_mapping=torch.arange(t),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        logits_indices=torch.arange(t),
        num_decode=0,
        max_query_len=t,
        max_context_len=t,
        query_lens_cpu=[t],
        context_lens_cpu=[t],
    )


@pytest.fixture(scope="module")
def hf_model(default_model_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def decoder(default_model_path: Path) -> Any:
    config = load_config(default_model_path)
    return build_decoder(default_model_path, config, 2048, torch.float32, torch.device("cpu"))


def test_config_read_from_gguf(default_model_path: Path) -> None:
    c = load_config(default_model_path)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size, c.hidden_size) == (30, 9, 3, 49152, 576)
    assert c.tie_word_embeddings


@torch.inference_mode()
def test_logits_match_transformers(decoder: Any, hf_model: Any, default_tokenizer: Tokenizer) -> None:
    for prompt in PROMPTS:
        ids = default_tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ours = decoder.compute_logits(decoder(single_sequence_batch(ids)))
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
        assert (ours - theirs).abs().max().item() <= 1e-3


def test_greedy_32_tokens_match_transformers(make_engine: Any, hf_model: Any, default_tokenizer: Tokenizer) -> None:
    from tests.engine.drive import greedy, run

    engine = make_engine()
    for i, prompt in enumerate(PROMPTS):
        ids = default_tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ours = run(engine, {f"p{i}": (ids, greedy(32))})[f"p{i}"]
        ref, margins = hf_greedy(hf_model, ids, 32)
        # Compare up to the first near-tie of transformers' top two logits (none in practice): below 1e-3 the
        # argmax may legitimately flip with the summation order of either implementation.
        exact = next((i for i, m in enumerate(margins) if m < 1e-3), 32)
        assert ours[:exact] == ref[:exact]


@torch.inference_mode()
def hf_greedy(hf_model: Any, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """A plain argmax loop on transformers' KV cache, past any end-of-turn token (our side ignores eos too).
    Returns the tokens and, per step, the gap between the two largest logits."""
    out = hf_model(torch.tensor([ids]), use_cache=True)
    tokens, margins = [], []
    for _ in range(n):
        top2 = out.logits[0, -1].float().topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins
