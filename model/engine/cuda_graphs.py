"""CUDA graphs for decode steps. A decode step of a small model is a few hundred tiny kernels, and on a GPU the
host's time to launch them is longer than the GPU's time to run them; a graph replays them all in one launch.

A graph replays fixed kernels on fixed memory, so each is captured for one batch size, at start-up, over static
input buffers: 1, 2, 4, 8, then every 8 up to --max-num-seqs, as vLLM does. A step of n decode rows is copied into
the buffers, padded up to the next captured size with dummy rows, and replayed. A dummy row has one token of
context in a scratch block of the KV pool that no sequence owns, so its K/V write lands there and harms nothing.

What varies from step to step (context lengths, block tables, positions) is read from device memory inside the
kernels, so one graph serves every context length. Only backends that never sync with the host can be captured:
flash-attn and our Triton kernel, not the torch path (it sizes its tensors by the longest context on the host)."""

import bisect
import logging
import time

import torch

from model.batch import Batch
from model.decoder import Decoder

log = logging.getLogger("llmserve.cuda_graphs")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8, up to max_num_seqs, which is always included so that
    every decode batch the scheduler can form has a graph."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes)


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        decoder: Decoder,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.decoder = decoder
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        rows, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        # Static inputs: every captured graph reads its first `size` rows of these. Initialized as dummy rows.
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((rows, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token per row
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)  # every row samples
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # per size: the graph's output, hidden states [size, hidden]. The LM head runs after the replay, on the rows
        # that sample: kept in the graphs, one [size, vocab] float32 output per size would hold 2 GB for 1B Llama at
        # --max-num-seqs 256 (sizes 1..256 sum to 4,231 rows of 128k logits)
        self.hidden: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _batch(self, size: int) -> Batch:
        # a new Batch each time: its per-step caches (rotary cos/sin) must be computed inside the graph, not
        # carried over from the warm-up run
        return Batch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            logits_indices=self.logits_indices[:size],
            num_decode=size,
            max_query_len=1,
            # flash-attn sizes its work by this host value, baked in at capture: the longest a context can be
            max_context_len=self.max_model_len,
            # read only by the torch path, which is never captured
            query_lens_cpu=[1] * size,
            context_lens_cpu=[1] * size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory from the shared pool
            # an eager run first: Triton compiles its kernel, the rotary tables and cuBLAS workspaces get built,
            # none of which may happen during capture
            self.decoder(self._batch(size))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[size] = self.decoder(self._batch(size))
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.sizes),
            ",".join(map(str, self.sizes)),
            self.capture_seconds,
        )

    def run(self, batch: Batch) -> torch.Tensor | None:
        """Logits of a decode-only batch ([sampling rows, vocab] float32) by replaying a graph; None when the
        batch has prompt tokens or more rows or blocks than any graph holds (the caller then runs it eagerly)."""
        n = batch.num_seqs
        size = padded_size(n, self.sizes)
        width = batch.block_tables.shape[1]
        if batch.num_decode != n or size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.context_lens[:n].copy_(batch.context_lens)
        # columns past `width` keep stale block ids: never read, as no row's context reaches them
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if size > n:
            # rows n..size may hold a real sequence's slots from an earlier, larger step: make them dummies again,
            # or the replay would overwrite that sequence's K/V
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.positions[n:size].zero_()
            self.context_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.scratch_block)
        self.graphs[size].replay()
        return self.decoder.compute_logits(self.hidden[size][batch.logits_indices])
