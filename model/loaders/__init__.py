"""Pick the reader by what `path` is: a .gguf file or a Hugging Face folder.
Readers yield (transformers name, tensor)."""

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from model.config import ModelConfig
from model.loaders.gguf import GGUFFile
from model.loaders.safetensors import read_safetensors
from model.qtensor import GroupQuantized


@functools.lru_cache(maxsize=1)
def _gguf(path: Path, mtime_ns: int) -> GGUFFile:
    # the config and then the weights of one start read the same file: parse it once (0.5 s for SmolLM2)
    return GGUFFile(path)


def open_gguf(path: Path) -> GGUFFile:
    return _gguf(path.resolve(), path.stat().st_mtime_ns)


def load_config(path: Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        gguf_file = open_gguf(path)
        return ModelConfig.from_gguf(gguf_file.metadata(), gguf_file.tensor_names)
    return ModelConfig.from_hf(path)


def read_weights(
    path: Path, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """keep_quantized: a GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 matrices as GroupQuantized, the rest as float tensors."""
    path = Path(path)
    if path.is_file():
        return open_gguf(path).tensors(config.num_heads, config.num_kv_heads, keep_quantized)
    return read_safetensors(path)
