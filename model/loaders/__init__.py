"""Pick the reader by what `path` is: a .gguf file or a Hugging Face folder.
Readers yield (transformers name, tensor)."""

from collections.abc import Iterator
from pathlib import Path

import torch

from model.config import ModelConfig
from model.loaders.gguf import GGUFFile
from model.loaders.safetensors import read_safetensors


def load_config(path: Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        gguf_file = GGUFFile(path)
        return ModelConfig.from_gguf(gguf_file.metadata(), gguf_file.tensor_names)
    return ModelConfig.from_hf(path)


def read_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    path = Path(path)
    if path.is_file():
        return GGUFFile(path).tensors(config.num_heads, config.num_kv_heads)
    return read_safetensors(path)
