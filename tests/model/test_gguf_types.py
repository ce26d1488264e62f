"""GGUF tensor types: tiny Llama models written with the gguf package's own writer, one tensor type at a time.
Our dequantized weights must equal gguf's dequantize, and our logits must equal transformers' on those same
dequantized weights (so the only error left is the quantization's own) and stay near the float original's."""

import copy
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from model.loaders import load_config
from model.loaders.gguf import GGUFFile, hf_name
from tests.model.families import build_hf, hf_logits, load_ours, our_logits, prompts, randomize

QK_K = 256  # K-quant super-block: every quantized row length must be a multiple of it
# ||ours - float original|| / ||float original|| over the logits of this 2-layer random model (measured: F32 7e-7,
# F16 9e-4, BF16 7e-3, Q8_0 0.024, Q6_K 0.08, Q5_K 0.19, Q4_K 0.33, Q4_1 0.33, Q4_0 0.36), with ~1.5x headroom
RELATIVE_ERROR = {Q.F32: 2e-6, Q.F16: 1.5e-3, Q.BF16: 1.2e-2, Q.Q8_0: 0.04, Q.Q6_K: 0.12, Q.Q5_K: 0.3,
                  Q.Q4_K: 0.5, Q.Q4_1: 0.5, Q.Q4_0: 0.55}  # fmt: skip


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    # sc, m: [n, 8] 6-bit values -> [n, 12] bytes, the inverse of gguf.quants.Q4_K.get_scale_min
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _quantize_k_affine(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: 8 sub-blocks of 32, x ~ d*sc*q - dmin*m. Returns (d, dmin, sc, m, q[n, 8, 32])."""
    x = w.reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, mins = (hi - lo) / levels, -lo  # [n, 8]
    d = _f16(np.maximum(scale.max(-1), 1e-12) / 63)[:, None]
    dmin = _f16(np.maximum(mins.max(-1), 1e-12) / 63)[:, None]
    sc = np.clip(np.round(scale / d), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin), 0, 63).astype(np.uint8)
    q = np.round((x + (dmin * m)[..., None]) / (d * sc)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """Rows of w -> gguf block bytes. The gguf package quantizes all but the K types; those we pack here."""
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return gguf.quants.quantize(w, qtype)
    rows = w.shape[0]
    if qtype == Q.Q6_K:  # 16 sub-blocks of 16, x ~ d * scale * (q - 32)
        x = w.reshape(-1, 16, 16)
        scale = np.abs(x).max(-1) / 31
        d = _f16(np.maximum(np.abs(scale).max(-1), 1e-12) / 127)[:, None]
        sc = np.clip(np.round(scale / d), 1, 127).astype(np.int8)
        q = np.clip(np.round(x / (d * sc)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(-1, 2, 2, 2, 32)
        low = q & 0x0F  # [n, g, s, h, 32] for value index g*128 + s*64 + h*32 + t
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
        high = ((q >> 4) & 0x03).reshape(-1, 2, 4, 32)  # [n, g, s, t] for value index g*128 + s*32 + t
        qh = sum(high[:, :, s] << (2 * s) for s in range(4)).astype(np.uint8).reshape(-1, 64)
        d16 = d.astype(np.float16).view(np.uint8)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16], axis=-1)
    else:
        levels = 15 if qtype == Q.Q4_K else 31
        d, dmin, sc, m, q = _quantize_k_affine(w, levels)
        qs = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(-1, 128)
        parts = [d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), _pack_k_scales(sc, m)]
        if qtype == Q.Q5_K:
            parts.append(sum(((q[:, k] >> 4) & 1) << k for k in range(8)).astype(np.uint8))
        blocks = np.concatenate([*parts, qs], axis=-1)
    return blocks.reshape(rows, -1)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: interleave each head's two rotary halves
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: PreTrainedModel, path: Path, qtype: Q, arch: str = "llama") -> Path:
    """What convert_hf_to_gguf.py writes, tensor names from gguf's own TensorNameMap (not from our loader)."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        w = tensor.numpy()
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = llama_permute(w, c.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = llama_permute(w, c.num_key_value_heads)
        if w.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms in F32
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def float_model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=QK_K, intermediate_size=2 * QK_K, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    randomize(model)
    return model


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gguf_type_dequantizes_exactly_and_stays_within_quantization_error(
    qtype: Q, float_model: LlamaForCausalLM, tmp_path: Path
) -> None:
    path = write_gguf(float_model, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    file = GGUFFile(path)
    assert {t.tensor_type for t in file.reader.tensors if len(t.shape) == 2} == {qtype}

    # 1. our tensors are gguf's own dequantization, with only llama.cpp's Q/K row permutation undone
    c = float_model.config
    ours = dict(file.tensors(c.num_attention_heads, c.num_key_value_heads))
    float_weights = float_model.state_dict()
    dequantized = {}
    for t in file.reader.tensors:
        theirs = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        name = hf_name(t.name)
        n_head = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
        if n_head is not None:  # re-permute ours rather than trusting our own unpermute
            assert torch.equal(torch.from_numpy(llama_permute(ours[name].numpy(), n_head)), theirs)
        else:
            assert torch.equal(ours[name], theirs)
        # and our unpermute restored transformers' layout: same rows as the float original, up to quantization
        rel = (ours[name] - float_weights[name]).norm() / float_weights[name].norm()
        assert rel.item() < 0.2
        dequantized[name] = ours[name]

    # 2. logits: equal to transformers' on the dequantized weights, near the float original's
    quantized_model = LlamaForCausalLM(c).eval()
    quantized_model.load_state_dict(dequantized)
    decoder = load_ours(path, 128)
    batch = prompts(lengths=(7, 30))
    for prompt, logits in zip(batch, our_logits(decoder, batch), strict=True):
        assert (logits - hf_logits(quantized_model, prompt)).abs().max().item() <= 1e-4
        reference = hf_logits(float_model, prompt)
        error = ((logits - reference).norm() / reference.norm()).item()
        assert error <= RELATIVE_ERROR[qtype], f"{qtype.name}: relative logit error {error:.2e}"


def test_llmserve_inspect_on_the_real_default_model(default_model_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "server", "inspect", str(default_model_path), "--max-model-len", "256"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "architecture=llama layers=30 heads=9 kv_heads=3 head_dim=64 hidden=576" in result.stdout
    assert "vocab=49152" in result.stdout
    # the fused projections: q (9 x 64) + k, v (3 x 64 each) = 960 rows; gate + up = 2 x 1536
    assert "(qkv_proj): Linear(in_features=576, out_features=960, bias=False)" in result.stdout
    assert "(gate_up_proj): Linear(in_features=576, out_features=3072, bias=False)" in result.stdout


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_gguf_keeps_transformers_layout(family: str, qtype: Q, tmp_path: Path) -> None:
    """Qwen GGUFs: no Q/K permutation, q/k/v biases (Qwen2) or q/k norms (Qwen3) found by their tensor names."""
    model = build_hf(family)
    path = write_gguf(model, tmp_path / f"{family}.gguf", qtype, family)
    config = load_config(path)
    assert (config.architecture, config.attention_bias, config.qk_norm) == (
        family,
        family == "qwen2",
        family == "qwen3",
    )
    reference = copy.deepcopy(model)  # the float model with every matrix through quantize -> gguf's dequantize
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 2 and qtype != Q.F32:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(quantize(p.numpy(), qtype), qtype)))
    batch = prompts()
    for prompt, logits in zip(batch, our_logits(load_ours(path), batch), strict=True):
        assert (logits - hf_logits(reference, prompt)).abs().max().item() <= 1e-4
    if (
        family == "qwen2" and qtype == Q.F32
    ):  # transformers' own GGUF reader agrees on the file (it lacks Qwen3's head_dim)
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
        for prompt in batch:
            assert (hf_logits(theirs, prompt) - hf_logits(model, prompt)).abs().max().item() <= 1e-4


def _reference_metadata(path: Path) -> dict[str, object]:
    """gguf's own reader, every field parsed."""
    out: dict[str, object] = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if not key.startswith("GGUF."):
            out[key] = field.contents()
    return out


def _plain(value: object) -> object:
    return value if isinstance(value, str | int | float | bool) else list(value)  # type: ignore[call-overload]


def test_metadata_with_long_arrays_read_lazily_equals_gguf_readers(default_model_path: Path, tmp_path: Path) -> None:
    """Long arrays (the vocabulary, merges, token types) are measured at open and read when first indexed: the same
    values as gguf's full parse, and the tensors after them found at the same offsets."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", [f"tok{i}é" * (i % 5) for i in range(1000)])
    writer.add_array("test.short", ["a", "bc"])
    writer.add_array("test.floats", [i / 7 for i in range(700)])
    writer.add_array("test.ints", list(range(-300, 300)))
    writer.add_uint32("test.after", 7)
    writer.add_tensor("weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for gguf_path in (path, default_model_path):
        ours = GGUFFile(gguf_path)
        metadata = ours.metadata()
        assert ours.reader.long_arrays  # the lazy path was taken
        reference = _reference_metadata(gguf_path)
        assert {k: _plain(v) for k, v in metadata.items()} == reference
        stock = gguf.GGUFReader(str(gguf_path))
        assert [(t.name, t.data_offset, t.n_bytes) for t in ours.reader.tensors] == [
            (t.name, t.data_offset, t.n_bytes) for t in stock.tensors
        ]
    assert np.array_equal(GGUFFile(path).reader.tensors[0].data, np.arange(64, dtype=np.float32).reshape(8, 8))
