"""The CPU decode step compiled ahead of time with AOTInductor, in a child process, and run through torch's C++
package loader: no dynamo, inductor or Python between ops in the serving process.

Why a child: torch.compile in the server left dynamo, inductor, sympy and their caches resident (~370 MiB of an idle
server's ~880) and ran a Python wrapper between the graph's kernels each step. The child loads the same checkpoint
with the same settings, exports one decode step (all rows sample; the row count and the number of KV blocks
dynamic), and writes a `.pt2` package keyed by everything that shapes it. The server loads the package (a few ms),
binds its own weights and KV pool to it as user-managed constants (held once), and calls it; a later start finds
the package and runs compiled from its first step.

    python -m model.engine.aot_step PACKAGE < SETTINGS_JSON    # what the ModelRunner starts
"""

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

from config import Settings
from model.batch import Batch
from model.layers.rotary import RotaryEmbedding

log = logging.getLogger("llmserve.aot_step")

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # prctl(2)
# settings that change the exported graph or its constants' shapes
KEY_FIELDS = ("dtype", "kv_cache_dtype", "quantization", "prepack_weights", "block_size", "kv_cache_memory",
              "max_model_len", "max_num_seqs", "device")  # fmt: skip


class DecodeStep(nn.Module):
    """Decode rows only, one new token each, every row sampling: ids, positions, KV slots [B], block tables
    [B, blocks] -> logits [B, V]."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        # the rotary tables are plain attributes (module.to() must not round them); as buffers here, the package
        # names them by their path, where the serving process finds its own (AotDecodeStep)
        for module in decoder.modules():
            table = vars(module).get("cos_sin")
            if isinstance(table, torch.Tensor):
                del module.cos_sin
                module.register_buffer("cos_sin", table, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        rows = input_ids.shape[0]
        batch = Batch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=positions,  # read by no traced path
            query_start_loc=positions,
            logits_indices=torch.arange(rows),
            num_decode=rows,
            max_query_len=1,
            max_context_len=1,
            query_lens_cpu=[],
            context_lens_cpu=[],
        )
        return self.decoder.compute_logits(self.decoder(batch))  # type: ignore[operator]


def package_path(settings: Settings) -> Path:
    """Where the package for these settings lives: a hash of the checkpoint (path, size, mtime), the settings that
    shape the graph, torch's version, the CPU's kernel build and our model code."""
    model = settings.model_path.resolve()
    stat = model.stat()
    digest = hashlib.sha256()
    digest.update(f"{model}|{stat.st_size}|{stat.st_mtime_ns}|{torch.__version__}".encode())
    digest.update(json.dumps({f: str(getattr(settings, f)) for f in KEY_FIELDS}, sort_keys=True).encode())
    from model.layers import group_kernels

    digest.update(group_kernels.build_dir(settings.cache_dir).name.encode())
    for source in sorted((ROOT / "model").rglob("*")):
        if source.suffix in (".py", ".cpp"):
            digest.update(source.read_bytes())
    return Path(settings.cache_dir).expanduser() / "aot" / digest.hexdigest()[:24] / "decode.pt2"


def export_package(decoder: nn.Module, num_blocks: int, block_size: int, max_rows: int, max_blocks: int,
                   path: Path) -> None:  # fmt: skip
    """Export the decode step of `decoder` (its rotary tables built by an eager step before) into `path`; every
    constant of the package is a parameter or buffer of the decoder (or a rotary table), bound at load."""
    import torch._inductor

    from model.layers.tracing import compiling_here

    step = DecodeStep(decoder)
    scratch = num_blocks  # the pool's extra block, which the BlockManager never hands out
    example = (
        torch.zeros(2, dtype=torch.int64),
        torch.full((2,), block_size + 1, dtype=torch.int64),
        torch.full((2,), scratch * block_size + 1, dtype=torch.int64),
        torch.full((2, 2), scratch, dtype=torch.int32),
    )
    rows = torch.export.Dim("rows", min=1, max=max(2, max_rows))
    blocks = torch.export.Dim("blocks", min=1, max=max(2, max_blocks))
    with compiling_here(), torch.no_grad():
        exported = torch.export.export(
            step, example, dynamic_shapes=({0: rows}, {0: rows}, {0: rows}, {0: rows, 1: blocks}), strict=False
        )
    torch._inductor.aoti_compile_and_package(
        exported, package_path=str(path), inductor_configs={"aot_inductor.package_constants_in_so": False}
    )


def build_in_child(settings: Settings, path: Path) -> tuple[bool, str]:
    """Run export_package in a child process at low priority; (done, the tail of its log)."""
    # built in a folder of its own, renamed into place when whole: another server may be building the same
    building = path.parent.with_name(f"{path.parent.name}.building-{os.getpid()}")
    _remove_abandoned_builds(path.parent)
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    log_file = building / "build.log"
    command = [sys.executable, "-m", "model.engine.aot_step", str(building / path.name)]
    with log_file.open("wb") as out:  # the settings on stdin: they may hold --api-key, which ps would show
        code = subprocess.run(command, cwd=ROOT, input=settings.model_dump_json().encode(), stdout=out,
                              stderr=subprocess.STDOUT, preexec_fn=_child_setup).returncode  # fmt: skip
    tail = log_file.read_text(errors="replace")[-2000:]
    if code == 0 and (building / path.name).exists():
        with contextlib.suppress(OSError):  # one already there (another server's) is as good
            os.replace(building, path.parent)
    shutil.rmtree(building, ignore_errors=True)
    return path.exists(), tail


def _child_setup() -> None:
    os.nice(10)  # the child (and the compilers it starts) yields the CPUs to serving
    # and dies with the server: a stopped server left its build running on, holding ~600 MiB and a CPU
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the server died before the line above
        os._exit(1)


def _remove_abandoned_builds(package_dir: Path) -> None:
    """Folders of builds whose server died (killed before it could clean up)."""
    for folder in package_dir.parent.glob(f"{package_dir.name}.building-*"):
        pid = folder.name.rpartition("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


class AotDecodeStep:
    """A loaded package with this process's weights, rotary tables and KV pool bound to it (not copied)."""

    def __init__(self, path: Path, decoder: nn.Module) -> None:
        # through our ops where the kernel library has them: their calls release the GIL (aot_package.cpp)
        self._ops = getattr(torch.ops.llmserve_kernels, "aot_package_run", None) is not None
        if self._ops:
            self._handle = torch.ops.llmserve_kernels.aot_package_load(str(path))
            weakref.finalize(self, torch.ops.llmserve_kernels.aot_package_release, self._handle)
            wanted = torch.ops.llmserve_kernels.aot_package_constant_names(self._handle)
        else:
            self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            wanted = self.loader.get_constant_fqns()
        for module in decoder.modules():  # the rotary tables, built lazily by eager steps
            if isinstance(module, RotaryEmbedding) and module.cos_sin.numel() == 0:
                module.build_cache()
        tensors: dict[str, torch.Tensor] = {
            f"decoder.{n}": t for n, t in decoder.named_parameters(remove_duplicate=False)
        }
        tensors.update({f"decoder.{n}": t for n, t in decoder.named_buffers(remove_duplicate=False)})
        for name in wanted:  # the rotary tables, buffers of the exported decoder only
            owner, _, attr = name.removeprefix("decoder.").rpartition(".")
            if name not in tensors and isinstance(value := getattr(decoder.get_submodule(owner), attr, None),
                                                  torch.Tensor):  # fmt: skip
                tensors[name] = value
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise RuntimeError(f"the decode-step package wants constants this decoder lacks: {missing[:4]}")
        if self._ops:
            torch.ops.llmserve_kernels.aot_package_bind(self._handle, wanted, [tensors[n] for n in wanted])
        else:
            self.loader.load_constants({n: tensors[n] for n in wanted}, False, True, True)

    def __call__(self, batch: Batch) -> torch.Tensor:
        inputs = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables]
        if self._ops:
            return torch.ops.llmserve_kernels.aot_package_run(self._handle, inputs)[0]
        return self.loader.run(inputs)[0]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from model.engine.model_runner import ModelRunner
    from model.engine.scheduler import ScheduledSeq
    from model.engine.sequence import SamplingParams, Sequence

    settings = Settings.model_validate_json(sys.stdin.read()).model_copy(update={"torch_compile": False})
    runner = ModelRunner(settings, [])
    bs, scratch = runner.block_size, runner.num_blocks
    seq = Sequence("export", [0, 0], SamplingParams(max_tokens=1))
    seq.block_table, seq.num_computed_tokens = [scratch], 1
    runner.run([ScheduledSeq(seq, 1)], [None])  # an eager step builds the rotary tables
    max_blocks = -(-runner.max_model_len // bs) + 1
    export_package(runner.decoder, scratch, bs, settings.max_num_seqs, max_blocks, Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
