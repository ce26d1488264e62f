"""A CPU model's weights moved into one mapping backed by transparent huge pages, in module order.

Why: a decode step streams every weight once, ~110 MB for the default model, in a few hundred small reads (one per
linear, 0.2-1 MB each, and the LM head). Over 4 KiB pages each read misses the TLB page after page and the hardware
prefetcher stops at every page boundary. On a Zen 3, 2 MiB pages took the 30 layers' linears from 7.6-11.0 to
5.2-5.8 ms, and a one-row decode step of the default model from ~11 to ~9 ms (the same step, two engines in one
process, alternating); one contiguous mapping without huge pages gained nothing.
"""

import logging
import mmap

import torch
from torch import nn

log = logging.getLogger("llmserve.arena")

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' vector loads never straddle two tensors' lines


def pack_weights(module: nn.Module) -> int:
    """Move the CPU parameters and buffers of `module` (and its children) into one arena, keeping tensors that share
    memory sharing it and every view's shape and strides; the old tensors are freed once nothing else holds them.
    Only the bytes the tensors span are copied (a tensor may view a few bytes of a large storage, such as a mapped
    checkpoint). Returns the arena's size in bytes (0 when there was nothing to move)."""
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
    # private: a shared anonymous mapping is shmem, which gets huge pages only where the kernel enables them for
    # shmem (off by default); a private one follows the madvise below
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    arena = whole[-whole.data_ptr() % HUGE_PAGE :]
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
    return size


def _extent(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, inclusive, in its storage."""
    return 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
