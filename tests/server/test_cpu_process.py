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


def _server_command() -> tuple[list[str], dict[str, str]]:
    """The server's own defaults (the test session's LLMSERVE_* turn compiling and quantization off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_") and k != "TRITON_INTERPRET"}
    env["LLMSERVE_KV_CACHE_MEMORY"] = str(64 * 1024 * 1024)
    command = [sys.executable, "-m", "server", "serve", "--device", "cpu", "--max-model-len", "1024"]
    return command + ["--log-level", "warning"], env


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed: nothing to leave out")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_cpu_server_compiles_its_decode_step_without_loading_triton(tmp_path: Path) -> None:
    command, env = _server_command()
    env["LLMSERVE_CACHE_DIR"] = str(tmp_path / "cache")  # empty
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


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build process through /proc")
def test_a_killed_server_takes_its_decode_step_build_with_it(tmp_path: Path) -> None:
    """The package's build runs in a child process: a server killed mid-build must not leave it running (it held
    ~600 MiB and a CPU), and the next server removes the dead one's unfinished folder."""
    command, env = _server_command()
    env["LLMSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    aot = tmp_path / "cache" / "aot"

    def start_building() -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        proc = subprocess.Popen(command + ["--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while True:
            builders = [
                c for c in _children(proc.pid) if b"model.engine.aot_step" in Path(f"/proc/{c}/cmdline").read_bytes()
            ]
            if builders:
                return proc, builders[0]
            assert time.monotonic() < deadline, "no build process started"
            time.sleep(0.2)

    proc, builder = start_building()
    assert [f.name for f in aot.glob("*.building-*")] != []
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(builder):
        assert time.monotonic() < deadline, "the build outlived its server"
        time.sleep(0.2)
    abandoned = list(aot.glob(f"*.building-{proc.pid}"))
    assert abandoned, "the killed server's folder is there to remove"
    proc, builder = start_building()
    try:
        assert not any(folder.exists() for folder in abandoned)
    finally:
        proc.kill()
        proc.wait(timeout=30)
