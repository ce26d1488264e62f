"""The default CPU path (--quantization auto, --dtype auto): a GGUF's own 4- and 8-bit tensors, read as they are,
against the `gguf` package's dequantization and against the float32 reference engine."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model.engine.engine import Engine
from model.engine.model_runner import build_decoder, resolve_dtype
from model.layers import group_kernels
from model.layers.quantization import GroupEmbedding, GroupLinear, Int4Linear, Int8Embedding, Int8Linear
from model.loaders import load_config
from model.loaders.gguf import UNPACKERS, GGUFFile, unpermute
from model.tokenizer import Tokenizer
from tests.model.test_smollm2_parity import PROMPTS, single_sequence_batch

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_unpacked_blocks_dequantize_as_gguf_does(kind: Q) -> None:
    weights = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    packed = gguf.quants.quantize(weights, kind)  # [rows, bytes], ggml's own block layout
    ours = UNPACKERS[kind](torch.from_numpy(packed)).dequantize()
    theirs = torch.from_numpy(gguf.quants.dequantize(packed, kind))
    assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def auto_decoder(default_model_path: Path) -> torch.nn.Module:
    config = load_config(default_model_path)
    return build_decoder(default_model_path, config, 512, torch.bfloat16, torch.device("cpu"), "auto")


def test_auto_runs_every_matrix_on_the_files_own_bits(auto_decoder: torch.nn.Module) -> None:
    linears = [m for name, m in auto_decoder.named_modules() if name.startswith("layers.") and hasattr(m, "matmul")]
    assert len(linears) == 30 * 4
    # the Q8_0 embedding is the tied LM head: one int8 tensor for both
    if group_kernels.load():  # our kernel: the file's own groups and float16 scales and minimums, as stored
        assert all(isinstance(m, GroupLinear) and m.bits == 4 for m in linears)
        assert all(m.scale.dtype == m.minimum.dtype == torch.float16 for m in linears)
        assert isinstance(auto_decoder.embed_tokens, GroupEmbedding) and isinstance(auto_decoder.lm_head, GroupLinear)
        assert auto_decoder.embed_tokens.scale is auto_decoder.lm_head.scale
    else:
        assert all(isinstance(m, Int4Linear) for m in linears)
        assert isinstance(auto_decoder.embed_tokens, Int8Embedding) and isinstance(auto_decoder.lm_head, Int8Linear)
    assert auto_decoder.embed_tokens.weight is auto_decoder.lm_head.weight


@torch.inference_mode()
def test_int4_layer_computes_the_files_weights(auto_decoder: torch.nn.Module, default_model_path: Path) -> None:
    # reference: the gguf package's float32 dequantization of layer 3's Q projection (rows un-permuted as ours)
    file = GGUFFile(default_model_path)
    tensor = next(t for t in file.reader.tensors if t.name == "blk.3.attn_q.weight")
    reference = unpermute(torch.from_numpy(file._dequantize(tensor)), 9)  # [576, 576]
    layer = auto_decoder.layers[3].self_attn.qkv_proj
    identity = torch.eye(576, dtype=torch.bfloat16)
    got = layer(identity)[:, :576].float().T  # row i of the identity reads input column i of every output row
    # torch's kernel keeps scales and zeros in bfloat16 (2**-9 relative each); both round the output to bfloat16
    block_scale = reference.view(576, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    if isinstance(layer, GroupLinear):  # the file's own float16 scales, read exactly: only the output's rounding
        bound = 2**-8 * reference.abs() + 1e-6
    else:
        bound = 2**-9 * (reference.abs() + 2 * block_scale) + 2**-8 * reference.abs() + 1e-6
    assert bool(((got - reference).abs() <= bound).all())


@torch.inference_mode()
def test_default_engine_agrees_with_the_float32_reference(
    make_engine: object, default_tokenizer: Tokenizer, auto_decoder: torch.nn.Module, default_model_path: Path
) -> None:
    config = load_config(default_model_path)
    reference = build_decoder(default_model_path, config, 512, torch.float32, torch.device("cpu"), "none")
    errors = []
    for prompt in PROMPTS:
        ids = default_tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ours = auto_decoder.compute_logits(auto_decoder(single_sequence_batch(ids)))[-1]
        theirs = reference.compute_logits(reference(single_sequence_batch(ids)))[-1]
        error = float((ours - theirs).abs().max())
        # the same greedy pick, unless the reference's top two are nearer than our error can move them apart
        # (one of the short prompts, with bfloat16 outputs: a margin of ~0.1 at an error of ~0.1)
        margin = float(theirs.max() - theirs[int(ours.argmax())])
        assert int(ours.argmax()) == int(theirs.argmax()) or margin <= 2 * error, (prompt, margin, error)
        errors.append(error)
    # bfloat16 activations, the kernels' bfloat16 scales and the LM head's per-row int8: up to 1.54 over the 20
    # prompts of bench/quantization_quality.py, against logits up to 35.2; float32 with the same int8/int4 weights
    # (the rest of the error being the weights) stays under that
    assert max(errors) < 2.0, errors
    engine = make_engine(quantization="auto", dtype="auto", torch_compile=False)  # the default: float32 on CPU
    assert isinstance(engine, Engine)
    from model.engine.sequence import SamplingParams

    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    engine.add_request("paris", ids, SamplingParams(temperature=0, max_tokens=12))
    engine._drain_inbox(block=False)
    out: list[int] = []
    while engine.scheduler.has_work():
        for o in engine.step():
            out += o.new_token_ids
    assert "Paris" in default_tokenizer.decode(out)


def test_dtype_auto_is_float32_on_cpu() -> None:
    # bfloat16 activations cost the default model 9 of 20 greedy continuations against the float32 reference
    # (bench/quantization_quality.py); float32 keeps them, and our kernel takes bfloat16 GEMMs for prompts itself
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_the_gguf_tokenizer_is_cached_once_built(default_model_path: Path, tmp_path: Path) -> None:
    built = Tokenizer.load(default_model_path, cache_dir=tmp_path)
    assert list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    cached = Tokenizer.load(default_model_path, cache_dir=tmp_path)
    assert type(cached.hf) is type(built.hf)  # the class AutoTokenizer chose, read back without looking it up
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <b>wörld</b> 🌍"}]
    assert cached.apply_chat_template(messages) == built.apply_chat_template(messages)
    assert cached.eos_token_ids == built.eos_token_ids and cached.vocab_size == built.vocab_size
    ids = built.encode("The quick brown fox, 1234 \t\n ünïcödé")
    assert cached.decode(ids) == built.decode(ids)


def test_the_gguf_tokenizer_skips_autotokenizer_only_where_it_would_pick_the_same(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from model.tokenizer import _generic_gguf_tokenizer, _gguf_tokenizer

    assert _generic_gguf_tokenizer(default_model_path)  # llama architecture, byte-level BPE
    direct = _gguf_tokenizer(default_model_path)
    auto = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs and direct.chat_template == auto.chat_template
    assert direct.get_vocab() == auto.get_vocab() and direct.all_special_tokens == auto.all_special_tokens
    text = "The quick brown fox, 1234 \t\n ünïcödé <|im_start|>user\nHi<|im_end|> 🌍"
    assert direct.encode(text) == auto.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <b>wörld</b>"}]
    assert direct.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)


def _greedy_with_logits(engine: Engine, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens, and the logits of each decode step's one row (prompt in one step, then one row per step)."""
    from model.engine.sequence import SamplingParams

    logits: list[torch.Tensor] = []
    compute = engine.runner.decoder.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out[-1].clone())
        return out

    engine.runner.decoder.compute_logits = recording  # type: ignore[method-assign]
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine._drain_inbox(block=False)
    out: list[int] = []
    while engine.scheduler.has_work():
        for o in engine.step():
            out += o.new_token_ids
    return out, torch.stack(logits)


def test_the_quantized_default_caches_kv_in_float16(make_engine: object, default_tokenizer: Tokenizer) -> None:
    """Under the checkpoint's own 4-bit linears the KV pool is float16 (llama.cpp's default cache): the same greedy
    tokens as a float32 pool, logits within float16's rounding of K and V; the float32 reference keeps float32."""
    assert callable(make_engine)
    common = {"dtype": "float32", "torch_compile": False, "kv_cache_memory": 32 * 2**20}
    half = make_engine(quantization="auto", **common)
    full = make_engine(quantization="auto", kv_cache_dtype="float32", **common)
    reference = make_engine(quantization="none", **common)
    assert half.runner.kv_dtype == torch.float16
    assert all(a.k_cache.dtype == a.v_cache.dtype == torch.float16 for a in half.runner.decoder.attention_layers())
    assert full.runner.kv_dtype == torch.float32 and reference.runner.kv_dtype == torch.float32
    assert half.kv_capacity_tokens >= 2 * full.kv_capacity_tokens  # the same memory holds twice the tokens
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
    tokens_half, logits_half = _greedy_with_logits(half, ids, 24)
    tokens_full, logits_full = _greedy_with_logits(full, ids, 24)
    assert tokens_half == tokens_full
    # float16 keeps 11 significant bits of each K and V: logits (up to ~35) move by a few hundredths
    assert float((logits_half - logits_full).abs().max()) < 0.1
