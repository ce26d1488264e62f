"""The ranks of a tensor-parallel server: how they start, join, fail and stop.

One node: rank 0 (the server process) starts ranks 1..N-1 as child processes of `python -m model.engine.workers`,
with torchrun's environment variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and its Settings as
JSON on stdin. Under torchrun (RANK and WORLD_SIZE already set; one node or several) every rank runs `llmserve serve`:
rank 0 serves HTTP and the others call run_worker(). Either way each rank first loads its own slice of the model,
then joins the process group (gloo on CPU, NCCL on CUDA), then the other ranks follow rank 0's steps
(ModelRunner.follow) until it sends STOP.

Failures are loud, never a hang: a watchdog thread polls rank 0's children every 0.2 s and check() (called by the
engine loop between steps) raises once one has exited; a collective that broke because a rank died is explained
by explain(); a rank that hangs makes the next collective raise after --distributed-timeout; an idle rank 0 sends
heartbeats (ModelRunner.keepalive), so the others never wait that long for a step, and a lost rank 0 makes them exit.
"""

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from config import Settings
from model.device import resolve_device
from model.engine.model_runner import ModelRunner
from model.parallel import TensorParallel

log = logging.getLogger("llmserve.workers")

WATCH_SECONDS = 0.2  # how often rank 0 polls its children
ROOT = Path(__file__).resolve().parents[2]  # the folder holding config/ and model/: the children import from it


class WorkerFailedError(RuntimeError):
    pass


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or rank 0 of a single-node server) started it; None otherwise."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


class WorkerGroup:
    """This process's membership of the group: rank 0 owns the child processes (single node) and watches them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failure: str | None = None  # set by the watchdog when a child exits
        self._closing = False
        world_size = settings.tensor_parallel_size
        rank = torchrun_rank()
        if rank is not None:  # torchrun's (or our parent's) environment names this rank and the rendezvous
            if int(os.environ["WORLD_SIZE"]) != world_size:
                raise ValueError(
                    f"WORLD_SIZE={os.environ['WORLD_SIZE']} from torchrun, but --tensor-parallel-size {world_size}"
                )
            self.init_method = "env://"
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            rank, local_rank = 0, 0
            port = _free_port()
            self.init_method = f"tcp://127.0.0.1:{port}"
            self._spawn(port)
        self.tp = TensorParallel(rank, world_size, local_rank)
        if self.procs:
            self.tp.failure_check = lambda: self.failure  # a child's exit, seen by the watchdog
        self.backend = "nccl" if resolve_device(settings.device).type == "cuda" else "gloo"

    def _spawn(self, port: int) -> None:
        world_size = self.settings.tensor_parallel_size
        payload = self.settings.model_dump_json().encode()
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        for rank in range(1, world_size):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                   "PYTHONPATH": pythonpath}  # fmt: skip
            proc = subprocess.Popen(
                [sys.executable, "-m", "model.engine.workers"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            assert proc.stdin is not None
            proc.stdin.write(payload)  # on stdin rather than argv: the settings may hold --api-key
            proc.stdin.close()
            self.procs.append(proc)
            log.info("started tensor-parallel rank %d (pid %d)", rank, proc.pid)
        threading.Thread(target=self._watch, name="llmserve-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._closing and self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) {_describe_exit(code)}"
                    log.error("%s", self.failure)
                    break
            time.sleep(WATCH_SECONDS)

    def _wait_until_loaded(self) -> None:
        """Each child writes a line to its stdout once its slice is loaded. Waiting for that first keeps the slow
        part of start-up (a big model's load) out of the rendezvous, which --distributed-timeout bounds."""
        pending = {proc.stdout: rank for rank, proc in enumerate(self.procs, start=1) if proc.stdout is not None}
        while pending:
            if self.failure is not None:
                raise WorkerFailedError(f"{self.failure} while loading the model (its log is above)")
            readable, _, _ = select.select(list(pending), [], [], WATCH_SECONDS)
            for pipe in readable:
                if pipe.readline().strip() == b"loaded":
                    del pending[pipe]
                else:  # end of file: the child is exiting; the watchdog says how
                    time.sleep(2 * WATCH_SECONDS)
                    if self.failure is None:
                        self.failure = f"tensor-parallel rank {pending[pipe]} closed its pipe while loading"

    def connect(self) -> None:
        """Join the process group; blocks until every rank has loaded its slice and joined. Rank 0 keeps watching
        its children meanwhile: one that fails to load stops start-up at once, not after the timeout."""
        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(self.tp.local_rank)
        self._wait_until_loaded()
        timeout = self.settings.distributed_timeout
        errors: list[BaseException] = []

        def join() -> None:
            try:
                self.tp.init_process_group(
                    self.init_method, self.backend, timeout, self.settings.cpu_all_reduce == "shm"
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)

        joiner = threading.Thread(target=join, name="llmserve-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(WATCH_SECONDS)
            if self.failure is not None:
                raise WorkerFailedError(f"{self.failure} while starting (its log is above)")
        if errors:
            raise errors[0]
        log.info("rank %d joined the %s group of %d ranks (all-reduce: %s)", self.tp.rank, self.backend,
                 self.tp.world_size, self.tp.all_reduce_backend)  # fmt: skip

    def check(self) -> None:
        """Raise WorkerFailedError once the watchdog has seen a child exit."""
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    def explain(self, exc: BaseException) -> str:
        """The reason a step failed, in words: the rank that died, if one did; else the collective's error."""
        if isinstance(exc, WorkerFailedError):
            return str(exc)
        deadline = time.monotonic() + 10 * WATCH_SECONDS  # a dead peer breaks the collective before the next poll
        while self.failure is None and self.procs and time.monotonic() < deadline:
            time.sleep(WATCH_SECONDS / 4)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if self.failure is not None:
            return f"{self.failure}; the step failed ({detail})"
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            return (
                f"a collective between the {self.tp.world_size} tensor-parallel ranks waited past "
                f"--distributed-timeout ({self.settings.distributed_timeout:g} s): a rank hangs or is gone ({detail})"
            )
        if "connection" in text:  # under torchrun the other ranks are not our children: gloo names the peer address
            return f"a tensor-parallel rank closed its connection: it died or was stopped; see its log ({detail})"
        return f"tensor-parallel step failed: {type(exc).__name__}: {detail}"

    def shutdown(self, runner: ModelRunner | None) -> None:
        """Stop the other ranks: STOP through `runner` when the group is healthy, else (or if they linger) kill."""
        self._closing = True
        if runner is not None and self.failure is None:
            try:
                runner.stop_workers()
            except Exception as exc:  # noqa: BLE001 - a broken group: the children are killed below
                log.warning("could not tell the other ranks to stop (%s)", exc)
        for proc in self.procs:
            try:
                proc.wait(timeout=10 if runner is not None and self.failure is None else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(settings: Settings, announce: bool = False) -> int:
    """A rank other than 0: load this rank's slice, join the group, follow rank 0's steps until STOP. `announce`:
    tell a parent rank 0 on stdout when the slice is loaded (WorkerGroup._wait_until_loaded)."""
    group = WorkerGroup(settings)
    rank = group.tp.rank
    if announce:  # our parent is rank 0: its end is ours
        parent = os.getppid()
        group.tp.failure_check = lambda: "rank 0 exited" if os.getppid() != parent else None
    runner = ModelRunner(settings, [], group.tp)
    if announce:
        sys.stdout.write("loaded\n")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads the pipe any more: a full one would block
    group.connect()
    try:
        runner.follow()
    except Exception as exc:  # noqa: BLE001 - any failure of a collective means the same here
        log.error("rank %d: stopping, rank 0 is gone or silent: %s", rank, str(exc).strip().splitlines()[0])
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("rank %d: stopped", rank)
    return 0


def main() -> int:
    """`python -m model.engine.workers`, as rank 0 starts its children: Settings as JSON on stdin."""
    settings = Settings(**json.loads(sys.stdin.read()))
    # Ctrl+C in a terminal reaches the whole process group: rank 0 drains its requests, which needs this rank
    # until rank 0 sends STOP (or is gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_worker(settings, announce=True)


if __name__ == "__main__":
    sys.exit(main())
