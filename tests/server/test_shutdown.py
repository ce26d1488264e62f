"""SIGTERM on a real `llmserve serve` process: new requests get 503, the in-flight stream finishes to [DONE], and
the process exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.server.harness import MODEL, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_in_flight_streams_and_exits_0() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LLMSERVE_KV_CACHE_MEMORY": str(64 * 1024 * 1024)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--shutdown-timeout",
            "120",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(proc, url)

        started = threading.Event()
        result: dict[str, object] = {}

        def stream() -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 24,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    if '"content":"' in line and '"content":""' not in line:
                        started.set()
                result["lines"] = lines

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(120), "the stream never produced a token"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the signal is handled on the server's next tick

        refused = httpx.post(
            url + "/v1/chat/completions",
            timeout=10,
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health", timeout=10).status_code == 503

        reader.join(120)
        assert proc.wait(timeout=120) == 0
        lines = [line for line in result["lines"] if line.startswith("data: ")]  # type: ignore[union-attr]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
        assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) >= 10  # the stream ran to its end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
