"""GGUF: metadata into a plain dict, tensors dequantized by the `gguf` package and renamed to transformers' names."""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from model.loaders.errors import CheckpointFileError

# llama.cpp tensor name -> transformers name ({n} = layer index)
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{n\}", r"(\d+)") + "$"), v) for k, v in GGUF_TO_HF.items()]


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the gguf package raises assorted errors on truncated or corrupt files
            raise CheckpointFileError(f"{self.path}: not a readable GGUF file ({exc!r})") from exc
        size = self.path.stat().st_size
        for t in self.reader.tensors:  # the reader maps tensors lazily, so a cut-off file only shows in the offsets
            if t.data_offset + t.n_bytes > size:
                raise CheckpointFileError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} "
                    f"but the file has {size} bytes"
                )

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                out[key] = field.contents()
            except Exception:
                continue
        return out

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def tensors(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (transformers name, float32 tensor [out, in]) with llama.cpp's Q/K row permutation undone."""
        for t in self.reader.tensors:
            name = hf_name(t.name)
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)  # float32 numpy [out, in] (reversed t.shape)
            except NotImplementedError as exc:
                raise CheckpointFileError(f"{self.path}: tensor {t.name!r}: {exc}") from exc
            if not array.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
                array = np.array(array)
            tensor = torch.from_numpy(array)
            if name.endswith("q_proj.weight"):
                tensor = unpermute(tensor, num_heads)
            elif name.endswith("k_proj.weight"):
                tensor = unpermute(tensor, num_kv_heads)
            yield name, tensor


def hf_name(name: str) -> str:
    for pattern, target in _PATTERNS:
        m = pattern.match(name)
        if m:
            return target.format(n=m.group(1)) if m.groups() else target
    return name  # unknown names pass through; the decoder reports them as unexpected


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py interleaves each head's rotary halves: w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
