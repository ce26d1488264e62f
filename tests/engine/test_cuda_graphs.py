"""CUDA graphs for decode steps: the capture schedule, when capture is skipped, and the replay protocol (copy into
static buffers, pad with dummy rows, pick the sampling rows' logits). On CPU a stand-in replays by running the eager
decoder over the static buffers, as the captured graph would; on CUDA the real graphs are checked against eager."""

from pathlib import Path

import pytest
import torch

from config import Settings, load_settings
from model.batch import Batch
from model.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from model.engine.engine import Engine
from tests.engine.drive import greedy, run
from tests.model.families import build_hf, make_tokenizer, prompts, save_hf


def test_capture_sizes_follow_vllms_schedule_up_to_max_num_seqs() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest batch the scheduler forms gets a graph too
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_a_batch_is_padded_to_the_next_captured_size() -> None:
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None


def test_enforce_eager_flag() -> None:
    assert load_settings(["serve", "--enforce-eager"])[1].enforce_eager is True
    assert load_settings(["serve"])[1].enforce_eager is False


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # sliding-window layers and GQA: the window masks are built from the static buffers too
    return save_hf(build_hf("mistral"), tmp_path_factory.mktemp("mistral"))


def engine(folder: Path, **overrides: object) -> Engine:
    settings = Settings(model=str(folder), kv_cache_memory=4 * 2**20, block_size=16, max_num_seqs=8, **overrides)
    return Engine(settings, tokenizer=make_tokenizer())


class EmulatedGraph:
    """Stands in for one captured graph on CPU: replay() runs the eager decoder on the static buffers' first `size`
    rows, adding the views the torch attention path needs (the graph-capable backends read the block table)."""

    def __init__(self, graphs: DecodeGraphs, size: int, log: list[tuple[int, int, int]], rows: list[int]) -> None:
        self.graphs, self.size, self.log, self.rows = graphs, size, log, rows

    def replay(self) -> None:
        g = self.graphs
        batch = g._batch(self.size)
        blocks = batch.block_tables.shape[1]
        block_size = g.scratch_slot // g.scratch_block
        batch.decode_blocks = blocks
        batch.decode_block_ids = batch.block_tables.reshape(-1).long().clamp(min=0)
        visible = torch.arange(blocks * block_size) < batch.context_lens[:, None]
        batch.decode_mask = visible[:, None, None, :]
        g.hidden[self.size].copy_(g.decoder(batch))
        dummies = (batch.slot_mapping == g.scratch_slot) & (batch.context_lens == 1)
        dummies &= batch.block_tables[:, 0] == g.scratch_block
        self.log.append((self.size, self.rows[-1], int(dummies.sum())))


def test_replay_protocol_gives_eager_tokens(mistral_folder: Path) -> None:
    graphed = engine(mistral_folder)
    runner = graphed.runner
    assert runner.device.type == "cpu" and runner.decode_graphs is None  # never captured on CPU
    graphs = DecodeGraphs(runner.decoder, 8, runner.max_model_len, 16, runner.num_blocks, runner.device)
    replays: list[tuple[int, int, int]] = []  # (captured size, real rows, dummy rows) per replay
    rows: list[int] = []
    graphs.graphs = {s: EmulatedGraph(graphs, s, replays, rows) for s in graphs.sizes}  # type: ignore[misc]
    graphs.hidden = {s: torch.empty(s, runner.config.hidden_size) for s in graphs.sizes}
    replay = graphs.run

    def run_counting_rows(batch: Batch) -> torch.Tensor | None:
        rows.append(batch.num_seqs)
        return replay(batch)

    graphs.run = run_counting_rows  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    # seven streams arriving and finishing at different steps: decode batches grow to 7 (padded to 8) and shrink
    # back, so rows that held a live sequence in one step are dummies in a later one
    lengths = (5, 23, 50, 9, 12, 30, 7)
    budgets = (40, 10, 25, 33, 5, 18, 28)
    requests = {f"r{i}": (p, greedy(n)) for i, (p, n) in enumerate(zip(prompts(lengths=lengths), budgets, strict=True))}
    arrivals = {f"r{i}": 2 * i for i in range(len(lengths))}
    got = run(graphed, requests, arrivals)
    want = run(engine(mistral_folder), requests, arrivals)
    assert got == want
    assert {1, 2, 4, 8} <= {size for size, _, _ in replays}
    # every row past the real ones was a dummy again, whatever it held in an earlier, larger step
    assert all(dummies == size - n for size, n, dummies in replays), replays
    assert any(size > n for size, n, _ in replays)
    scratch = runner.decoder.attention_layers()[0].k_cache[runner.num_blocks]
    assert scratch.abs().sum() > 0  # the dummy rows wrote their K/V into the scratch block past the BlockManager's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures and replays real graphs")
def test_cuda_graphs_give_eager_tokens(mistral_folder: Path) -> None:
    graphed = engine(mistral_folder, device="cuda", dtype="float32")
    assert graphed.runner.decode_graphs is not None and graphed.runner.attention_backend in ("triton", "flash-attn")
    eager = engine(mistral_folder, device="cuda", dtype="float32", enforce_eager=True)
    assert eager.runner.decode_graphs is None
    requests = {f"r{i}": (p, greedy(30)) for i, p in enumerate(prompts(lengths=(5, 23, 50, 9, 12)))}
    arrivals = {f"r{i}": 3 * i for i in range(5)}
    assert run(graphed, requests, arrivals) == run(eager, requests, arrivals)
