"""Hugging Face folders: *.safetensors, single or sharded (model.safetensors.index.json), memory-mapped and yielded
tensor by tensor.

We read the format ourselves (8-byte header length, JSON header, raw data) rather than through safe_open so that
each tensor's pages can be dropped from the process (madvise DONTNEED) once the next one is asked for: resident
memory while loading stays at the model plus one tensor, instead of growing by every mapped shard."""

import contextlib
import json
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from model.loaders.errors import CheckpointFileError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER = 100 * 2**20  # the format caps the JSON header at 100 MB


def safetensors_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointFileError(f"{index}: not a valid safetensors index ({exc!r})") from exc
        files = [folder / s for s in sorted(set(weight_map.values()))]
        for path in files:
            if not path.exists():
                raise CheckpointFileError(f"{path}: listed in {index.name} but missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def read_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(folder):
        yield from read_safetensors_file(path)


def read_header(path: Path) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """(offset of the data section, [(name, {dtype, shape, data_offsets})] in file order), all bounds checked."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointFileError(f"{path}: truncated ({size} bytes, not even a safetensors header)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER or 8 + header_len > size:
            raise CheckpointFileError(f"{path}: corrupt or truncated header (length {header_len}, file {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointFileError(f"{path}: corrupt header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: corrupt header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFileError(f"{path}: corrupt header entry for {name!r} ({exc!r})") from exc
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointFileError(
                f"{path}: corrupt header: {name!r} spans {end - begin} bytes for {numel} elements"
            )
        if data_start + end > size:
            raise CheckpointFileError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
        entries.append((name, info))
    entries.sort(key=lambda e: e[1]["data_offsets"][0])
    return data_start, entries


def read_safetensors_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order. Each tensor is a zero-copy view of a private (copy-on-write) mapping, so
    it stays valid after the loop moves on: dropped pages are read again from the file if touched."""
    path = Path(path)
    data_start, entries = read_header(path)
    if not entries:
        return
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    page = mmap.PAGESIZE
    try:
        for name, info in entries:
            begin, end = (data_start + o for o in info["data_offsets"])
            dtype, shape = DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
            if end == begin:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            tensor = torch.frombuffer(mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin)
            yield name, tensor.view(shape)
            del tensor
            # the consumer has converted this tensor: drop its pages from our resident set (the page cache keeps them)
            start = begin // page * page
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    finally:
        with contextlib.suppress(BufferError):  # a consumer still holds a view; the mapping goes with the last one
            mm.close()
