"""All-reduce through shared memory, for CPU ranks on one machine.

gloo's all-reduce of one decode row takes ~0.35 ms here (p90 ~4 ms), and a rank blocked in it sleeps, to be woken
at each of a step's 61 all-reduces: bench/tensor_parallel.py measured 78-105 ms of a 100-130 ms step spent in them.
Here each rank copies its tensor into its own slot of a shared buffer, publishes a sequence number, and yields the
CPU (sched_yield) until every rank has published; then every rank sums the slots in the same order, so all ranks
hold bitwise-identical results, as the replicated residual stream needs. 10-40 us per all-reduce here.

Two buffers alternate: a rank writes buffer k % 2 only after every rank published all-reduce k - 1, which each did
after reading buffer (k - 2) % 2, so one meeting per all-reduce suffices. The sequence number is stored after the
data; x86's stores are not reordered with earlier stores nor loads with earlier loads, which is the whole memory
model this relies on: other CPUs use gloo (`usable()`)."""

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

# per rank and buffer: an all-reduce of 1M float32 values (256 tokens of a 4096-wide model); larger ones go through
# gloo. The file is sparse: /dev/shm holds only the pages touched, at most 2 x ranks x this (a container's default
# /dev/shm is 64 MB: docker-compose.yml gives the tp profile more)
SLOT_BYTES = 4 * 2**20
CHECK_EVERY = 256  # yields between looks at the clock and at the liveness check


def usable() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


class ShmAllReduce:
    """`path`: a file in /dev/shm that rank 0 created (create=True) and every rank maps; rank 0 removes the name once
    all have mapped it, so nothing is left behind however the processes end. `failure`: returns why a peer is gone
    (or None), looked at while waiting; `timeout_s`: the longest wait before raising."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        create: bool,
        timeout_s: float,
        failure: Callable[[], str | None] | None = None,
    ) -> None:
        header_bytes = 64 * world_size  # a cache line per rank: no false sharing while spinning
        size = header_bytes + 2 * world_size * SLOT_BYTES
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        header = raw[:header_bytes].view(torch.int64).view(world_size, 8)
        self.flags, self.pids = header[:, 0], header[:, 1]  # [world_size] each: sequence numbers, process ids
        self.pids[rank] = os.getpid()  # read by the others only after the caller's barrier
        self.slots = raw[header_bytes:].view(2, world_size, SLOT_BYTES)
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.failure = timeout_s, failure
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; every rank must call it in the same order with the same shape and dtype."""
        self.seq += 1
        nbytes = x.numel() * x.element_size()
        buffer = self.slots[self.seq % 2, :, :nbytes].view(x.dtype)  # [world_size, numel]
        buffer[self.rank].copy_(x.view(-1))
        self.flags[self.rank] = self.seq  # after the data (x86 keeps stores in order)
        self._wait()
        torch.sum(buffer, dim=0, out=x.view(-1))  # the same order of additions on every rank
        return x

    def _wait(self) -> None:
        deadline = None
        spins = 0
        while int(self.flags.min()) < self.seq:
            os.sched_yield()  # on a busy machine the rank we wait for may need this very CPU
            spins += 1
            if spins % CHECK_EVERY:
                continue
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            reason = self.failure() if self.failure is not None else self._gone()
            if reason is not None:
                raise RuntimeError(f"shared-memory all-reduce abandoned: {reason}")
            if now > deadline:  # alive but not coming: stopped, or stuck
                late = [r for r in range(self.world_size) if int(self.flags[r]) < self.seq]
                raise RuntimeError(
                    f"shared-memory all-reduce timed out after {self.timeout_s:g} s waiting for rank(s) {late}"
                )

    def _gone(self) -> str | None:
        """A rank we wait for whose process no longer exists (the ranks share this machine's process ids)."""
        for rank in range(self.world_size):
            pid = int(self.pids[rank])
            if int(self.flags[rank]) < self.seq and pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return f"rank {rank} (pid {pid}) has exited"
                except PermissionError:
                    pass  # exists, under another user
        return None
