"""model/arena.py: the CPU weights moved into one huge-page mapping keep their values, views, ties and types."""

import ctypes
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from model.arena import HUGE_PAGE, pack_weights
from tests.model.families import build_hf, hf_logits, load_ours, our_logits, prompts, save_hf


def test_values_views_and_ties_survive() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    module[1].weight = nn.Parameter(module[0].weight.detach().t())  # a transposed view of another's storage
    module.register_buffer("window", torch.arange(1000, dtype=torch.float32)[100:120].view(4, 5).t())  # 20 of 1000
    module.register_buffer("halves", torch.arange(7, dtype=torch.float16)[1:])
    module.register_buffer("absent", None)
    module.tied = module[0].bias  # one Parameter object in two places
    x = torch.randn(3, 8)
    expected_out = module(x)
    expected = {name: t.clone() for name, t in module.state_dict().items()}

    size = pack_weights(module)

    torch.testing.assert_close(module(x), expected_out, rtol=0, atol=0)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
        assert tensor.shape == expected[name].shape and tensor.stride() == expected[name].stride()
    assert module.window.stride() == (1, 5)
    assert module[0].weight.untyped_storage().data_ptr() == module[1].weight.untyped_storage().data_ptr()
    assert module.tied is module[0].bias and isinstance(module.tied, nn.Parameter)
    assert module.absent is None
    # every tensor in one mapping starting on a huge-page boundary; of the 1000-float storage only its 20 floats' span
    addresses = [t.data_ptr() for t in module.state_dict().values()]
    assert min(addresses) % HUGE_PAGE == 0
    assert size < 1000 * 4


def test_a_family_decoder_packed_at_build_matches_transformers(tmp_path: Path) -> None:
    model = build_hf("qwen2")
    ours = load_ours(save_hf(model, tmp_path))  # build_decoder packs a CPU decoder's weights
    tensors = [t for t in ours.state_dict().values() if t.numel()]
    base = min(t.data_ptr() for t in tensors)
    assert base % HUGE_PAGE == 0
    span = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors) - base
    assert span < 2 * sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())
    for prompt, logits in zip(prompts(), our_logits(ours, prompts()), strict=True):
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=1e-4, atol=1e-4)


def _anon_huge_kib() -> int:
    match = re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text())
    return int(match.group(1)) if match else 0


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="no /proc/self/smaps_rollup (not Linux)")
def test_the_arena_is_backed_by_huge_pages_where_the_kernel_allows_them() -> None:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    module = nn.Module()
    module.register_buffer("weights", torch.ones(8 * HUGE_PAGE, dtype=torch.uint8))
    before = _anon_huge_kib()
    pack_weights(module)
    assert torch.all(module.weights == 1)
    assert _anon_huge_kib() - before >= 2 * HUGE_PAGE // 1024  # at least two of its 2 MiB pages


def _rss_kib_of_mapping(address: int) -> int:
    """Rss of the mapping of this process that contains `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
def test_a_start_fills_the_memory_the_last_one_recorded_and_gives_back_the_rest(tmp_path: Path) -> None:
    from model import arena

    record = tmp_path / "arena-size"
    module = nn.Module()
    module.register_buffer("weights", torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32))  # 6 MiB
    expected = module.weights.clone()
    size = pack_weights(module, record)
    assert int(record.read_text()) == size >= expected.numel() * 4
    del module  # its arena unmapped: smaps would count a neighbouring mapping of the same kind as one with ours

    record.write_text(str(16 * HUGE_PAGE))  # a larger arena than this one (an older start's, say)
    arena.reserve(record)
    assert arena._reserved is not None
    reserved = arena._reserved[0]
    base = ctypes.addressof(ctypes.c_char.from_buffer(reserved))
    again = nn.Module()
    again.register_buffer("weights", expected.clone())
    pack_weights(again, record)
    assert arena._reserved is None and torch.equal(again.weights, expected)
    assert base <= again.weights.data_ptr() < base + len(reserved)  # filled the reserved mapping
    assert _rss_kib_of_mapping(base) <= 3 * HUGE_PAGE // 1024  # of its 17 faulted-in huge pages, the arena's 3
    assert int(record.read_text()) == size  # this start's size, for the next


def test_a_reservation_smaller_than_the_arena_is_not_used(tmp_path: Path) -> None:
    from model import arena

    record = tmp_path / "arena-size"
    record.write_text(str(HUGE_PAGE // 2))
    arena.reserve(record)
    assert arena._reserved is not None
    reserved = arena._reserved[0]
    base = ctypes.addressof(ctypes.c_char.from_buffer(reserved))
    module = nn.Module()
    module.register_buffer("weights", torch.arange(2 * HUGE_PAGE, dtype=torch.uint8))
    expected = module.weights.clone()
    pack_weights(module)
    assert torch.equal(module.weights, expected)
    assert not base <= module.weights.data_ptr() < base + len(reserved)
    assert arena._reserved is None
