"""The shared-memory all-reduce, two ranks as two threads of this process on one mapped file: sums equal a direct
sum, every rank gets the bitwise-same result, and a rank that never arrives makes the other raise."""

import threading
from pathlib import Path

import pytest
import torch

from model import shm_all_reduce
from model.shm_all_reduce import ShmAllReduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.usable(), reason="x86 with /dev/shm only")


def test_two_ranks_get_the_same_sums(tmp_path: Path) -> None:
    path = str(tmp_path / "buffer")
    ranks = [ShmAllReduce(path, 0, 2, True, 30), ShmAllReduce(path, 1, 2, False, 30)]
    gen = torch.Generator().manual_seed(0)
    # shapes of a decode row, a prompt chunk, a bfloat16 model's, and ten in a row (both buffers, reused)
    cases = [
        torch.randn(2, 1, 576, generator=gen),
        torch.randn(2, 146, 576, generator=gen),
        torch.randn(2, 16, 576, generator=gen).bfloat16(),
        *[torch.randn(2, 3, 8, generator=gen)] * 10,
    ]
    results: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        for case in cases:
            results[rank].append(ranks[rank].all_reduce(case[rank].clone()))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results[0]) == len(results[1]) == len(cases)
    for case, r0, r1 in zip(cases, results[0], results[1], strict=True):
        assert torch.equal(r0, r1)  # replicated state stays replicated
        assert torch.equal(r0, case.sum(0))  # two addends: the same rounding as a direct sum


def test_a_rank_that_never_arrives_times_out(tmp_path: Path) -> None:
    alone = ShmAllReduce(str(tmp_path / "buffer"), 0, 2, True, timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"timed out after 0.2 s waiting for rank\(s\) \[1\]"):
        alone.all_reduce(torch.ones(4))


def test_a_known_failure_ends_the_wait_at_once(tmp_path: Path) -> None:
    alone = ShmAllReduce(str(tmp_path / "buffer"), 0, 2, True, timeout_s=60, failure=lambda: "rank 1 was killed")
    with pytest.raises(RuntimeError, match="abandoned: rank 1 was killed"):
        alone.all_reduce(torch.ones(4))


def test_a_rank_whose_process_is_gone_ends_the_wait_at_once(tmp_path: Path) -> None:
    import subprocess

    path = str(tmp_path / "buffer")
    alone = ShmAllReduce(path, 0, 2, True, timeout_s=60)
    other = ShmAllReduce(path, 1, 2, False, timeout_s=60)
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its process id no longer exists
    other.pids[1] = dead.pid  # as if rank 1 had been that process
    with pytest.raises(RuntimeError, match=rf"abandoned: rank 1 \(pid {dead.pid}\) has exited"):
        alone.all_reduce(torch.ones(4))
