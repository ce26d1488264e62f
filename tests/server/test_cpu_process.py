"""A real `llmserve serve` process on CPU leaves Triton unloaded (it has no CPU kernels; its library alone kept
70 MiB resident) and still compiles its decode step: ahead of time, in a child process, into a package that the
server maps; a second start with the same cache finds the package and runs compiled from its first step."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import MODEL, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed: nothing to leave out")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_cpu_server_compiles_its_decode_step_without_loading_triton(tmp_path: Path) -> None:
    # the server's own defaults (the test session's LLMSERVE_* turn compiling and quantization off), an empty cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_") and k != "TRITON_INTERPRET"}
    env["LLMSERVE_KV_CACHE_MEMORY"] = str(64 * 1024 * 1024)
    env["LLMSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "server", "serve", "--device", "cpu", "--max-model-len", "1024"]
    command += ["--log-level", "warning"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

    def start() -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = subprocess.Popen(command + ["--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)  # fmt: skip
        return proc, f"http://127.0.0.1:{port}"

    proc, url = start()
    try:
        wait_healthy(proc, url)
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1

        deadline = time.monotonic() + 600  # the grouped kernel and the package from nothing: ~2 min on 2 cores
        state = ""
        while state != "compiled":
            state = httpx.get(url + "/health", timeout=5).json()["decode_step"]
            assert state == "compiling" or state == "compiled", f"decode step {state}: the compile failed or is off"
            assert time.monotonic() < deadline, f"decode step still {state}"
            time.sleep(1)
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        maps = _mapped_libraries(proc.pid)
        assert "libtorch_cpu" in maps, "the mappings are the server's"
        assert "libtriton" not in maps
        assert "wrapper.so" in maps, "the decode step runs from the package's library"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    proc, url = start()
    try:
        wait_healthy(proc, url)
        assert httpx.get(url + "/health", timeout=5).json()["decode_step"] == "compiled"
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
