"""Our CPU kernel for a checkpoint's own quantized groups (group_gemm.cpp), built once with the system C++ compiler
and kept in the cache directory; where it cannot be built (no compiler, no ninja, not x86 with AVX2) the layers use
torch's int4/int8 kernels instead, and say so once in the log.

`group_linear(x, q, scale, minimum, bits)`: x float32 or bfloat16 [M, K] -> [M, N] in x's dtype, with
W[n, k] = q * scale + minimum per group of 32 input columns; an op of its own
(`torch.ops.llmserve_kernels.group_linear`), so compiled graphs call it too. The build targets this CPU: AVX2,
AVX512-VNNI (two groups per pass) and AVX512-BF16 (prompt GEMMs in bfloat16) where /proc/cpuinfo lists them.

The library also holds paged_attention.cpp (the CPU decode attention) and aot_package.cpp (the ahead-of-time decode
step's package, run from ops that release the GIL)."""

import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger("llmserve.kernels")

SOURCE = Path(__file__).with_name("group_gemm.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("paged_attention.cpp"), Path(__file__).with_name("aot_package.cpp"))
GROUP = 32

_lock = threading.Lock()
_loaded: bool | None = None  # once tried: whether group_linear is usable


@functools.cache
def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_flags() -> list[str]:
    # OpenMP: at::parallel_for is inline code that runs serially without it; the library then binds to the
    # libgomp.so.1 torch has loaded, so both share one thread pool
    flags = ["-O3", "-std=c++17", "-fopenmp"]
    have = cpu_flags()
    if {"avx2", "fma"} <= have:
        flags += ["-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in have else [])
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= have:
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
            if "avx512_bf16" in have:
                flags += ["-mavx512bf16"]
    return flags


def instruction_set() -> str:
    flags = _build_flags()
    return "AVX512-VNNI" if "-mavx512vnni" in flags else "AVX2" if "-mavx2" in flags else "portable C++"


DEFAULT_ROOT = Path.home() / ".cache" / "llmserve"
LIBRARY = "llmserve_group_gemm"


def build_dir(cache_dir: str) -> Path:
    """One folder per source, flags and torch version, so a cache shared by machines or torch upgrades never loads
    a library built for another."""
    sources = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(sources + " ".join(_build_flags()).encode() + torch.__version__.encode())
    return (Path(cache_dir) if cache_dir else DEFAULT_ROOT) / "kernels" / key.hexdigest()[:16]


def load(cache_dir: str = "") -> bool:
    """Build (first time) or load the kernel; True when `group_linear` is usable. Thread-safe, once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded, why = _load(cache_dir)
            if _loaded:
                log.info(
                    "quantized linears: our grouped kernel, float32 sums (%s); batched decode on %s; prompts in %s",
                    instruction_set(),
                    "AMX's bfloat16 tiles"
                    if amx_takes(16)
                    else "the int16 path (int8 for 8-bit weights)"
                    if int8_rows()
                    else "the int16 path",
                    "bfloat16"
                    if bfloat16_prompts()
                    else f"int16 ({'vpdpwssd' if instruction_set() == 'AVX512-VNNI' else 'vpmaddwd'})"
                    if int16_rows()
                    else "float32",
                )
            else:
                log.warning("quantized linears: torch's int4/int8 kernels (bfloat16 scales): %s", why)
        return _loaded


def _load(cache_dir: str) -> tuple[bool, str]:
    if os.environ.get("LLMSERVE_GROUP_KERNEL", "1") == "0":
        return False, "LLMSERVE_GROUP_KERNEL=0"
    # built before: by `make install` (the default cache) or an earlier start with this --cache-dir; no compiler needed
    for directory in (build_dir(cache_dir), build_dir("")):
        built = directory / f"{LIBRARY}.so"
        if built.is_file():
            try:
                torch.ops.load_library(str(built))
                register_fake()
                return True, ""
            except (OSError, RuntimeError) as exc:
                log.warning("could not load %s (%r); building it again", built, exc)
    if not (shutil.which("c++") or shutil.which("g++")):
        return False, "no C++ compiler on PATH"
    try:
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            return False, "ninja is not installed"
        directory = build_dir(cache_dir)
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(source) for source in SOURCES],
            extra_cflags=_build_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        register_fake()
    except Exception as exc:  # noqa: BLE001 - a failed build leaves torch's kernels, which are correct
        return False, f"building {', '.join(s.name for s in SOURCES)} failed: {exc!r}"[:500]
    return True, ""


def group_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, bits: int
) -> torch.Tensor:
    return torch.ops.llmserve_kernels.group_linear(x, q, scale, minimum, bits)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each row attends to its sequence's keys 0..positions[row] (the last `window` of
    them), read through its block table row (int32) from a [blocks, block_size, KV heads, D] cache."""
    return torch.ops.llmserve_kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables, positions, scale, window or 0
    )


def fused_rows(bits: int = 4) -> int:
    """The most rows of x that take the fused path for `bits`-bit weights (more take dequantized tiles through
    torch's GEMM)."""
    return int(torch.ops.llmserve_kernels.fused_rows(bits))


def int8_rows() -> int:
    """The fewest rows (up to fused_rows(8)) whose activations the fused path rounds to int8 rather than int16 for
    8-bit weights; 0 where it never does (no AVX512-VNNI). 4-bit weights always take int16."""
    return int(torch.ops.llmserve_kernels.int8_rows())


def int8_max_rows() -> int:
    """The most float32 rows of 8-bit weights whose activations are rounded to int8: beyond fused_rows(8), up to this
    many multiply with AVX512-VNNI's vpdpbusd against weight tiles transposed per call; 0 where none do (no
    AVX512-VNNI, or AMX)."""
    return int(torch.ops.llmserve_kernels.int8_max_rows())


def amx_takes(rows: int) -> bool:
    """Whether that many rows multiply on AMX's bfloat16 tiles (x and the weights rounded to bfloat16), taking them
    from the int16 path or the tiled one: batched decode on a CPU with AMX."""
    return bool(torch.ops.llmserve_kernels.amx_takes(rows))


def bfloat16_prompts() -> bool:
    """Whether more than fused_rows() float32 rows multiply in bfloat16 (a CPU with AVX512-BF16)."""
    return bool(torch.ops.llmserve_kernels.bfloat16_prompts())


def int16_rows(bits: int = 4) -> int:
    """The most float32 rows beyond fused_rows(bits) that multiply as int16 per group with AVX512-VNNI's vpdpwssd or
    AVX2's vpmaddwd (the fused path's rounding) rather than as dequantized tiles through torch's GEMM: every count
    where prompts stay float32, batched decode only on an AMD CPU with AVX512-BF16; 0 where none do."""
    return int(torch.ops.llmserve_kernels.int16_rows(bits))


def register_fake() -> None:
    """Shapes for torch.compile's tracing of the op."""

    @torch.library.register_fake("llmserve_kernels::group_linear")
    def _(
        x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, bits: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], scale.shape[0])

    @torch.library.register_fake("llmserve_kernels::paged_decode_attention")
    def _(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        return torch.empty_like(q)


if __name__ == "__main__":  # `make install` builds the kernel ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load()
