"""A CPU model's weights moved into one mapping backed by transparent huge pages, in module order.

Why: a decode step streams every weight once, ~110 MB for the default model, in a few hundred small reads (one per
linear, 0.2-1 MB each, and the LM head). Over 4 KiB pages each read misses the TLB page after page and the hardware
prefetcher stops at every page boundary. On a Zen 3, 2 MiB pages took the 30 layers' linears from 7.6-11.0 to
5.2-5.8 ms, and a one-row decode step of the default model from ~11 to ~9 ms (the same step, two engines in one
process, alternating); one contiguous mapping without huge pages gained nothing.

Faulting the huge pages in is the slow part of the move: ~5 ms per fresh 2 MiB page on the VMs here, 0.3 s for the
default model's 106 MiB, a tenth of a later start. So a start reserves (`reserve`) as many bytes as the last start
with the same checkpoint and settings packed, at process start, and faults them in on a thread of its own (memset
through ctypes, without the GIL) while the main thread imports; pack_weights then fills the reserved pages.
"""

import ctypes
import hashlib
import json
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from config.settings import Settings

log = logging.getLogger("llmserve.arena")

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' vector loads never straddle two tensors' lines
# the settings that decide which tensors a CPU decoder holds, and in which dtype and shape
RECORD_FIELDS = ("dtype", "device", "quantization", "prepack_weights", "torch_compile", "max_model_len")

_reserved: tuple[mmap.mmap, threading.Thread] | None = None


def record_path(settings: "Settings") -> Path | None:
    """Where the arena size of a decoder with these settings and this checkpoint (path, size, mtime) is kept."""
    if not settings.cache_dir:
        return None
    try:
        model = settings.model_path.resolve()
        stat = model.stat()
    except OSError:
        return None
    fields = json.dumps({f: str(getattr(settings, f)) for f in RECORD_FIELDS}, sort_keys=True)
    digest = hashlib.sha256(f"{model}|{stat.st_size}|{stat.st_mtime_ns}|{fields}".encode()).hexdigest()
    return Path(settings.cache_dir).expanduser() / "arena" / digest[:24]


def reserve(record: Path | None) -> None:
    """Map the size that `record` holds (nothing where there is none yet), fault it in on a background thread, and
    keep it for the next pack_weights."""
    global _reserved
    try:
        size = int(record.read_text()) if record is not None else 0
    except (OSError, ValueError):
        return
    if size <= 0:
        return
    mapping = _huge_page_mapping(size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    fault = threading.Thread(target=ctypes.memset, args=(address, 0, len(mapping)), name="llmserve-arena", daemon=True)
    fault.start()
    _reserved = (mapping, fault)


def _huge_page_mapping(size: int) -> mmap.mmap:
    """`size` bytes from a huge-page boundary on: one page more, since the mapping itself may start between two."""
    # private: a shared anonymous mapping is shmem, which gets huge pages only where the kernel enables them for
    # shmem (off by default); a private one follows the madvise below
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def _take_reserved(size: int) -> mmap.mmap | None:
    global _reserved
    if _reserved is None:
        return None
    mapping, fault = _reserved
    _reserved = None
    fault.join()
    return mapping if len(mapping) >= size + HUGE_PAGE else None  # a smaller one is unmapped once unreferenced


def pack_weights(module: nn.Module, record: Path | None = None) -> int:
    """Move the CPU parameters and buffers of `module` (and its children) into one arena, keeping tensors that share
    memory sharing it and every view's shape and strides; the old tensors are freed once nothing else holds them.
    Only the bytes the tensors span are copied (a tensor may view a few bytes of a large storage, such as a mapped
    checkpoint). Returns the arena's size in bytes (0 when there was nothing to move), and writes it to `record`
    for the next start's `reserve`."""
    owners: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
    spans: dict[int, list[int]] = {}  # storage address -> [first byte, end byte] its tensors span
    storages: dict[int, torch.UntypedStorage] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if (
                    tensor is None
                    or tensor.device.type != "cpu"
                    or tensor.layout != torch.strided
                    or not tensor.numel()
                ):
                    continue
                owners.append((table, name, tensor))  # type: ignore[arg-type]
                first = int(tensor.storage_offset()) * tensor.element_size()
                end = first + _extent(tensor) * tensor.element_size()
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage
                span = spans.setdefault(storage.data_ptr(), [first, end])
                span[0], span[1] = min(span[0], first), max(span[1], end)
    offsets: dict[int, int] = {}  # storage address -> where its span's first byte (rounded down to ALIGN) lands
    size = 0
    for address, span in spans.items():
        span[0] -= span[0] % ALIGN
        offsets[address] = size
        size += -(-(span[1] - span[0]) // ALIGN) * ALIGN
    if size == 0:
        return 0
    mapping = _take_reserved(size) or _huge_page_mapping(size)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    start = -whole.data_ptr() % HUGE_PAGE
    arena = whole[start:]
    _release_outside(mapping, start, size)
    for address, (first, end) in spans.items():
        source = torch.empty(0, dtype=torch.uint8).set_(storages[address], first, (end - first,))  # type: ignore[call-overload]
        arena[offsets[address] : offsets[address] + end - first].copy_(source)
    moved: dict[int, torch.Tensor] = {}  # id of an old tensor -> its replacement (one tensor in two places)
    for table, name, tensor in owners:
        if id(tensor) not in moved:
            address = tensor.untyped_storage().data_ptr()
            at = offsets[address] - spans[address][0] + int(tensor.storage_offset()) * tensor.element_size()
            flat = arena[at : at + _extent(tensor) * tensor.element_size()].view(tensor.dtype)
            view = flat.as_strided(tensor.shape, tensor.stride(), flat.storage_offset())
            moved[id(tensor)] = nn.Parameter(view, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else view
        table[name] = moved[id(tensor)]
    log.debug("weights packed into %.1f MiB of huge-page memory", size / 2**20)
    if record is not None:
        _write_record(record, size)
    return size


def _release_outside(mapping: mmap.mmap, start: int, size: int) -> None:
    """Give back the pages of `mapping` before the arena (at `start`, a huge-page boundary) and after its last huge
    page: a reserved mapping has them all resident, and may be larger than this arena."""
    if start:
        mapping.madvise(mmap.MADV_DONTNEED, 0, start)
    end = start + -(-size // HUGE_PAGE) * HUGE_PAGE
    if end < len(mapping):
        mapping.madvise(mmap.MADV_DONTNEED, end, len(mapping) - end)


def _write_record(record: Path, size: int) -> None:
    try:
        if record.exists() and record.read_text() == str(size):
            return
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}")
        partial.write_text(str(size))
        partial.replace(record)  # whole or not at all for a start reading it meanwhile
    except OSError as exc:
        log.debug("arena size not recorded in %s: %s", record, exc)


def _extent(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, inclusive, in its storage."""
    return 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
