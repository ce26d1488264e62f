"""The multi-node start-up, on one machine: two torchrun agents (`--nnodes 2`, one rank each, static rendezvous on
127.0.0.1) run `python -m server serve --tensor-parallel-size 2`, as docker-compose.yml's multinode profile does.
Rank 0 serves HTTP, rank 1 follows it (server/__main__.py); greedy text equals one rank's; SIGTERM to rank 0's agent
stops both nodes (the agents' exit chatter on stderr is torchrun's)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from config import Settings
from model.engine.engine import Engine
from model.engine.sequence import SamplingParams
from tests.engine.drive import run as drive
from tests.model.families import build_hf, make_tokenizer, save_hf

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 33, 8, 60, 12, 71, 44, 9]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_torchrun_nodes_serve_one_rank_s_greedy_text(tmp_path: Path) -> None:
    folder = save_hf(build_hf("llama3"), tmp_path / "llama3")
    tokenizer = make_tokenizer()
    tokenizer.hf.save_pretrained(folder)  # the server loads its tokenizer from the folder
    # gloo's all-reduce here (the other tests use shared memory): two real nodes would not share memory either
    limits = ["--kv-cache-memory", str(4 * 2**20), "--max-model-len", "256", "--cpu-all-reduce", "gloo"]
    master, http = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(master),
                "-m",
                "server",
                "serve",
                "--model",
                str(folder),
                "--tensor-parallel-size",
                "2",
                "--port",
                str(http),
                "--no-webui",
                *limits,
            ],
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        one_rank = Engine(Settings(model=str(folder), kv_cache_memory=4 * 2**20, max_model_len=256), tokenizer)
        reference = drive(one_rank, {"a": (PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))})
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 180
        while True:
            assert all(node.poll() is None for node in nodes), "a torchrun node exited before serving"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "rank 0 never became healthy"
            time.sleep(0.5)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == tokenizer.decode(reference["a"], skip_special_tokens=True)
        assert reply["usage"]["completion_tokens"] == 8

        # torchrun's agent passes SIGTERM to rank 0, which drains and sends STOP; rank 1 returns. The agents' own
        # exit status is torchrun's business (node 0's reports the signal, node 1's loses node 0's store): both exit
        nodes[0].send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=60)
    finally:
        for node in nodes:
            node.kill()
