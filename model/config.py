"""ModelConfig: everything the decoder needs to know of an architecture, read from config.json or GGUF metadata.
Every architecture quirk is a field here (filled from the FAMILIES table), never a branch on the model
type elsewhere."""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Checkpoint name fragment -> our module name fragment. Our norms are named by role; Llama's
# `post_attention_layernorm` is the norm *before* the MLP, Gemma's is the norm *after* attention.
LLAMA_NORM_NAMES = ((".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."))
SANDWICH_NORM_NAMES = (
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".attn_out_norm."),
    (".pre_feedforward_layernorm.", ".mlp_norm."),
    (".post_feedforward_layernorm.", ".mlp_out_norm."),
)


@dataclass(frozen=True)
class Family:
    """What a family fixes in code rather than in its config.json (None = read `attention_bias` from config.json)."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 3)
    norm_unit_offset: bool = False  # RMSNorm weights stored as w, applied as (1 + w) (Gemma)
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    weight_names: tuple[tuple[str, str], ...] = LLAMA_NORM_NAMES
    # Multimodal checkpoints served as text models: the key of the language model's config, the checkpoint
    # prefixes that lead to it, and the prefixes of the tensors we do not serve (vision tower, projector)
    text_config: str | None = None
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    ignored_weights: tuple[str, ...] = ()


GEMMA3 = Family(
    qk_norm=True, sandwich_norms=True, norm_unit_offset=True, scale_embeddings=True, weight_names=SANDWICH_NORM_NAMES
)
# config.json model_type -> family. Phi-3 needs no entry of its own beyond its name: its checkpoint's fused
# qkv_proj / gate_up_proj already have our layout.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(),
    "gemma3_text": GEMMA3,
    # Gemma 3 4B/12B/27B: the text decoder of Gemma3ForConditionalGeneration (images are not served)
    "gemma3": replace(
        GEMMA3,
        text_config="text_config",
        weight_prefixes=(
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        ),  # fmt: skip
        ignored_weights=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values; same names as FAMILIES
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3); None = the same.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0  # leading dims of each head that rotate (Phi partial_rotary_factor); 0 = head_dim
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Per layer: the sliding window of that layer (None = full attention).
    layer_windows: tuple[int | None, ...] = field(default=())
    attention_bias: bool = False  # q, k and v projections
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_unit_offset: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None = head_dim
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    weight_names: tuple[tuple[str, str], ...] = LLAMA_NORM_NAMES
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    ignored_weights: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # generation_config.json sampling defaults (temperature, top_p, top_k, repetition_penalty, ...), if any
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, folder: Path) -> "ModelConfig":
        folder = Path(folder)
        try:
            raw = json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{folder}: no config.json (expected a Hugging Face model folder or a .gguf file)"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{folder / 'config.json'}: not valid JSON ({exc})") from exc
        model_type = raw.get("model_type", "")
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        raw = _complete(folder, raw, family)
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise UnsupportedModelError(f"{model_type}: {key}={raw[key]!r} is not supported")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        num_layers = raw["num_hidden_layers"]
        global_rope, local_rope = _rope_parameters(raw)
        if global_rope.get("rope_type") == "longrope":  # Phi-3.5 / Phi-4-mini: the attention factor needs these
            global_rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
            global_rope["max_position_embeddings"] = raw["max_position_embeddings"]
        theta, scaling = _rope(global_rope, model_type)
        local_theta, local_scaling = _rope(local_rope, model_type) if local_rope is not None else (None, None)
        partial = global_rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        layer_types = raw.get("layer_types")
        if layer_types:  # transformers v5 writes one entry per layer; older Qwen2/3 configs use max_window_layers
            layer_windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        elif (
            window is not None and "sliding_window_pattern" in raw
        ):  # older Gemma 3 configs: every n-th layer is global
            pattern = raw["sliding_window_pattern"]
            layer_windows = tuple(window if (i + 1) % pattern else None for i in range(num_layers))
        elif window is not None and "max_window_layers" in raw:
            layer_windows = tuple(window if i >= raw["max_window_layers"] else None for i in range(num_layers))
        else:
            layer_windows = (window,) * num_layers
        bias = bool(raw.get("attention_bias", False))
        eos = _ids(raw.get("eos_token_id"))
        generation = _generation_config(folder)
        eos += tuple(i for i in _ids(generation.pop("eos_token_id", None)) if i not in eos)
        return cls(
            architecture=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            rotary_dim=int(head_dim * partial),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            sliding_window=window,
            layer_windows=layer_windows,
            attention_bias=bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            sandwich_norms=family.sandwich_norms,
            norm_unit_offset=family.norm_unit_offset,
            embed_scale=raw["hidden_size"] ** 0.5 if family.scale_embeddings else 1.0,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
            weight_names=family.weight_names,
            weight_prefixes=family.weight_prefixes,
            ignored_weights=family.ignored_weights,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            generation_defaults=generation,
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = metadata["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{key}", default)

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
        # end of text, end of turn and end of message all end generation
        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        eos = tuple(dict.fromkeys(int(metadata[k]) for k in eos_keys if metadata.get(k) is not None))
        rope_scaling = None
        if get("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        family = FAMILIES[arch]
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            # biases and q/k norms are whatever tensors the converter wrote
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            weight_names=family.weight_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
        )


def _complete(folder: Path, raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """config.json with every default filled in by transformers' own config class: hub configs often omit the
    fields whose value is the class default (Gemma 3's head_dim, query_pre_attn_scalar, ...). For a multimodal
    checkpoint, the language model's config, with the top-level LM-head tying."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(folder))
    except Exception:  # a config transformers cannot parse: read what the file says, defaults below
        hf = None
    if family.text_config is None:
        return hf.to_dict() if hf is not None else raw
    text = getattr(hf, family.text_config).to_dict() if hf is not None else dict(raw[family.text_config])
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return text


def _rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global, local) RoPE parameter dicts from either config.json layout: transformers v5's `rope_parameters`
    (per layer type for Gemma 3) or the older top-level `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    merged = {**(raw.get("rope_scaling") or {}), **params}
    if "rope_theta" in raw:
        merged.setdefault("rope_theta", raw["rope_theta"])
    local = None
    if "rope_local_base_freq" in raw:
        local = {"rope_type": "default", "rope_theta": raw["rope_local_base_freq"]}
    return merged, local


def _rope(params: dict[str, Any], model_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None for plain RoPE); an unknown scaling type is refused here, before any loading."""
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_type}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    scaling = None if kind == "default" else {**params, "rope_type": kind}
    return float(params.get("rope_theta", 10000.0)), scaling


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    keys = ("eos_token_id", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample")
    return {k: raw[k] for k in keys if raw.get(k) is not None}
