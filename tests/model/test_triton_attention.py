"""The Triton paged FlashAttention kernel against a float64 reference, for every attention shape of the families.

On CPU the kernel runs under Triton's interpreter, which has to be on (TRITON_INTERPRET=1) before triton is first
imported: triton.language's own jit helpers (tl.max, tl.sum) are decorated then, and other test modules import it
first. So without the variable, test_kernel_under_the_interpreter runs this file in a child pytest that has it, and
the rest of the suite never sees it. The interpreter computes bfloat16 dots wrongly (numpy has no bfloat16), so CPU
cases run in float32 and float16; bfloat16 is checked on CUDA."""

import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from model.batch import Batch
from model.layers import triton_attention
from model.layers.attention import PagedAttention
from model.loaders import load_config
from tests.model.families import FAMILIES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]
runs_kernel = pytest.mark.skipif(
    not (CUDA or INTERPRETED), reason="on CPU: run by test_kernel_under_the_interpreter, in a child process"
)


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    scale: float

    def __str__(self) -> str:
        return f"{self.heads}q{self.kv_heads}kv-d{self.head_dim}-w{self.window}"


def family_shapes() -> list[Shape]:
    """Each distinct (heads, KV heads, head dim, window, scale) of the families' layers, from our own config reader."""
    shapes: set[Shape] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in FAMILIES.items():
            folder = Path(tmp) / name
            make().save_pretrained(folder)
            c = load_config(folder)
            for window in c.layer_windows:
                shapes.add(Shape(c.num_heads, c.num_kv_heads, c.head_dim, window, c.attention_scale))
    return sorted(shapes, key=str)


SHAPES = [
    *family_shapes(),
    Shape(9, 3, 64, None, 64**-0.5),  # the embedded SmolLM2-135M: a group of 3, not a power of two
    Shape(2, 2, 96, None, 96**-0.5),  # Phi-3-mini's head dim 96 (padded to 128 in the kernel), MHA
]


@pytest.mark.skipif(CUDA or INTERPRETED, reason="the kernel tests run in this process")
def test_kernel_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0 and " passed" in summary and "failed" not in summary, child.stdout + child.stderr


@dataclass
class Case:
    """A batch of sequences whose whole context (earlier tokens and this step's) is in a scattered block pool."""

    q: torch.Tensor  # [T, H, D], this step's queries
    keys: list[torch.Tensor]  # per sequence [context, KVH, D]: the logical context, for the reference
    values: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    query_lens: list[int]
    num_decode: int


def make_case(
    shape: Shape,
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    kvh, d = shape.kv_heads, shape.head_dim
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns, filled with noise too
    order = torch.randperm(num_blocks, generator=gen).tolist()  # each sequence's blocks scattered over the pool
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    keys, values, tables = [], [], []
    for ctx, n in zip(context_lens, needed, strict=True):
        table = [order.pop() for _ in range(n)]
        tables.append(table + [-1] * (max(needed) - n))
        keys.append(k_cache[table].reshape(-1, kvh, d)[:ctx].to(dtype))
        values.append(v_cache[table].reshape(-1, kvh, d)[:ctx].to(dtype))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    num_decode = 0
    while num_decode < len(query_lens) and query_lens[num_decode] == 1:
        num_decode += 1
    return Case(
        q=torch.randn(starts[-1], shape.heads, d, generator=gen).to(device, dtype),
        keys=keys,
        values=values,
        k_cache=k_cache.to(device, dtype),
        v_cache=v_cache.to(device, dtype),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens=query_lens,
        num_decode=num_decode,
    )


def reference(case: Case, shape: Shape) -> torch.Tensor:
    """float64 softmax attention of each sequence's new tokens over its logical context: [T, H, D]."""
    outs = []
    start = 0
    for keys, values, q_len in zip(case.keys, case.values, case.query_lens, strict=True):
        ctx = keys.shape[0]
        q = case.q[start : start + q_len].double().cpu()  # [L, H, D]
        k = keys.double().repeat_interleave(shape.heads // shape.kv_heads, dim=1)  # [C, H, D]
        v = values.double().repeat_interleave(shape.heads // shape.kv_heads, dim=1)
        scores = torch.einsum("lhd,chd->hlc", q, k) * shape.scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if shape.window is not None:
            visible &= k_pos > q_pos - shape.window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hlc,chd->lhd", probs, v))
        start += q_len
    return torch.cat(outs)


def run_kernel(case: Case, shape: Shape, block_n: int = 0) -> torch.Tensor:
    return triton_attention.paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        case.query_start_loc,
        case.num_decode,
        max(case.query_lens),
        shape.scale,
        shape.window,
        block_n=block_n,
    )


DEVICE = "cuda" if CUDA else "cpu"
# two decodes (one past the window), a prompt chunk after 21 cached tokens, a whole 12-token prompt
MIXED = ([1, 1, 9, 12], [7, 34, 30, 12])


@runs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mixed_batch_matches_float64(shape: Shape) -> None:
    # block_n 16 over 4-token blocks: several iterations per sequence, each spanning blocks out of order
    case = make_case(shape, *MIXED, block_size=4, dtype=torch.float32, device=DEVICE)
    out = run_kernel(case, shape, block_n=16)
    assert (out.double().cpu() - reference(case, shape)).abs().max().item() < 1e-5


@runs_kernel
@pytest.mark.parametrize("shape", [s for s in SHAPES if s.window is not None][:1] + SHAPES[-2:-1], ids=str)
def test_float16_decodes_and_chunks_match_float64(shape: Shape) -> None:
    # a 16-bit cache: probabilities are rounded to 16 bits before the P @ V product, as in FlashAttention
    case = make_case(shape, [1, 1, 1, 5], [3, 17, 40, 45], block_size=16, dtype=torch.float16, device=DEVICE)
    out = run_kernel(case, shape)
    assert (out.double().cpu() - reference(case, shape)).abs().max().item() < 5e-3


@runs_kernel
def test_decode_only_and_prefill_only_batches() -> None:
    shape = Shape(4, 2, 16, 5, 0.25)
    for query_lens, context_lens in (([1, 1, 1], [1, 9, 70]), ([4, 20], [4, 41])):
        case = make_case(shape, query_lens, context_lens, block_size=8, dtype=torch.float32, device=DEVICE, seed=3)
        out = run_kernel(case, shape)
        assert (out.double().cpu() - reference(case, shape)).abs().max().item() < 1e-5


@runs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_float64(seed: int) -> None:
    """Edges the fixed cases miss: one-token blocks, blocks wider than a key tile, a window of 1, contexts ending on
    a block boundary, and chunks longer than one tile of queries (up to three tiles)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options: list) -> Any:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    heads, kv_heads = pick([(4, 4), (4, 2), (6, 3), (8, 1)])
    shape = Shape(heads, kv_heads, pick([16, 32, 40]), pick([None, 1, 7, 40]), 0.3)
    block_size = pick([1, 4, 16, 32])
    num_decode, num_chunks = (
        int(torch.randint(0, 4, (1,), generator=gen)),
        int(torch.randint(1, 3, (1,), generator=gen)),
    )
    query_lens = [1] * num_decode + [
        int(n) for n in torch.randint(2, 3 * 64 // (heads // kv_heads), (num_chunks,), generator=gen)
    ]
    context_lens = [q + int(torch.randint(0, 50, (1,), generator=gen)) for q in query_lens]
    context_lens[-1] = -(-context_lens[-1] // 16) * 16  # ends on a block boundary (for blocks of 1, 4 and 16)
    case = make_case(shape, query_lens, context_lens, block_size, torch.float32, device=DEVICE, seed=seed)
    out = run_kernel(case, shape, block_n=int(pick([16, 0])))
    assert (out.double().cpu() - reference(case, shape)).abs().max().item() < 1e-5


@runs_kernel
def test_paged_attention_layer_writes_then_reads_through_triton() -> None:
    """The layer's triton backend: this step's K/V go into the pool by slot_mapping, then the kernel reads them."""
    shape = Shape(4, 2, 16, None, 0.25)
    case = make_case(shape, [1, 6], [10, 14], block_size=4, dtype=torch.float32, device=DEVICE, seed=5)
    attn = PagedAttention(shape.heads, shape.kv_heads, shape.head_dim, shape.scale, shape.window).to(DEVICE)
    attn.k_cache, attn.v_cache = case.k_cache.clone(), case.v_cache.clone()
    attn.use_triton = True
    tables = case.block_tables.cpu().tolist()
    slots, positions, new_k, new_v = [], [], [], []
    for table, keys, values, q_len in zip(tables, case.keys, case.values, case.query_lens, strict=True):
        for p in range(keys.shape[0] - q_len, keys.shape[0]):
            slots.append(table[p // 4] * 4 + p % 4)
            positions.append(p)
        new_k.append(keys[-q_len:])
        new_v.append(values[-q_len:])
    for pool in (attn.k_cache, attn.v_cache):  # the new tokens' slots hold stale data until the layer writes them
        pool.view(-1, shape.kv_heads, shape.head_dim)[torch.tensor(slots, device=DEVICE)] = 99.0
    batch = Batch(
        input_ids=torch.zeros(len(slots), dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=case.block_tables,
        context_lens=case.context_lens,
        query_start_loc=case.query_start_loc,
        logits_indices=torch.tensor([0, len(slots) - 1], device=DEVICE),
        num_decode=case.num_decode,
        max_query_len=max(case.query_lens),
        max_context_len=int(case.context_lens.max()),
        query_lens_cpu=case.query_lens,
        context_lens_cpu=case.context_lens.tolist(),
    )
    out = attn(case.q, torch.cat(new_k).to(DEVICE), torch.cat(new_v).to(DEVICE), batch)
    assert (out.double().cpu() - reference(case, shape)).abs().max().item() < 1e-5


def ptxas_found() -> bool:
    """The triton wheel bundles NVIDIA's assembler: the kernel can be compiled to a cubin without a GPU."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


# (dtype, query heads per KV head, head dim): the embedded model's shape, Llama-3-8B's, Gemma's widest, and float32
COMPILED = [
    (torch.bfloat16, 3, 64),
    (torch.bfloat16, 4, 128),
    (torch.bfloat16, 8, 256),
    (torch.float32, 1, 256),
]


@pytest.mark.skipif(INTERPRETED or not ptxas_found(), reason="needs triton's bundled ptxas, outside the interpreter")
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype,group,head_dim", COMPILED, ids=lambda v: str(v).removeprefix("torch."))
def test_kernel_compiles_for_h200_within_99_kib_of_shared_memory(
    dtype: torch.dtype, group: int, head_dim: int, decode: bool
) -> None:
    """What the GPU would compile at the first launch, compiled here for sm_90 (H100/H200) with the tile sizes
    paged_attention would pick: Triton's type and shape checks, and ptxas, run without a GPU. 99 KiB is the most
    shared memory a block gets on sm_86/sm_89; sm_80 and sm_90 allow more."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = triton_attention.tile_config(group, head_dim, dtype, decode)
    num_warps = config.pop("num_warps")
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, USE_WINDOW=True, IEEE=dtype == torch.float32)
    constants |= config
    element = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    kernel = triton_attention.paged_attention_kernel
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"):
            signature[name] = f"*{element}"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    compiled = triton.compile(
        ASTSource(kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "enable_fp_fusion": True},
    )
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 99 * 1024, config


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the kernel compiled for the GPU, in bfloat16, against torch SDPA")
@pytest.mark.parametrize("shape", [Shape(32, 8, 128, None, 128**-0.5), Shape(8, 1, 256, 512, 256**-0.5)], ids=str)
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_bfloat16_on_cuda_is_as_close_to_float64_as_torch_sdpa(shape: Shape, kind: str) -> None:
    """Llama-3-8B's and Gemma's widest attention shapes at real lengths: our bfloat16 output against torch SDPA's
    bfloat16 output, both measured against SDPA in float64 over the same logical context."""
    query_lens, context_lens = {
        "prefill": ([1000, 77], [1000, 1077]),
        "decode": ([1] * 64, [(37 * i) % 2000 + 1 for i in range(64)]),
        "mixed": ([1] * 8 + [256], [(101 * i) % 900 + 1 for i in range(8)] + [1300]),
    }[kind]
    case = make_case(shape, query_lens, context_lens, block_size=16, dtype=torch.bfloat16, device="cuda")
    out = run_kernel(case, shape).double()
    start = 0
    for keys, values, q_len in zip(case.keys, case.values, case.query_lens, strict=True):
        ctx = keys.shape[0]
        q_pos = torch.arange(ctx - q_len, ctx, device="cuda")[:, None]
        k_pos = torch.arange(ctx, device="cuda")[None, :]
        mask = k_pos <= q_pos
        if shape.window is not None:
            mask &= k_pos > q_pos - shape.window
        # [1, heads, len, D] each
        args = [t.cuda().transpose(0, 1)[None] for t in (case.q[start : start + q_len], keys, values)]

        def sdpa(dtype: torch.dtype, args: list[torch.Tensor] = args, mask: torch.Tensor = mask) -> torch.Tensor:
            qi, ki, vi = (t.to(dtype) for t in args)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=shape.scale, enable_gqa=True)
            return o[0].transpose(0, 1).double()  # [len, heads, D]

        exact = sdpa(torch.float64)
        ours = (out[start : start + q_len] - exact).abs().max().item()
        theirs = (sdpa(torch.bfloat16) - exact).abs().max().item()
        assert ours <= 2 * theirs + 1e-3, (ours, theirs)
        start += q_len
