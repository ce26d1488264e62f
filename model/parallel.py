"""Tensor parallelism, Megatron style: which slice of every layer a rank holds, and the collectives between ranks.

Each rank holds a contiguous group of attention heads (its query heads with the KV heads they read), a contiguous
slice of the MLP's intermediate columns, and a contiguous slice of the vocabulary. q/k/v and gate/up are split by
their output rows (column parallel), o_proj and down_proj by their input columns (row parallel, one all-reduce
after each), the embedding and the LM head by vocabulary rows. Norms, rotary tables and the residual stream are
replicated: every rank computes them identically.

The decoder asks this module two things: its slices (arithmetic on rank and world size, known before any process
group exists, so a rank loads only its own slice) and the collectives (torch.distributed's default group; at world
size 1 they return their input, so a single process runs the same decoder code)."""

import os
import pickle
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model import shm_all_reduce


@dataclass(frozen=True, slots=True)
class Span:
    """Rows [start, start + size) of a dimension."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def split(n: int, world_size: int, rank: int) -> Span:
    """Rank `rank`'s contiguous share of n rows, sizes differing by at most one (n need not divide evenly)."""
    start, stop = n * rank // world_size, n * (rank + 1) // world_size
    return Span(start, stop - start)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """A rank's attention heads: its query heads and the KV heads they read, both contiguous."""

    q: Span
    kv: Span
    max_kv: int  # the most KV heads any rank holds: every rank's pool has the same number of blocks, sized by it


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """With at least as many KV heads as ranks, the KV heads are split (unevenly when they do not divide: SmolLM2's
    3 over 2 ranks gives 1 and 2) and each rank takes their query groups. With fewer, each KV head is replicated on
    world_size / num_kv_heads ranks, which split its query group, as vLLM does."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        kv = split(num_kv_heads, world_size, rank)
        return HeadShard(Span(kv.start * group, kv.size * group), kv, -(-num_kv_heads // world_size))
    if world_size % num_kv_heads or num_heads % world_size:
        raise ValueError(
            f"--tensor-parallel-size {world_size} does not fit {num_heads} query heads over {num_kv_heads} KV heads: "
            "with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and divide the query heads"
        )
    q = split(num_heads, world_size, rank)  # within one KV head's group, since world_size / num_kv_heads divides it
    return HeadShard(q, Span(q.start // group, 1), 1)


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> Span:
    """Equal slices of ceil(vocab / world) rows, so that gathered logits need no per-rank sizes; the last slice's
    rows past the vocabulary are zero padding, cut from the gathered logits."""
    per_rank = -(-vocab_size // world_size)
    return Span(rank * per_rank, per_rank)


@dataclass
class CollectiveStats:
    """Time rank 0 spends inside all-reduces (waiting for the slowest rank included), for bench/tensor_parallel.py.
    On CUDA, NCCL returns before the reduction ends: the figure is then only the launch cost."""

    all_reduce_calls: int = 0
    all_reduce_seconds: float = 0.0
    broadcast_seconds: float = 0.0  # sending each step's inputs (broadcast_object)


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group. The collectives use torch.distributed's default process
    group, which must be initialised (init_process_group below) before the first forward at world_size > 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the CUDA device index of this rank on its node
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    # why another rank is gone, when this process can tell (rank 0 watches its children), else None: a shared-memory
    # all-reduce looks at it while it waits
    failure_check: Callable[[], str | None] | None = None
    # step metadata travels on a gloo group even when the tensors use NCCL (a pickled plan is host data)
    _cpu_group: Any = None
    _shm: shm_all_reduce.ShmAllReduce | None = None  # CPU ranks on one machine

    @property
    def all_reduce_backend(self) -> str:
        return "shared memory" if self._shm is not None else str(dist.get_backend()) if dist.is_initialized() else "-"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place (the partial products of a row-parallel layer)."""
        if self.world_size == 1:
            return x
        started = time.perf_counter()
        if self._shm is not None and self._shm.fits(x):  # the same choice on every rank: shapes are the same
            self._shm.all_reduce(x)
        else:
            dist.all_reduce(x)
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_seconds += time.perf_counter() - started
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets the ranks' x concatenated along the last dimension (vocabulary-parallel logits -> all
        logits); the other ranks get their own x back, unused: only rank 0 samples."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj on every rank (the others pass None): pickled into one uint8 tensor, sent as its length
        and its bytes, two gloo broadcasts."""
        if self.world_size == 1:
            return obj
        started = time.perf_counter()
        size = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            size[0] = payload.numel()
        dist.broadcast(size, src=0, group=self._cpu_group)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self._cpu_group)
        self.stats.broadcast_seconds += time.perf_counter() - started
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def init_process_group(self, init_method: str, backend: str, timeout_s: float, shared_memory: bool = True) -> None:
        """Join the group (blocks until every rank has). `timeout_s` bounds every collective afterwards: a rank that
        hangs makes the others' next collective raise instead of waiting forever. `shared_memory`: gloo ranks that
        all run on this machine all-reduce through shared memory (model/shm_all_reduce.py)."""
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)  # fmt: skip
        if backend != "gloo":
            self._cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        elif shared_memory and shm_all_reduce.usable():
            hosts: list[str | None] = [None] * self.world_size
            dist.all_gather_object(hosts, socket.gethostname())
            if len(set(hosts)) == 1:
                self._map_shared_memory(timeout_s)

    def _map_shared_memory(self, timeout_s: float) -> None:
        path = f"/dev/shm/llmserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if self.rank == 0:  # created before its name is sent
            self._shm = shm_all_reduce.ShmAllReduce(path, 0, self.world_size, True, timeout_s, self.failure_check)
        path = self.broadcast_object(path)  # rank 0's name
        if self.rank != 0:
            self._shm = shm_all_reduce.ShmAllReduce(path, self.rank, self.world_size, False, timeout_s,
                                                    self.failure_check)  # fmt: skip
        dist.barrier()
        if self.rank == 0:
            os.unlink(path)  # every rank has it mapped: the name is not needed, and a crash leaves nothing behind


SINGLE = TensorParallel()


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's vocabulary slice; a token outside it contributes zeros, and an all-reduce
    sums the ranks' rows into each token's embedding. At world size 1 it is a plain nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        self.shard = vocab_shard(vocab_size, tp.world_size, tp.rank)
        # a weight given: no random init, which the checkpoint overwrites anyway; on the meta device its normal_
        # would import torch._dynamo, a second of start-up before any compile
        super().__init__(self.shard.size, hidden_size, _weight=torch.empty(self.shard.size, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.shard.start  # [T]
        outside = (local < 0) | (local >= self.shard.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))
