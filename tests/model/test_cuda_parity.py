"""Our decoder on CUDA against transformers, for every family's tiny model and a random model of the embedded model's
shape (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads; its GGUF is too big to carry to the GPU machine).
Attention is the Triton kernel reading the paged KV cache, prompts go in two chunks (the second attends to the
first through the cache), and the engine's decode steps replay CUDA graphs. CUDA only: skipped elsewhere."""

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from config import Settings
from model.batch import Batch
from model.decoder import Decoder
from model.engine.engine import Engine
from model.engine.model_runner import build_decoder
from model.loaders import load_config
from tests.engine.drive import greedy, run
from tests.model.families import FAMILIES, build_hf, make_tokenizer, prompts, randomize, save_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BLOCK_SIZE = 16
SMOLLM2_SHAPE = "smollm2-shape"


def smollm2_shaped() -> PreTrainedModel:
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    randomize(model)
    return model


@pytest.fixture(scope="module", params=[*FAMILIES, SMOLLM2_SHAPE])
def model_folder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    model = smollm2_shaped() if request.param == SMOLLM2_SHAPE else build_hf(request.param)
    return model, save_hf(model, tmp_path_factory.mktemp(request.param))


def hf_logits_on(model: PreTrainedModel, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits at every position of prompt, run on CUDA in dtype: [len, vocab] float64."""
    hf = copy.deepcopy(model).to("cuda", dtype)
    with torch.no_grad():
        return hf(torch.tensor([prompt], device="cuda")).logits[0].double()


@torch.inference_mode()
def paged_logits(decoder: Decoder, batch_prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, our logits at every position ([len, vocab] float64): each prompt in two chunks, as two steps of
    one batch over a KV pool on CUDA, each sequence's blocks in reverse order in the pool."""
    c = decoder.config
    tables, first = [], 0
    for p in batch_prompts:
        n = -(-len(p) // BLOCK_SIZE)
        tables.append(list(range(first + n - 1, first - 1, -1)))
        first += n
    pool = (first, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    dtype = decoder.embed_tokens.weight.dtype
    for attn in decoder.attention_layers():
        attn.k_cache = torch.zeros(pool, dtype=dtype, device="cuda")
        attn.v_cache = torch.zeros(pool, dtype=dtype, device="cuda")
        attn.use_triton = True
    width = max(map(len, tables))
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    outs: list[list[torch.Tensor]] = [[] for _ in batch_prompts]
    splits = [(0, len(p) // 2) for p in batch_prompts], [(len(p) // 2, len(p)) for p in batch_prompts]
    for step in splits:
        ids = [t for p, (a, b) in zip(batch_prompts, step, strict=True) for t in p[a:b]]
        positions = [i for a, b in step for i in range(a, b)]
        slots = [t[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for t, (a, b) in zip(tables, step, strict=True)
                 for i in range(a, b)]  # fmt: skip
        lens, starts = [b - a for a, b in step], [0]
        for n in lens:
            starts.append(starts[-1] + n)
        batch = Batch(
            input_ids=torch.tensor(ids, device="cuda"),
            positions=torch.tensor(positions, device="cuda"),
            slot_mapping=torch.tensor(slots, device="cuda"),
            block_tables=padded,
            context_lens=torch.tensor([b for _, b in step], dtype=torch.int32, device="cuda"),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
            logits_indices=torch.arange(len(ids), device="cuda"),
            num_decode=0,
            max_query_len=max(lens),
            max_context_len=max(b for _, b in step),
            query_lens_cpu=lens,
            context_lens_cpu=[b for _, b in step],
        )
        logits = decoder.compute_logits(decoder(batch)).double()
        for i, rows in enumerate(logits.split(lens)):
            outs[i].append(rows)
    return [torch.cat(rows) for rows in outs]


def test_float32_prefill_chunks_match_float64(model_folder: tuple[PreTrainedModel, Path]) -> None:
    model, folder = model_folder
    decoder = build_decoder(folder, load_config(folder), 256, torch.float32, torch.device("cuda"))
    batch = prompts(lengths=(5, 23, 50))  # the last crosses the sliding window of 16 in both chunks
    for prompt, ours in zip(batch, paged_logits(decoder, batch), strict=True):
        exact = hf_logits_on(model, prompt, torch.float64)
        theirs = (hf_logits_on(model, prompt, torch.float32) - exact).abs().max().item()
        # float32 rounding only: within 1e-4 (the CPU tests' bound against transformers' float32), or twice
        # transformers' own float32 error where 30 layers accumulate more
        assert (ours - exact).abs().max().item() <= max(1e-4, 2 * theirs)


def test_bfloat16_is_as_close_as_transformers_own_bfloat16(model_folder: tuple[PreTrainedModel, Path]) -> None:
    model, folder = model_folder
    decoder = build_decoder(folder, load_config(folder), 256, torch.bfloat16, torch.device("cuda"))
    batch = prompts(lengths=(5, 23, 50))
    for prompt, ours in zip(batch, paged_logits(decoder, batch), strict=True):
        exact = hf_logits_on(model, prompt, torch.float64)
        theirs = (hf_logits_on(model, prompt, torch.bfloat16) - exact).abs().max().item()
        assert (ours - exact).abs().max().item() <= 1.5 * theirs  # on CPU: ours is 0.6-0.9x of theirs


def test_engine_greedy_with_cuda_graphs_matches_transformers(model_folder: tuple[PreTrainedModel, Path]) -> None:
    """float32 engine on CUDA (Triton attention, decode steps replayed from graphs) against transformers' argmax
    over the same tokens, up to its first near-tie."""
    model, folder = model_folder
    settings = Settings(
        model=str(folder), device="cuda", dtype="float32", kv_cache_memory=64 * 2**20, block_size=BLOCK_SIZE,
        max_num_seqs=8, max_num_batched_tokens=32,  # prompts of 48 and 61 tokens go in chunks beside decodes
    )  # fmt: skip
    engine = Engine(settings, tokenizer=make_tokenizer(vocab_size=model.config.get_text_config().vocab_size))
    assert engine.runner.attention_backend in ("triton", "flash-attn")
    assert engine.runner.decode_graphs is not None
    batch = prompts(seed=2, lengths=(48, 9, 61))
    generated = run(engine, {str(i): (p, greedy(16)) for i, p in enumerate(batch)})
    for i, prompt in enumerate(batch):
        tokens = generated[str(i)]
        reference = hf_logits_on(model, prompt + tokens[:-1], torch.float32)[len(prompt) - 1 :]
        top2 = reference.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        exact = next((j for j, m in enumerate(margins) if m < 1e-3), len(tokens))
        assert tokens[:exact] == reference.argmax(-1).tolist()[:exact]
