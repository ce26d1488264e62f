"""GGUF: metadata into a plain dict, tensors renamed to transformers' names: dequantized by the `gguf` package, or,
when asked, Q4_0 / Q4_1 / Q8_0 matrices unpacked as they are (GroupQuantized) for the int4 and int8 layers."""

import mmap
import re
import struct
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import gguf
import numpy as np
import torch

from model.loaders.errors import CheckpointFileError
from model.qtensor import GROUP, GroupQuantized

# llama.cpp tensor name -> transformers name, without the .weight / .bias suffix ({n} = layer index)
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_q_norm": "model.layers.{n}.self_attn.q_norm",
    "blk.{n}.attn_k_norm": "model.layers.{n}.self_attn.k_norm",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
}
_PATTERNS = [
    (re.compile("^" + re.escape(k).replace(r"\{n\}", r"(?P<n>\d+)") + r"\.(?P<suffix>weight|bias)$"), v)
    for k, v in GGUF_TO_HF.items()
]
# convert_hf_to_gguf.py permutes Q/K rows for these architectures only (llama.cpp's rotary pairs adjacent dims);
# Qwen's GGUFs keep transformers' layout
PERMUTED_ARCHITECTURES = ("llama",)
CHUNK_BYTES = 8 * 2**20


class LazyArray(Sequence[Any]):
    """A long metadata array (a tokenizer's vocabulary and merges), read from the file when first indexed: the
    tokenizer is loaded from its own cache on later starts, and the config wants only the length."""

    def __init__(self, data: np.ndarray, offset: int, item_type: gguf.GGUFValueType, count: int) -> None:
        self._data, self._offset, self._type, self._count = data, offset, item_type, count
        self._values: list[Any] | None = None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if self._values is None:
            self._values = self._read()
        return self._values[index]

    def _read(self) -> list[Any]:
        if self._type != gguf.GGUFValueType.STRING:
            dtype = np.dtype(gguf.GGUFReader.gguf_scalar_to_np[self._type])
            return self._data[self._offset : self._offset + dtype.itemsize * self._count].view(dtype).tolist()
        view, spans = self._data.data, _strings(self._data, self._offset, self._count)
        return [bytes(view[start : start + n]).decode("utf-8") for start, n in spans]


def _strings(data: np.ndarray, offset: int, count: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each of `count` length-prefixed strings from `offset`."""
    view = data.data  # the buffer, for struct
    for _ in range(count):
        length = struct.unpack_from("<Q", view, offset)[0]
        yield offset + 8, length
        offset += 8 + length


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its np.memmap: the parser slices the file ~2 million times for a
    49k-token vocabulary, and np.memmap's per-slice bookkeeping made that 3.3 of a 4.5 s parse here. Long arrays are
    only measured, not parsed (gguf's parts for a 49k vocabulary took 0.6-1 s of a later start): their values are
    LazyArrays in `long_arrays`, by key."""

    LONG = 256  # items

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._view

    @data.setter
    def data(self, mapping: np.memmap) -> None:
        self.mapping = mapping
        self._view = np.asarray(mapping)
        self.long_arrays: dict[str, LazyArray] = {}
        self._long: LazyArray | None = None  # measured by _get_field_parts, named by the _push_field after it
        self._depth = 0

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        if self._depth == 0 and raw_type == gguf.GGUFValueType.ARRAY and self.byte_order == "I":
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            start, n = orig_offs + 12, int(count[0])
            kind = gguf.GGUFValueType(int(item_type[0]))
            scalar = self.gguf_scalar_to_np.get(kind)
            if n > self.LONG and (scalar is not None or kind == gguf.GGUFValueType.STRING):
                size = (np.dtype(scalar).itemsize * n if scalar is not None
                        else sum(8 + length for _, length in _strings(self._view, start, n)))  # fmt: skip
                self._long = LazyArray(self._view, start, kind, n)
                return 12 + size, [item_type, count], [], [gguf.GGUFValueType.ARRAY, kind]
        self._depth += 1
        try:
            return super()._get_field_parts(orig_offs, raw_type)
        finally:
            self._depth -= 1

    def _push_field(self, field: gguf.ReaderField, skip_sum: bool = False) -> int:
        if self._long is not None:
            self.long_arrays[field.name], self._long = self._long, None
        return super()._push_field(field, skip_sum)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = _Reader(str(self.path))
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
            if key in self.reader.long_arrays:
                out[key] = self.reader.long_arrays[key]
                continue
            try:
                out[key] = field.contents()
            except Exception:
                continue
        return out

    @property
    def architecture(self) -> str:
        field = self.reader.fields.get("general.architecture")
        return str(field.contents()) if field is not None else ""

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def tensors(
        self, num_heads: int, num_kv_heads: int, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
        """Yield (transformers name, float32 tensor [out, in]) with llama.cpp's Q/K row permutation undone;
        with keep_quantized, Q4_0 / Q4_1 / Q8_0 matrices come as GroupQuantized instead."""
        permuted = self.architecture in PERMUTED_ARCHITECTURES
        for t in self.reader.tensors:
            name = hf_name(t.name)
            tensor: torch.Tensor | GroupQuantized
            if keep_quantized and t.tensor_type in UNPACKERS and t.data.ndim == 2:
                with warnings.catch_warnings():  # read-only mapping: the unpackers only read, into new tensors
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = UNPACKERS[t.tensor_type](torch.from_numpy(t.data))
            else:
                try:
                    tensor = torch.from_numpy(self._dequantize(t))
                except NotImplementedError as exc:
                    raise CheckpointFileError(f"{self.path}: tensor {t.name!r}: {exc}") from exc
            self._release(t)
            if permuted and (".q_proj." in name or ".k_proj." in name):
                heads = num_heads if ".q_proj." in name else num_kv_heads
                if isinstance(tensor, GroupQuantized):
                    tensor = tensor.rows(unpermute(torch.arange(tensor.shape[0]), heads))
                else:
                    tensor = unpermute(tensor, heads)
            yield name, tensor
        self._release_all()

    def _dequantize(self, t: gguf.ReaderTensor) -> np.ndarray:
        """float32 [out, in] (t.shape reversed), dequantized CHUNK_BYTES of rows at a time: gguf's numpy
        dequantize makes several float32 temporaries of its input, which for a whole embedding is hundreds of MB."""
        data = t.data  # [rows, bytes per row] for block types, [rows, in] for float types
        if data.ndim < 2 or t.tensor_type == gguf.GGMLQuantizationType.F32:
            return np.array(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32)  # a copy off the mapping
        step = max(1, CHUNK_BYTES // (data[0].nbytes or 1))
        first = gguf.quants.dequantize(data[:step], t.tensor_type)
        out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
        out[:step] = first
        for start in range(step, data.shape[0], step):
            out[start : start + step] = gguf.quants.dequantize(data[start : start + step], t.tensor_type)
        return out

    def _release(self, t: gguf.ReaderTensor) -> None:
        # drop this tensor's file pages from our resident set (the page cache keeps them),
        # as the safetensors reader does
        mapping = getattr(self.reader.mapping, "_mmap", None)
        if mapping is not None and t.n_bytes:
            start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
            mapping.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

    def _release_all(self) -> None:
        # the kernel maps a whole large folio of the page cache on a fault, so reading one tensor maps pages of
        # its released neighbours again (~46 MiB of the default model's 94 stayed resident)
        mapping = getattr(self.reader.mapping, "_mmap", None)
        if mapping is not None:
            mapping.madvise(mmap.MADV_DONTNEED)


def _blocks(data: torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, bytes] uint8 -> ([rows, blocks, block_bytes] uint8, the blocks' leading float16 scale), kept float16:
    our kernel reads it so, in half the bytes of float32."""
    blocks = data.view(data.shape[0], -1, block_bytes)
    return blocks, _halves(blocks, 0)


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, [rows, blocks]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 16] uint8 (a strided view of the mapping) -> [rows, blocks * 16], copied in ggml's own layout,
    which GroupQuantized and our kernel keep."""
    return blocks.contiguous().view(blocks.shape[0], -1)


def unpack_q4_0(data: torch.Tensor) -> GroupQuantized:
    # 18-byte blocks: d, then 16 bytes of nibbles; w = d * (q - 8)
    blocks, d = _blocks(data, 18)
    minimum = -8 * d  # exact in float16 (a power of two), unless it overflows there
    if not bool(torch.isfinite(minimum).all()):
        d = d.float()
        minimum = -8 * d
    return GroupQuantized(4, _nibbles(blocks[..., 2:]), d, minimum)


def unpack_q4_1(data: torch.Tensor) -> GroupQuantized:
    # 20-byte blocks: d, m, then 16 bytes of nibbles; w = d * q + m
    blocks, d = _blocks(data, 20)
    m = _halves(blocks, 2)
    return GroupQuantized(4, _nibbles(blocks[..., 4:]), d, m)


def unpack_q8_0(data: torch.Tensor) -> GroupQuantized:
    # 34-byte blocks: d, then 32 int8; w = d * q
    blocks, d = _blocks(data, 2 + GROUP)
    return GroupQuantized(8, blocks[..., 2:].contiguous().view(torch.int8).reshape(data.shape[0], -1), d)


def requantize_q4_k(data: torch.Tensor) -> GroupQuantized:
    # Q4_K's 32-wide sub-blocks are w = d * sc * q - dmin * m: each sub-block's min/max grid is nearly its own
    dequantized = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q4_K)
    return GroupQuantized.int4_from_float(torch.from_numpy(dequantized))


UNPACKERS = {
    gguf.GGMLQuantizationType.Q4_0: unpack_q4_0,
    gguf.GGMLQuantizationType.Q4_1: unpack_q4_1,
    gguf.GGMLQuantizationType.Q4_K: requantize_q4_k,
    gguf.GGMLQuantizationType.Q8_0: unpack_q8_0,
}


def hf_name(name: str) -> str:
    for pattern, target in _PATTERNS:
        m = pattern.match(name)
        if m:
            return f"{target.format(n=m.groupdict().get('n'))}.{m.group('suffix')}"
    return name  # unknown names pass through; the decoder reports them as unexpected


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py interleaves each head's rotary halves: w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
