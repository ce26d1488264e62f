"""Pick the reader by what `path` is: a .gguf file or a Hugging Face folder.
Readers yield (transformers name, tensor)."""

from collections.abc import Iterator
from pathlib import Path

import torch

from model.config import ModelConfig
from model.loaders.gguf import GGUFFile
from model.loaders.safetensors import read_safetensors
from model.qtensor import GroupQuantized


def load_config(path: Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        gguf_file = GGUFFile(path)
        return ModelConfig.from_gguf(gguf_file.metadata(), gguf_file.tensor_names)
    return ModelConfig.from_hf(path)


def read_weights(
    path: Path, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """keep_quantized: a GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 matrices as GroupQuantized, the rest as float tensors."""
    path = Path(path)
    if path.is_file():
        return GGUFFile(path).tensors(config.num_heads, config.num_kv_heads, keep_quantized)
    return read_safetensors(path)
