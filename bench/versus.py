"""llmserve against llama.cpp's llama-server, side by side in one run: the same GGUF, the same prompts, the same
load generator (serve_bench.py's), servers alternating round by round, each started afresh for its round.

    .venv/bin/python bench/versus.py                                  # what `make bench` runs
    .venv/bin/python bench/versus.py --concurrency 1 16 --max-tokens 64 --rounds 2 --out /tmp/v.md

Per server and round: start-up (process start to the first answer to a one-line prompt; llmserve's first round
with an empty --cache-dir, so it builds its tokenizer cache and compiles its decode step from nothing, later rounds
reuse them), idle resident memory after that answer, then every concurrency level (distinct prompts per round:
llama-server reuses cached prompt prefixes across requests). Medians over rounds; ratios are llmserve over
llama-server. llmserve runs with `--llmserve-args` (none: the defaults); llama-server with the reference flags of
../shared/peers/README.md. Without the peer binary (`make peer` builds it into .peers/), llmserve is measured alone.
"""

import argparse
import asyncio
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import (  # noqa: E402
    Client,
    LevelResult,
    RssSampler,
    free_port,
    percentile,
    run_level,
    run_long_prompts,
    size_prompt,
    stop_process,
)

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"
DEFAULT_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


class Server:
    """One server process on a free loopback port; its output kept in a temp file; stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"versus-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}/v1"

    async def first_answer(self, timeout: float = 600) -> float:
        """Seconds from process start to a complete answer to a one-line prompt (polling until one comes)."""
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
        deadline = self.started + timeout
        async with httpx.AsyncClient(timeout=60) as http:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log.name}")
                try:
                    response = await http.post(f"{self.url}/chat/completions", json=body)
                    if response.status_code == 200 and response.json()["choices"][0]["message"]["content"]:
                        return time.perf_counter() - self.started
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} gave no answer in {timeout:.0f}s; log {self.log.name}")

    async def decode_step_settled(self, timeout: float = 900) -> float:
        """llmserve: wait until its background compile has ended (/health's decode_step no longer `compiling`), so
        that the levels measure the steady state; seconds since process start. Other servers: 0."""
        deadline = time.perf_counter() + timeout
        async with httpx.AsyncClient(timeout=30) as http:
            while time.perf_counter() < deadline:
                health = (await http.get(f"http://127.0.0.1:{self.port}/health")).json()
                if health.get("decode_step", "eager") != "compiling":
                    return 0.0 if "decode_step" not in health else time.perf_counter() - self.started
                await asyncio.sleep(1)
        raise TimeoutError(f"{self.name}: decode step still compiling after {timeout:.0f}s; log {self.log.name}")

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Round:
    ready_s: float
    idle_rss_mib: float
    compiled_s: float  # llmserve: process start to the end of the background compile
    levels: dict[int, LevelResult] = field(default_factory=dict)
    long_max_gap_s: float | None = None
    long_ttft_s: float | None = None


def start(name: str, args: argparse.Namespace, cache_dir: str) -> Server:
    port = free_port()
    if name == "llmserve":
        cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning", "--cache-dir", cache_dir, *shlex.split(args.llmserve_args)]
        return Server(name, cmd, port)
    cmd = [str(args.peer), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "8192", "-np", "16", "-t", str(args.peer_threads), "--log-disable"]
    return Server(name, cmd, port)


async def run_round(name: str, args: argparse.Namespace, cache_dir: str, first_index: int) -> Round:
    server = start(name, args, cache_dir)
    try:
        ready = await server.first_answer()
        compiled = await server.decode_step_settled()
        top = max(args.concurrency, default=1)
        client = Client(server.url, "", "", args.max_tokens, max(top, 8))
        await client.resolve_model()
        words = await size_prompt(client, args.prompt_tokens)
        await run_level(client, 1, 1, words, -10, None)  # warm-up, not reported
        result = Round(ready, RssSampler(server.proc.pid).read_kib() / 1024, compiled)
        index = first_index
        for c in args.concurrency:
            n = max(c * args.requests_per_stream, args.min_requests)
            result.levels[c] = await run_level(client, c, n, words, index, server.proc.pid)
            index += n
            print(f"    {name} {c} streams: {result.levels[c].output_tps:.1f} tok/s", file=sys.stderr, flush=True)
        if args.long_prompts and name == "llmserve":
            long_words = await size_prompt(client, args.long_prompt_tokens)
            long = await run_long_prompts(client, words, long_words, 4, 4)
            result.long_max_gap_s = long.short_max_gap
            result.long_ttft_s = percentile([s.ttft for s in long.long], 50)
        await client.close()
        return result
    finally:
        server.stop()


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(args: argparse.Namespace, rounds: dict[str, list[Round]], seconds: float) -> str:
    names = [n for n in ("llmserve", "llama-server") if rounds.get(n)]
    has_peer = len(names) == 2
    lines = [
        "# llmserve vs llama-server",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_name()}, {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds alternating servers ({seconds / 60:.0f} min); load average at end "
        f"{os.getloadavg()[0]:.1f} (the client shares the CPUs). Model: `{args.gguf.name}` for both.",
        f"llmserve: `llmserve serve {args.llmserve_args}`"
        + (" (defaults)" if not args.llmserve_args else "")
        + (f"; llama-server: `-c 8192 -np 16 -t {args.peer_threads}`" if has_peer else "; llama-server: not built"),
        f"Streaming chat completions, ~{args.prompt_tokens}-token prompts (distinct text per request and round), "
        f"{args.max_tokens} output tokens, ignore_eos, temperature 0; closed loop, "
        f"{args.requests_per_stream} requests per stream (at least {args.min_requests}). Medians over rounds.",
        "",
        f"Command: `{shlex.join(['python', *sys.argv])}`",
        "",
    ]
    header = "| streams | " + " | ".join(f"{n} tok/s" for n in names)
    header += " | ratio |" if has_peer else " |"
    header += " " + " | ".join(f"{n} TTFT p50 s" for n in names) + (" | ratio |" if has_peer else " |")
    header += " llmserve ITL p50 ms | llmserve max gap s |"
    lines += [header, "|---:" * (header.count("|") - 1) + "|"]
    for c in args.concurrency:
        tps = {n: med([r.levels[c].output_tps for r in rounds[n]]) for n in names}
        ttft = {n: med([percentile([s.ttft for s in r.levels[c].ok], 50) for r in rounds[n]]) for n in names}
        itl = med([percentile([g for s in r.levels[c].ok for g in s.gaps], 50) * 1000 for r in rounds["llmserve"]])
        gap = med([max((max(s.gaps, default=0.0) for s in r.levels[c].ok), default=0.0) for r in rounds["llmserve"]])
        row = f"| {c} | " + " | ".join(f"{tps[n]:.1f}" for n in names)
        row += f" | **{tps['llmserve'] / tps['llama-server']:.2f}x** |" if has_peer else " |"
        row += " " + " | ".join(f"{ttft[n]:.2f}" for n in names)
        row += f" | {ttft['llmserve'] / ttft['llama-server']:.2f}x |" if has_peer else " |"
        row += f" {itl:.1f} | {gap:.2f} |"
        lines.append(row)
    lines += ["", "## Start-up and memory", ""]
    lines += [
        "| server | first start: to first answer s | later starts s | decode step compiled at s | idle RSS MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for n in names:
        first, later = rounds[n][0].ready_s, [r.ready_s for r in rounds[n][1:]]
        rss = med([r.idle_rss_mib for r in rounds[n]])
        later_text = ", ".join(f"{s:.1f}" for s in later) or "-"
        compiled = ", ".join(f"{r.compiled_s:.0f}" for r in rounds[n]) if n == "llmserve" else "-"
        lines.append(f"| {n} | {first:.1f} | {later_text} | {compiled} | {rss:.0f} |")
    lines += [
        "",
        "llmserve's first start has an empty `--cache-dir` (no tokenizer cache, no compiled kernels): it answers "
        "eagerly while its decode step compiles in the background (the levels start once it is compiled, so they "
        "measure the steady state). Idle RSS: after the first answer and one warm-up request; the KV pool is "
        "resident only where written.",
    ]
    gaps = [r.long_max_gap_s for r in rounds["llmserve"] if r.long_max_gap_s is not None]
    if gaps:
        ttfts = [r.long_ttft_s for r in rounds["llmserve"] if r.long_ttft_s is not None]
        lines += [
            "",
            f"Long prompts (llmserve): 4 x ~{args.long_prompt_tokens} tokens arrive while 4 short streams decode; "
            f"longest wait of a short stream for its next token {med(gaps):.2f} s (rounds: "
            + ", ".join(f"{g:.2f}" for g in gaps)
            + f"); TTFT p50 of the long prompts {med(ttfts):.2f} s.",
        ]
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


async def main_async(args: argparse.Namespace) -> None:
    names = ["llmserve"] + (["llama-server"] if args.peer.exists() else [])
    if len(names) == 1:
        print(f"no llama-server at {args.peer}: `make peer` builds it; measuring llmserve alone", file=sys.stderr)
    rounds: dict[str, list[Round]] = {n: [] for n in names}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmserve-cache-") as cache_dir:
        index = 0
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                print(f"round {i + 1}: {name}", file=sys.stderr, flush=True)
                rounds[name].append(await run_round(name, args, cache_dir, index))
            index += sum(max(c * args.requests_per_stream, args.min_requests) for c in args.concurrency)
    text = report(args, rounds, time.perf_counter() - began)
    print(text)
    if args.out:
        Path(args.out).write_text(text + kept_history(Path(args.out)))


def kept_history(out: Path) -> str:
    """What --out holds from its first dated section on (`# 2026-...`): the run's table replaces only what is above."""
    old = out.read_text() if out.exists() else ""
    match = re.search(r"^# \d{4}-\d{2}-\d{2}", old, flags=re.MULTILINE)
    return "\n" + old[match.start() :] if match else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llmserve-args", default="", help="llmserve flags; none = the defaults")
    parser.add_argument("--peer", type=Path, default=PEER, help="the llama-server binary")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the model both servers load")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=146)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--long-prompts", action="store_true", help="also llmserve's long-prompt scenario")
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--out", default="", help="write the markdown report here")
    args = parser.parse_args()
    if args.gguf == DEFAULT_GGUF and not args.gguf.exists():
        sys.exit(f"{args.gguf} missing: `make model` fetches it")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
