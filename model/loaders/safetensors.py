"""Hugging Face folders: *.safetensors, single or sharded, memory-mapped and yielded tensor by tensor."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def read_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(folder):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
