"""ModelRunner: builds the decoder and its KV pool, turns scheduled sequences into a Batch, and returns
sampled tokens. Under tensor parallelism every rank has one, holding its slice of the model and of the KV pool:
rank 0's runs the steps and sends each step's inputs to the others, whose runners `follow()`."""

import contextlib
import ctypes
import enum
import logging
import math
import mmap
import os
import shutil
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Settings
from model.arena import pack_weights, record_path
from model.batch import Batch
from model.config import ModelConfig
from model.decoder import Decoder
from model.device import resolve_device
from model.engine import aot_step
from model.engine.cuda_graphs import DecodeGraphs
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import SamplingParams, Sequence, TokenLogprob
from model.layers import group_kernels
from model.layers.attention import flash_attn_usable
from model.layers.linear import PackedLinear, onednn_usable, pack_linears
from model.layers.quantization import WeightOnlyLinear, install_quantized, quantize
from model.layers.sampler import Sampler, SamplingBatch
from model.layers.tracing import compiling_here
from model.layers.triton_attention import triton_usable
from model.loaders import load_config, read_weights
from model.parallel import SINGLE, TensorParallel, head_shard

log = logging.getLogger("llmserve.model_runner")


@dataclass(slots=True)
class StepSample:
    """What one step sampled: per sampling row, its new tokens (several when proposals were accepted) and, where
    asked, their logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass(slots=True)
class StepInputs:
    """One step's batch as host lists: what rank 0 sends the other ranks, each of which builds its own Batch."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # flat KV slot of each token
    query_lens: list[int]
    context_lens: list[int]
    logits_indices: list[int]  # empty: no row samples, so no LM head this step
    tables: list[list[int]]  # block tables, -1 padded


class WorkerCommand(enum.Enum):
    """What rank 0 sends the other ranks instead of a step."""

    HEARTBEAT = "heartbeat"  # still here: sent while idle, so that the others' wait stays within the timeout
    STOP = "stop"


# An idle rank 0 sends a heartbeat this often (or at a third of --distributed-timeout, if that is shorter).
HEARTBEAT_SECONDS = 5.0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bfloat16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bfloat16 natively; without them torch emulates it, slower than
    float32."""
    return bool({"avx512_bf16", "amx_bf16"} & group_kernels.cpu_flags())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA; float32 on CPU, where bfloat16 activations (residual stream, norms, attention) moved
    the default model off the float32 reference on 9 of 20 prompts and the grouped kernel already runs prompt GEMMs
    in bfloat16 where the CPU has it (group_gemm.cpp)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def c_compiler_found() -> bool:
    """Whether inductor can build its CPU kernels here (it calls the system C++ compiler)."""
    return shutil.which("cc") is not None or shutil.which("gcc") is not None


def build_decoder(
    path: Path,
    config: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    prepack_weights: bool = True,
    keep_weights: bool = False,
    tp: TensorParallel = SINGLE,
    cache_dir: str = "",
    arena_record: Path | None = None,
) -> Decoder:
    """Allocate the decoder (this rank's slice) without random init, stream the checkpoint into it tensor by tensor,
    then give its linear layers their CPU form: quantized, or reordered once for oneDNN.

    quantization auto: on CPU, a GGUF's 4- and 8-bit matrices become int4 / int8 layers as they are read (their own
    values, no float copy of the model); float tensors, and everything on CUDA, stay in `dtype`. Quantized layers run
    on our grouped kernel, built into `cache_dir` on first use, where a compiler is found (group_kernels.py).
    `arena_record`: where the weights' arena size is kept for the next start (arena.reserve)."""
    if quantization not in ("auto", "none") and device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only; on {device.type} use --dtype bfloat16")
    if device.type == "cpu" and quantization != "none":
        group_kernels.load(cache_dir)
    decoder = Decoder.allocate(config, max_positions, dtype, device, tp)
    own_quantized = quantization == "auto" and device.type == "cpu"
    decoder.load_weights(
        read_weights(path, config, keep_quantized=own_quantized),
        on_quantized=lambda name, weight: install_quantized(decoder, name, weight, dtype),
    )
    if quantization in ("int8", "int4"):
        quantize(decoder, quantization)
    elif prepack_weights and onednn_usable(device, dtype):
        pack_linears(decoder, keep_weights)  # the linears still dense
    if device.type == "cpu":
        pack_weights(decoder, arena_record)
    return decoder.eval()


def tensor_parallel_settings(settings: Settings, tp: TensorParallel) -> Settings:
    """A rank of a group of more than one: dense linears (int4/int8 groups are not cut along the slices' boundaries),
    float32 on CPU under --dtype auto (the exact reference), and eager steps (no torch.compile, no CUDA graphs: the
    collectives and the per-step broadcast are not in those graphs yet)."""
    if tp.world_size == 1:
        return settings
    update: dict[str, str | bool] = {"torch_compile": False, "enforce_eager": True}
    if settings.quantization in ("int8", "int4"):
        log.warning("--tensor-parallel-size %d: --quantization %s ignored, dense linears", tp.world_size,
                    settings.quantization)  # fmt: skip
    update["quantization"] = "none"
    if settings.dtype == "auto" and resolve_device(settings.device).type == "cpu":
        update["dtype"] = "float32"
    settings = settings.model_copy(update=update)
    log.info("tensor-parallel rank %d of %d: dense linears, --dtype %s, eager steps", tp.rank, tp.world_size,
             settings.dtype)  # fmt: skip
    return settings


def own_code(method: Callable[[Batch], torch.Tensor]) -> Callable[[Batch], torch.Tensor]:
    """The bound method with a code object of its own. Dynamo keeps compiled graphs per code object, and with the
    module guards skipped (below) a graph compiled by another runner in this process (another model, another KV
    pool) would match this runner's calls, and be invalidated when that runner is freed."""
    fn = method.__func__  # type: ignore[attr-defined]
    code = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


def release_free_memory() -> None:
    """Hand the heap that loading (or compiling) freed back to the OS: glibc keeps freed memory mapped in its
    arenas, where it counts as resident until reused."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU it is anonymous memory from mmap: the kernel's zero pages, resident only once written,
    so an idle server holds none of a KV pool it has not used (torch.zeros writes, and so keeps, every page)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    # torch.frombuffer keeps the mapping alive as long as the tensor
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, settings: Settings, eos_token_ids: list[int], tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's place in a tensor-parallel group (its process group joined before the first step)."""
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.tp = tp
        settings = tensor_parallel_settings(settings, tp)
        self.device = resolve_device(settings.device)
        if self.device.type == "cuda" and tp.world_size > 1:
            self.device = torch.device("cuda", tp.local_rank)  # one GPU per rank
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.config = load_config(settings.model_path)
        self.max_model_len = settings.max_model_len or self.config.max_position_embeddings
        self.block_size = settings.block_size
        self.eos_token_ids = sorted(
            set(eos_token_ids) | set(self.config.eos_token_ids)
        )  # the tokenizer's and the checkpoint's
        started = time.perf_counter()
        self.decoder = build_decoder(
            settings.model_path,
            self.config,
            self.max_model_len,
            self.dtype,
            self.device,
            settings.quantization,
            settings.prepack_weights,
            keep_weights=settings.torch_compile,
            tp=tp,
            cache_dir=settings.cache_dir,
            arena_record=record_path(settings) if tp.world_size == 1 else None,
        )
        self.load_seconds = time.perf_counter() - started
        release_free_memory()
        self.sampler = Sampler()
        self.num_blocks = self._allocate_kv_cache(settings)
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not settings.enforce_eager:
            if self.attention_backend == "torch-sdpa":
                log.warning("CUDA graphs off: the torch attention path cannot be captured (install triton)")
            else:
                # the pool's extra block, past those the BlockManager hands out, takes the padding rows' K/V
                self.decode_graphs = DecodeGraphs(
                    self.decoder,
                    settings.max_num_seqs,
                    self.max_model_len,
                    self.block_size,
                    self.num_blocks,
                    self.device,
                )
                self.decode_graphs.capture()
        self.compiled_forward: Callable[[Batch], torch.Tensor] | None = None
        self.compiled_one_row: Callable[[Batch], torch.Tensor] | None = None
        self.compile_seconds = 0.0
        self.heartbeat_seconds = min(HEARTBEAT_SECONDS, settings.distributed_timeout / 3)
        self._last_broadcast = time.monotonic()
        self.compile_error: str | None = None
        self._compiled_ready: tuple[Callable[[Batch], torch.Tensor], Callable[[Batch], torch.Tensor]] | None = None
        self._compile_done = threading.Event()
        self._compile_started = False
        self._compile_wanted = settings.torch_compile and self.device.type == "cpu"
        if self._compile_wanted and not c_compiler_found():
            log.warning("decode step stays eager: torch.compile needs a C++ compiler (cc or gcc) on PATH")
            self._compile_wanted = False
        if self._compile_wanted and settings.cache_dir:
            # inductor's kernels survive restarts: a second start finds them and compiles in seconds
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(settings.cache_dir) / "inductor"))
        # AOTInductor, in a child process, wherever the decoder exports: its linears our kernel's or torch's own
        # (oneDNN's packed weights are opaque to a package, and keep torch.compile here)
        self._settings = settings
        self._aot_wanted = self._compile_wanted and not any(isinstance(m, PackedLinear) for m in self.decoder.modules())
        self._aot_path = aot_step.package_path(settings) if self._aot_wanted else None
        self.aot_step: aot_step.AotDecodeStep | None = None
        self._aot_ready: aot_step.AotDecodeStep | None = None
        if self._aot_wanted:
            self._load_aot_package()
        if not self._compile_wanted:
            self._compile_done.set()

    def _load_aot_package(self) -> bool:
        """Run decode steps from the package built for these settings, if one is there (a later start)."""
        path = self._aot_path
        if path is None or not path.exists():
            return False
        try:
            loaded = aot_step.AotDecodeStep(path, self.decoder)
        except Exception:  # noqa: BLE001 - a stale or broken package: built again in the background
            log.exception("decode-step package %s unusable; building it again", path)
            shutil.rmtree(path.parent, ignore_errors=True)
            return False
        if self._compile_started:
            self._aot_ready = loaded
        else:  # at start, before any step: compiled from the first one
            self.aot_step = loaded
            self._compile_wanted = False
            log.info("decode steps run compiled, from %s", path)
        return True

    def start_compile(self) -> None:
        """Begin compiling the decode step in a background thread (once). The engine calls it when it first idles,
        so that the first answers do not share the CPUs and the GIL with the compiler."""
        if self._compile_wanted and not self._compile_started:
            self._compile_started = True
            threading.Thread(target=self._compile_in_background, name="llmserve-compile", daemon=True).start()

    def _compile_in_background(self) -> None:
        with contextlib.suppress(OSError):  # Linux: this thread (and the compiler processes it starts) yields the CPUs
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + 10))
        try:
            if self._aot_wanted:
                self._build_aot_package()
            else:
                with compiling_here():
                    self._compile()
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager step, which is correct
            self.compile_error = repr(exc)
            log.exception("decode step stays eager: compiling it failed")
        finally:
            self._compile_done.set()

    def _build_aot_package(self) -> None:
        started = time.perf_counter()
        assert self._aot_path is not None
        built, output = aot_step.build_in_child(self._settings, self._aot_path)
        if not built or not self._load_aot_package():
            raise RuntimeError(f"building the decode-step package failed:\n{output}")
        self.compile_seconds = time.perf_counter() - started
        log.info("decode step compiled ahead of time in %.1fs; it takes over when no request is running",
                 self.compile_seconds)  # fmt: skip

    @property
    def decode_step_state(self) -> str:
        """compiling (eager steps serve meanwhile), compiled, or eager (not asked for, unavailable or failed)."""
        ready = (self.aot_step, self._aot_ready, self.compiled_forward, self._compiled_ready)
        if any(r is not None for r in ready):
            return "compiled"
        return "eager" if self._compile_done.is_set() else "compiling"

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Start the background compile if it has not started, and block until it has ended (compiled or failed);
        True when it has."""
        self.start_compile()
        return self._compile_done.wait(timeout)

    def activate_compiled(self) -> bool:
        """Switch decode steps to the compiled graphs once they are ready. The engine calls it between steps when no
        sequence is running, so no request changes kernels halfway. True when this call switched."""
        aot, self._aot_ready = self._aot_ready, None
        if aot is not None:
            self.aot_step = aot
            log.info("decode steps now run compiled ahead of time (built in %.1fs)", self.compile_seconds)
            return True
        ready, self._compiled_ready = self._compiled_ready, None
        if ready is None:
            return False
        self.compiled_one_row, self.compiled_forward = ready
        log.info("decode steps now run compiled (compiled in %.1fs)", self.compile_seconds)
        return True

    def _compile(self) -> None:
        """Compile the decode-only forward and trace it, in a thread of its own while eager steps serve. Steps with
        prompt tokens stay eager: they are bound by the matmuls, where the compiler saves nothing."""
        started = time.perf_counter()
        scratch = self.num_blocks  # the pool's extra block, which the BlockManager never hands out

        def decode_rows(n: int, blocks: int = 1) -> list[ScheduledSeq]:
            # sequences whose last token is new and whose whole context lies in the scratch block
            length = (blocks - 1) * self.block_size + 2
            seqs = [Sequence(f"warmup-{i}", [0] * length, SamplingParams(max_tokens=1)) for i in range(n)]
            for seq in seqs:
                seq.block_table, seq.num_computed_tokens = [scratch] * blocks, length - 1
            return [ScheduledSeq(seq, 1) for seq in seqs]

        # an eager step first builds what layers build lazily (the rotary tables), so the graph is not traced
        # through that branch
        self.run(decode_rows(1), [None])
        # One stream gets a graph of its own, LM head included, whose linears are GEMV loops (one_row_linear) and
        # whose attention reads the block table in its loops; only the number of blocks varies.
        # no guards on the modules: their weights and settings never change once loaded, and checking ~2,000
        # attributes before every step took 2.3 of a 23 ms one-stream step here
        options: dict[str, str | int | bool | Callable[..., object]] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe
        }
        compiled_one_row = torch.compile(own_code(self._one_row_logits), dynamic=False, options=options)
        compiled_forward = torch.compile(own_code(self._forward), dynamic=True, options=options)
        with torch.inference_mode():
            batch = self.prepare(decode_rows(1, blocks=2))
            # the number of blocks as an unbacked size: a backed one would be specialized at 1, and guarded to a
            # range by inductor's reductions
            torch._dynamo.decorators.mark_unbacked(batch.block_tables, 1)
            compiled_one_row(batch)
            batch = self.prepare(decode_rows(2))
            # the row count and the number of blocks as unbacked sizes: one graph serves every batch of two or more
            for rows in (
                batch.input_ids,
                batch.positions,
                batch.logits_indices,
                batch.slot_mapping,
                batch.block_tables,
            ):
                torch._dynamo.decorators.mark_unbacked(rows, 0)
            torch._dynamo.decorators.mark_unbacked(batch.block_tables, 1)
            compiled_forward(batch)
        self.compile_seconds = time.perf_counter() - started
        self._compiled_ready = (compiled_one_row, compiled_forward)
        release_free_memory()
        log.info("decode step compiled in %.1fs; it takes over when no request is running", self.compile_seconds)

    def _one_row_logits(self, batch: Batch) -> torch.Tensor:
        return self.decoder.compute_logits(self.decoder(batch))

    def _forward(self, batch: Batch) -> torch.Tensor:
        return self.decoder(batch)

    def _allocate_kv_cache(self, settings: Settings) -> int:
        c = self.config
        # this rank's KV heads; blocks counted for the rank with the most, so that every rank has the same number
        heads = head_shard(c.num_heads, c.num_kv_heads, self.tp.world_size, self.tp.rank)
        use_cpu_kernel = self.device.type == "cpu" and group_kernels.load(settings.cache_dir)
        self.kv_dtype = self._kv_cache_dtype(settings.kv_cache_dtype, use_cpu_kernel)
        per_block = 2 * c.num_layers * self.block_size * heads.max_kv * c.head_dim * self.kv_dtype.itemsize
        budget = settings.kv_cache_memory
        if budget == 0 and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * settings.gpu_memory_utilization)
        num_blocks = max(1, budget // per_block)
        # one more block than the BlockManager gets: scratch space for the dummy rows of a CUDA graph's padding
        shape = (num_blocks + 1, self.block_size, heads.kv.size, c.head_dim)  # flash-attn's paged layout
        # flash-attn's paged kernel takes pages of a multiple of 256 tokens and 16-bit inputs
        use_flash = flash_attn_usable(self.device) and self.dtype != torch.float32 and self.block_size % 256 == 0
        if flash_attn_usable(self.device) and not use_flash:
            log.warning("flash-attn unused: it needs --block-size a multiple of 256 and a 16-bit --dtype")
        # our Triton kernel takes any block size and dtype: the CUDA default when flash-attn cannot run
        use_triton = not use_flash and triton_usable(self.device)
        for attn in self.decoder.attention_layers():
            attn.k_cache = zeroed(shape, self.kv_dtype, self.device)
            attn.v_cache = zeroed(shape, self.kv_dtype, self.device)
            attn.use_flash = use_flash
            attn.use_triton = use_triton
            attn.use_cpu_kernel = use_cpu_kernel
        log.info("attention backend: %s on %s", self.attention_backend, self.device)
        return num_blocks

    def _kv_cache_dtype(self, name: str, use_cpu_kernel: bool) -> torch.dtype:
        if name != "auto":
            dtype = DTYPES[name]
            if dtype != self.dtype and self.device.type != "cpu":
                raise ValueError(f"--kv-cache-dtype {name} differs from --dtype: that runs on CPU only")
            return dtype
        quantized = any(isinstance(m, WeightOnlyLinear) for m in self.decoder.modules())
        if use_cpu_kernel and self.dtype == torch.float32 and quantized:
            # the quantized path is not the float32 reference already; a float16 cache (llama.cpp's default) halves
            # the pool's memory and what our decode attention reads each step (torch's SDPA path, where our kernel
            # is not built, would convert its gathered copy back every step)
            return torch.float16
        return self.dtype

    @property
    def attention_backend(self) -> str:
        attn = self.decoder.attention_layers()[0]
        if attn.use_cpu_kernel:
            return "cpu-paged-decode"
        return "flash-attn" if attn.use_flash else "triton" if attn.use_triton else "torch-sdpa"

    def prepare(self, scheduled: list[ScheduledSeq]) -> Batch:
        return self._batch(self._step_inputs(scheduled))

    def _step_inputs(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            input_ids.extend(seq.token_ids[start : end - s.num_spec])
            input_ids.extend(seq.spec_token_ids[: s.num_spec])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(s.num_tokens)
            context_lens.append(end)
            if s.samples:  # a row with proposals needs logits at the last real token and at each proposal
                logits_indices.extend(range(len(input_ids) - 1 - s.num_spec, len(input_ids)))
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [-1] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        return StepInputs(input_ids, positions, slots, query_lens, context_lens, logits_indices, tables)

    def _batch(self, inputs: StepInputs) -> Batch:
        query_lens, context_lens, tables, bs = inputs.query_lens, inputs.context_lens, inputs.tables, self.block_size
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1:
            num_decode += 1

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        batch = Batch(
            input_ids=tensor(inputs.input_ids, torch.int64),
            positions=tensor(inputs.positions, torch.int64),
            slot_mapping=tensor(inputs.slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            query_start_loc=tensor(cu, torch.int32),
            logits_indices=tensor(inputs.logits_indices, torch.int64),
            num_decode=num_decode,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )
        first = self.decoder.attention_layers()[0]
        # the block views of the torch path: host work and a copy that flash-attn, Triton and CUDA graphs never read
        if num_decode and not (first.use_flash or first.use_triton or first.use_cpu_kernel):
            nb = -(-max(context_lens[:num_decode]) // bs)
            batch.decode_blocks = nb
            batch.decode_block_ids = tensor([b for t in tables[:num_decode] for b in t[:nb]], torch.int64).clamp_(min=0)
            pos = torch.arange(nb * bs, device=self.device)
            batch.decode_mask = (pos < batch.context_lens[:num_decode, None])[:, None, None, :]
        return batch

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], generators: list[torch.Generator | None]) -> StepSample | None:
        """One forward over all scheduled tokens; for each row that reached its end, the tokens it produced: one,
        or, for a row with proposals, the proposals the target agrees with and the target's next token."""
        inputs = self._step_inputs(scheduled)
        self._send(inputs)  # the other ranks run the same forward, joining its all-reduces
        batch = self._batch(inputs)
        rows = [s for s in scheduled if s.samples]
        graph_logits = self.decode_graphs.run(batch) if self.decode_graphs is not None and rows else None
        if graph_logits is not None:
            logits = graph_logits
        elif self.aot_step is not None and batch.num_decode == batch.num_seqs == len(rows):
            logits = self.aot_step(batch)
        elif self.compiled_one_row is not None and batch.num_seqs == batch.num_decode == 1:
            logits = self.compiled_one_row(batch)
        else:
            if self.compiled_forward is not None and batch.num_decode == batch.num_seqs:
                hidden = self.compiled_forward(batch)
            else:
                hidden = self.decoder(batch)
            if not rows:
                return None
            logits = self.decoder.compute_logits(hidden)
        # one sampling row per logits row: a row with proposals expands to one per position, each seeing the
        # proposals before it as its output so far (penalties, min_tokens, grammar state)
        seqs: list[Sequence] = []
        outputs: list[list[int]] = []
        row_generators: list[torch.Generator | None] = []
        for s, generator in zip(rows, generators, strict=True):
            out = s.seq.output_token_ids
            for i in range(s.num_spec + 1):
                seqs.append(s.seq)
                outputs.append(out + s.seq.spec_token_ids[:i])
                row_generators.append(generator)
        # a seeded row draws one number per position: remember where its generator stood, so that it can be
        # rewound to one draw per token actually output, as without speculation
        saved = {id(g): g.get_state() for s, g in zip(rows, generators, strict=True) if g is not None and s.num_spec}
        sampling = SamplingBatch.build(
            [seq.params for seq in seqs],
            [seq.prompt_token_ids for seq in seqs],
            outputs,
            row_generators,
            self.eos_token_ids,
            self.config.vocab_size,
            self.device,
        )
        if any(seq.matcher is not None for seq in seqs):
            sampling.token_bitmask = self._grammar_bitmask(rows)
        result = self.sampler(logits, sampling)
        sampled = result.token_ids.tolist()
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprob]] | None = [] if result.logprobs is not None else None
        at = 0
        for s, generator in zip(rows, generators, strict=True):
            proposals = s.seq.spec_token_ids[: s.num_spec]
            accepted = 0
            while accepted < len(proposals) and sampled[at + accepted] == proposals[accepted]:
                accepted += 1
            tokens.append(sampled[at : at + accepted + 1])
            if logprobs is not None and result.logprobs is not None:
                logprobs.append([lp for lp in result.logprobs[at : at + accepted + 1] if lp is not None])
            if generator is not None and s.num_spec:
                generator.set_state(saved[id(generator)])
                for _ in range(accepted + 1):
                    torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
            at += len(proposals) + 1
        return StepSample(tokens, logprobs)

    # ---- tensor parallelism ----------------------------------------------------------------------------------
    def _send(self, message: StepInputs | WorkerCommand) -> None:
        if self.tp.world_size > 1:
            self.tp.broadcast_object(message)
            self._last_broadcast = time.monotonic()

    def keepalive(self) -> None:
        """Rank 0, idle: a heartbeat when none has gone out for a while. The other ranks wait for the next step
        inside a collective, which would otherwise time out on an idle server; and a rank that died or hangs is
        noticed here (the broadcast raises) rather than at the next request."""
        if self.tp.world_size > 1 and time.monotonic() - self._last_broadcast > self.heartbeat_seconds:
            self._send(WorkerCommand.HEARTBEAT)

    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks' follow() loops to return."""
        self._send(WorkerCommand.STOP)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks other than 0: run every step rank 0 sends (the forward, the all-reduces, this rank's share of the
        logits) until it sends STOP. Raises when rank 0 is gone or silent past --distributed-timeout."""
        while True:
            message = self.tp.broadcast_object(None)
            if message is WorkerCommand.STOP:
                return
            if isinstance(message, StepInputs):
                hidden = self.decoder(self._batch(message))
                if message.logits_indices:
                    self.decoder.compute_logits(hidden)  # the gather to rank 0 needs every rank's slice

    def _grammar_bitmask(self, rows: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Allowed tokens of every sampling row of a constrained sequence; a row with proposals walks its matcher
        through them (and back) to get each position's mask."""
        num_rows = sum(s.num_spec + 1 for s in rows)
        import xgrammar  # only once a constrained request runs (see structured_output.py)

        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.config.vocab_size)  # all allowed
        constrained: list[int] = []
        at = 0
        for s in rows:
            matcher = s.seq.matcher
            if matcher is not None:
                walked = 0
                for i in range(s.num_spec + 1):
                    matcher.fill_next_token_bitmask(bitmask, at + i)
                    constrained.append(at + i)
                    if i == s.num_spec or not matcher.accept_token(s.seq.spec_token_ids[i]):
                        break  # later positions cannot be accepted anyway: the proposal breaks the grammar here
                    walked += 1
                    if matcher.is_terminated():
                        break
                if walked:
                    matcher.rollback(walked)
            at += s.num_spec + 1
        return bitmask.to(self.device, non_blocking=True), constrained
