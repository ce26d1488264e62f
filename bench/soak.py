"""Soak: N chat requests against one server, as an operator's traffic would come, with the server's resident memory
sampled every 5% of the run; at the end, the check that the running/waiting gauges and KV usage are back to idle.

    .venv/bin/python bench/soak.py --requests 10000                      # what `make soak` runs
    .venv/bin/python bench/soak.py --requests 1000 --max-tokens-range 8 32 --server-args "--num-threads 1"
    .venv/bin/python bench/soak.py --requests 800 --env MALLOC_ARENA_MAX=2  # an allocator setting, side by side
    .venv/bin/python bench/soak.py --requests 800 --inprocess --tracemalloc  # + Python-object and C-heap diffs

The mix (deterministic per request index): 16 closed-loop clients; prompts of 5-200 words, a few long ones up to
~2,000 tokens; 8-96 output tokens; temperature 0.7 with a seed; some requests with n=2, stop strings, logprobs or
not streamed; 30% of the streams dropped mid-answer; and bursts of short requests over the admission limit, whose
429s must carry Retry-After. A request "fails" when it is none of: completed, dropped on purpose, 429 with
Retry-After.

The server is spawned (`llmserve serve` via serve_bench.SpawnedServer; its VmRSS read from /proc) or, with
--inprocess, run in this process (tests/server/harness.py: uvicorn in a thread), so that tracemalloc snapshots
(diffed between 10% of the run and its end) and glibc's mallinfo2 (the C heap) are readable; the client then shares
the process, and its own memory is in the figures. --url soaks any running server (no RSS then)."""

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import random
import shlex
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import WORDS, SpawnedServer  # noqa: E402


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def c_heap() -> dict[str, float]:
    """This process's glibc heap (MiB): in use, free inside the arenas, mmapped chunks; and the number of arenas."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    out = {
        "heap_used": info.uordblks / 2**20,
        "heap_free": info.fordblks / 2**20,
        "mmapped": info.hblkhd / 2**20,
    }
    with contextlib.suppress(OSError, AttributeError):  # malloc_info's XML: one <heap nr=...> per arena
        libc.open_memstream.restype = ctypes.c_void_p
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        xml = ctypes.string_at(buf, size.value).decode()
        libc.free(buf)
        out["arenas"] = xml.count("<heap nr=")
    return out


@dataclass(slots=True)
class Outcome:
    kind: str  # completed, dropped, rejected (429 with Retry-After), failed
    detail: str = ""


@dataclass(slots=True)
class Sample:
    done: int
    seconds: float
    rss_mib: float
    heap: dict[str, float] = field(default_factory=dict)


def request_body(index: int, args: argparse.Namespace, model: str) -> tuple[dict[str, Any], int | None]:
    """The request for one index, and after how many content chunks the client drops it (None: reads it all)."""
    rng = random.Random(index)
    long = rng.random() < args.long_frac
    words = rng.randint(400, 1400) if long else rng.randint(*args.words_range)  # long: ~550-2,000 tokens
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    max_tokens = rng.randint(*args.max_tokens_range)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Note {index}: {text}\nContinue the note."}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": index,
        "stream": rng.random() >= args.unstreamed_frac,
    }
    if rng.random() < args.n2_frac:
        body["n"] = 2
    if rng.random() < args.stop_frac:
        body["stop"] = rng.choice([["."], [" the", "\n\n"], ["river"]])
    if rng.random() < args.logprobs_frac:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    drop_after = rng.randint(1, max(1, max_tokens - 1)) if body["stream"] and rng.random() < args.drop_frac else None
    return body, drop_after


async def one_request(http: httpx.AsyncClient, url: str, body: dict[str, Any], drop_after: int | None) -> Outcome:
    try:
        if not body["stream"]:
            response = await http.post(f"{url}/chat/completions", json=body)
            return _status_outcome(response) or Outcome("completed")
        async with http.stream("POST", f"{url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _status_outcome(response) or Outcome("failed", f"HTTP {response.status_code}")
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return Outcome("completed")
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome("failed", f"error event: {str(chunk['error'])[:200]}")
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return Outcome("dropped")  # leaving the `with` closes the connection mid-answer
            return Outcome("failed", "stream ended without [DONE]")
    except httpx.HTTPError as e:
        return Outcome("failed", f"{type(e).__name__}: {e}")


def _status_outcome(response: httpx.Response) -> Outcome | None:
    if response.status_code == 200:
        return None
    if response.status_code == 429 and response.headers.get("retry-after"):
        return Outcome("rejected")
    return Outcome("failed", f"HTTP {response.status_code}: {response.text[:200]}")


async def metrics(http: httpx.AsyncClient, base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await http.get(f"{base}/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


async def wait_idle(http: httpx.AsyncClient, base: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(http, base)
        keys = ("vllm:num_requests_running", "vllm:num_requests_waiting", "llmserve:kv_blocks_used")
        if all(m.get(k, 0.0) == 0 for k in keys) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


async def soak(args: argparse.Namespace, url: str, pid: int | None, inprocess: bool) -> dict[str, Any]:
    base = url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.burst_size + args.concurrency + 8)
    timeout = httpx.Timeout(600.0, connect=60.0, pool=600.0)
    outcomes: dict[str, int] = {"completed": 0, "dropped": 0, "rejected": 0, "failed": 0}
    failures: list[str] = []
    samples: list[Sample] = []
    snapshots: list[tracemalloc.Snapshot] = []
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        model = (await http.get(f"{url}/models")).json()["data"][0]["id"]
        n = args.requests
        step = max(1, n // 20)
        burst_at = {round(n * (k + 1) / (args.bursts + 1)) for k in range(args.bursts)} if args.bursts else set()
        next_index = 0
        done = 0
        started = time.perf_counter()

        def sample() -> None:
            heap = c_heap() if inprocess else {}
            samples.append(Sample(done, time.perf_counter() - started, rss_mib(pid) if pid else float("nan"), heap))
            if heap:
                extra = f" heap used {heap['heap_used']:.0f} free {heap['heap_free']:.0f} arenas {heap.get('arenas')}"
            else:
                extra = ""
            print(
                f"  {done:>6} requests {samples[-1].seconds:7.0f}s  RSS {samples[-1].rss_mib:7.0f} MiB{extra}",
                flush=True,
            )

        def record(outcome: Outcome) -> None:
            outcomes[outcome.kind] += 1
            if outcome.kind == "failed" and len(failures) < 20:
                failures.append(outcome.detail)

        async def burst() -> None:
            """Short requests all at once, more than the admission limit holds: some must get 429 + Retry-After."""
            bodies = [
                {"model": model, "messages": [{"role": "user", "content": f"burst {i}: hello"}], "max_tokens": 1}
                for i in range(args.burst_size)
            ]
            for body in bodies:
                body["stream"] = False
            for outcome in await asyncio.gather(*(one_request(http, url, b, None) for b in bodies)):
                record(outcome)
            print(f"  burst of {args.burst_size}: {outcomes['rejected']} rejected with Retry-After so far")

        sample()

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < n:
                index = next_index
                next_index += 1
                body, drop_after = request_body(index, args, model)
                while (outcome := await one_request(http, url, body, drop_after)).kind == "rejected":
                    record(outcome)  # as a client would: wait Retry-After (1 s), then send it again
                    await asyncio.sleep(1.0)
                record(outcome)
                done += 1
                if done % step == 0:  # synchronous: the other clients are where they are
                    if args.tracemalloc and done == 2 * step:  # 10%: tracing starts; its snapshot is the baseline
                        tracemalloc.start(8)
                        gc.collect()
                        snapshots.append(tracemalloc.take_snapshot())
                    sample()
                if done in burst_at:
                    await burst()  # this client waits for it; the others keep going

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        idle = await wait_idle(http, base)
        if args.tracemalloc:
            gc.collect()
            snapshots.append(tracemalloc.take_snapshot())
        sample()
        seconds = time.perf_counter() - started
    return {
        "outcomes": outcomes,
        "failures": failures,
        "samples": samples,
        "idle": idle,
        "seconds": seconds,
        "snapshots": snapshots,
    }


def report(args: argparse.Namespace, result: dict[str, Any], label: str) -> str:
    samples: list[Sample] = result["samples"]
    lines = [
        f"## Soak: {label}",
        "",
        f"{args.requests} requests in {result['seconds']:.0f} s; outcomes {result['outcomes']}",
        "",
    ]
    heap_cols = bool(samples[0].heap)
    header = "| requests | seconds | RSS MiB | vs 10% |" + (
        " C heap used MiB | C heap free MiB | mmapped MiB | arenas |" if heap_cols else ""
    )
    lines += [header, "|" + "---:|" * (header.count("|") - 1)]
    base = samples[min(2, len(samples) - 1)].rss_mib
    for s in samples:
        row = f"| {s.done} | {s.seconds:.0f} | {s.rss_mib:.0f} | {s.rss_mib - base:+.0f} |"
        if heap_cols:
            h = s.heap
            row += f" {h['heap_used']:.0f} | {h['heap_free']:.0f} | {h['mmapped']:.0f} | {h.get('arenas', '')} |"
        lines.append(row)
    growth = samples[-1].rss_mib - base
    idle = result["idle"]
    gauges = {
        k: idle.get(k) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting", "llmserve:kv_blocks_used")
    }
    lines += [
        "",
        f"RSS growth after the first 10%: {growth:+.0f} MiB (goal: at most 64)",
        f"gauges at the end: {gauges}",
    ]
    if result["failures"]:
        lines.append("failures (first 20): " + "; ".join(result["failures"]))
    snapshots = result["snapshots"]
    if len(snapshots) == 2:
        lines += ["", "tracemalloc, end vs 10% (top 15 by size growth, grouped by traceback line):", "```"]
        for stat in snapshots[1].compare_to(snapshots[0], "lineno")[:15]:
            lines.append(str(stat))
        total = sum(s.size_diff for s in snapshots[1].compare_to(snapshots[0], "filename"))
        lines += [f"total traced growth: {total / 2**20:+.1f} MiB", "```"]
    return "\n".join(lines)


def plot(curves: list[tuple[str, list[Sample]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, samples in curves:
        ax.plot([s.done for s in samples], [s.rss_mib for s in samples], marker="o", label=label)
    ax.set_xlabel("requests done")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("llmserve resident memory over a soak")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--url", default="", help="soak a running server (…/v1) instead of spawning one")
    p.add_argument("--api-key", default="")
    p.add_argument("--server-args", default="", help="extra `llmserve serve` flags")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the spawned server (e.g. LD_PRELOAD)")
    p.add_argument("--inprocess", action="store_true", help="run the server in this process (tracemalloc, mallinfo2)")
    p.add_argument("--tracemalloc", action="store_true", help="with --inprocess: diff Python allocations, 10%%->end")
    p.add_argument("--words-range", type=int, nargs=2, default=(5, 200))
    p.add_argument("--max-tokens-range", type=int, nargs=2, default=(8, 96))
    p.add_argument("--long-frac", type=float, default=0.03, help="prompts of ~550-2,000 tokens")
    p.add_argument("--drop-frac", type=float, default=0.3, help="streams the client leaves mid-answer")
    p.add_argument("--n2-frac", type=float, default=0.1)
    p.add_argument("--stop-frac", type=float, default=0.2)
    p.add_argument("--logprobs-frac", type=float, default=0.1)
    p.add_argument("--unstreamed-frac", type=float, default=0.1)
    p.add_argument("--bursts", type=int, default=4, help="bursts over the admission limit during the run")
    p.add_argument("--burst-size", type=int, default=320)
    p.add_argument("--label", default="", help="the curve's name in the table and plot")
    p.add_argument("--out", default="", help="append the report (markdown) here")
    p.add_argument("--png", default="bench/SOAK.png", help="the RSS curve")
    p.add_argument("--json", default="", help="write the curve here (to plot several runs: --compare)")
    p.add_argument("--compare", nargs="*", default=[], help="JSON curves from earlier runs to plot alongside")
    args = p.parse_args()
    if args.tracemalloc and not args.inprocess:
        p.error("--tracemalloc needs --inprocess")
    label = args.label or (" ".join([*args.env, args.server_args]).strip() or "default")

    if args.url:
        result = asyncio.run(soak(args, args.url, None, False))
    elif args.inprocess:
        from config.settings import load_settings
        from tests.server.harness import start_server, stop_server

        for item in args.env:
            key, _, value = item.partition("=")
            os.environ[key] = value  # only what this process reads after start (e.g. ONEDNN_* before first use)
        _, settings = load_settings(["serve", "--log-level", "warning", *shlex.split(args.server_args)])
        live, thread = start_server(settings)
        try:
            result = asyncio.run(soak(args, live.base_url, os.getpid(), True))
        finally:
            stop_server(live, thread)
    else:
        saved = dict(os.environ)
        for item in args.env:  # SpawnedServer's child inherits this process's environment
            key, _, value = item.partition("=")
            os.environ[key] = value
        server = SpawnedServer(shlex.split(args.server_args))
        os.environ.clear()
        os.environ.update(saved)
        try:
            asyncio.run(server.wait_ready())
            result = asyncio.run(soak(args, server.url, server.proc.pid, False))
        finally:
            server.stop()

    text = report(args, result, label)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    curves = [(label, result["samples"])]
    for path in args.compare:
        data = json.loads(Path(path).read_text())
        curves.append((data["label"], [Sample(**s) for s in data["samples"]]))
    if args.json:
        samples = [{"done": s.done, "seconds": s.seconds, "rss_mib": s.rss_mib, "heap": s.heap} for s in curves[0][1]]
        Path(args.json).write_text(json.dumps({"label": label, "samples": samples}))
    if args.png and not all(s.rss_mib != s.rss_mib for s in result["samples"]):
        plot(curves, Path(args.png))
    idle_keys = ("vllm:num_requests_running", "vllm:num_requests_waiting", "llmserve:kv_blocks_used")
    bad = result["outcomes"]["failed"] or any(result["idle"].get(k) for k in idle_keys)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
