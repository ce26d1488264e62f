"""Load generator for any OpenAI-compatible server: streaming chat completions at fixed concurrency levels.

    .venv/bin/python bench/serve_bench.py --spawn --concurrency 1 4 16 32 64 --out bench/RESULTS.md
    .venv/bin/python bench/serve_bench.py --url http://127.0.0.1:8080/v1 --concurrency 1 16   # e.g. llama-server
    .venv/bin/python bench/serve_bench.py --spawn --concurrency --long-prompts                # only the long-prompt mix

Each level runs `concurrency` closed-loop clients (a client sends its next request when the last one ends) until
`--requests-per-stream` x concurrency requests are done; every request is ~--prompt-tokens chat tokens (different
text each, so no prefix cache helps), --max-tokens output tokens, EOS ignored, temperature 0. TTFT = send to
first content chunk; inter-token latency = gap between content chunks of one stream. The client runs on the same
CPUs as the server: on a small machine it takes a share of them, the same share for every server measured."""

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

WORDS = (  # noqa: SIM905 - a paragraph reads better than a list of 98 quoted words
    "the server reads a model from disk and answers many clients at once while each request waits for its turn "
    "memory blocks hold keys and values for every token so a long story can continue without computing the past "
    "again river mountain garden window kitchen library market station harbor village forest desert island bridge "
    "morning evening winter summer yellow purple silver golden quiet bright gentle heavy simple careful ancient "
    "modern teacher farmer doctor sailor painter writer builder driver engineer student traveler neighbor friend "
    "walks builds writes counts paints carries follows watches opens closes finds keeps brings sends measures"
).split()


def chat_messages(index: int, num_words: int) -> list[dict[str, str]]:
    """A user message of num_words pseudo-random words, different for each index (deterministic)."""
    rng = random.Random(index)
    words = [rng.choice(WORDS) for _ in range(num_words)]
    for i in range(9, len(words), 10):  # sentences, so the text looks like text to the tokenizer
        words[i] += "."
    text = f"Note {index}: " + " ".join(words) + "\nSummarize the note above in one long paragraph."
    return [{"role": "user", "content": text}]


@dataclass(slots=True)
class StreamResult:
    sent: float
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    prompt_tokens: int = 0
    output_tokens: int = 0  # from usage when the server sends it, else content chunks
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times)]


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    seconds: float
    streams: list[StreamResult]
    server_rss_mib: float = 0.0  # peak during the level, when --spawn
    preemptions: float | None = None  # from the server's vLLM-style /metrics; None when it has none

    @property
    def ok(self) -> list[StreamResult]:
        return [s for s in self.streams if not s.error and s.token_times]

    @property
    def output_tps(self) -> float:
        return sum(s.output_tokens for s in self.ok) / self.seconds

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.seconds


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Client:
    def __init__(self, url: str, model: str, api_key: str, max_tokens: int, connections: int) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
        self.http = httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(900.0, connect=30.0))

    async def resolve_model(self) -> None:
        if not self.model:
            response = await self.http.get(f"{self.url}/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]

    async def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """The server's own count of a prompt's tokens (usage of a 1-token completion)."""
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0}
        response = await self.http.post(f"{self.url}/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["prompt_tokens"])

    async def stream(
        self,
        messages: list[dict[str, str]],
        max_tokens: int = 0,
        stop: asyncio.Event | None = None,
        result: StreamResult | None = None,
    ) -> StreamResult:
        """One streaming chat completion; returns early (closing the stream) when `stop` is set. Pass `result` to
        watch the stream's progress while it runs."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # vLLM / llmserve / llama-server extra: every request makes max_tokens tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = result or StreamResult(sent=0.0)
        result.sent = time.perf_counter()
        chunks = 0
        try:
            async with self.http.stream("POST", f"{self.url}/chat/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                        result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                        result.token_times.append(time.perf_counter())
                        chunks += 1
                    if stop is not None and stop.is_set():
                        break
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"
        if not result.output_tokens or (stop is not None and stop.is_set()):
            result.output_tokens = chunks
        return result

    async def preemptions(self) -> float | None:
        """vllm:num_preemptions_total from /metrics (vLLM and llmserve export it); None when absent."""
        try:
            response = await self.http.get(self.url.removesuffix("/v1") + "/metrics")
        except httpx.HTTPError:
            return None
        values = [
            float(line.split()[-1])
            for line in response.text.splitlines()
            if line.startswith("vllm:num_preemptions_total")
        ]
        return sum(values) if response.status_code == 200 and values else None

    async def close(self) -> None:
        await self.http.aclose()


async def size_prompt(client: Client, target_tokens: int) -> int:
    """Words per message for ~target_tokens prompt tokens, measured on the server's own tokenizer."""
    words = max(1, int(target_tokens * 0.7))
    for attempt in range(4):
        low = await client.prompt_tokens(chat_messages(-1 - attempt, words))
        high = await client.prompt_tokens(chat_messages(-1 - attempt, 2 * words))
        per_word = (high - low) / words
        overhead = low - per_word * words
        words = max(1, round((target_tokens - overhead) / per_word))
        if abs(await client.prompt_tokens(chat_messages(-100, words)) - target_tokens) <= max(3, target_tokens // 50):
            break
    return words


class RssSampler:
    """Peak resident memory of one process, sampled from /proc while a level runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak_kib = 0

    def read_kib(self) -> int:
        if self.pid is None:
            return 0
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.peak_kib = max(self.peak_kib, self.read_kib())
            await asyncio.sleep(0.25)


async def run_level(
    client: Client, concurrency: int, num_requests: int, words: int, first_index: int, server_pid: int | None
) -> LevelResult:
    results: list[StreamResult] = []
    queue = list(range(first_index, first_index + num_requests))

    async def worker() -> None:
        while queue:
            index = queue.pop(0)
            results.append(await client.stream(chat_messages(index, words)))

    preempted_before = await client.preemptions()
    rss, done = RssSampler(server_pid), asyncio.Event()
    sampler = asyncio.create_task(rss.run(done))
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    done.set()
    await sampler
    preempted_after = await client.preemptions()
    preempted = None if preempted_before is None or preempted_after is None else preempted_after - preempted_before
    return LevelResult(concurrency, seconds, results, rss.peak_kib / 1024, preempted)


@dataclass(slots=True)
class LongPromptResult:
    long: list[StreamResult]
    short: list[StreamResult]
    long_sent: float  # when the long prompts were sent

    @property
    def short_max_gap(self) -> float:
        """Longest wait of a short stream for its next token once the long prompts were in."""
        gaps = [b - a for s in self.short for a, b in pairwise(s.token_times) if b > self.long_sent]
        return max(gaps, default=float("nan"))


async def run_long_prompts(
    client: Client, short_words: int, long_words: int, num_short: int, num_long: int
) -> LongPromptResult:
    """num_short streams decode; once each has tokens flowing, num_long long prompts arrive at once. The short
    streams are closed when every long one has its first token."""
    stop = asyncio.Event()
    short = [StreamResult(sent=0.0) for _ in range(num_short)]
    short_tasks = [
        asyncio.create_task(
            client.stream(chat_messages(2_000_000 + i, short_words), max_tokens=4096, stop=stop, result=r)
        )
        for i, r in enumerate(short)
    ]
    deadline = time.perf_counter() + 300
    while time.perf_counter() < deadline and not all(t.done() for t in short_tasks):
        await asyncio.sleep(0.2)
        if all(len(r.token_times) >= 4 for r in short):  # every short stream is past its prefill and decoding
            break
    long_sent = time.perf_counter()
    long = await asyncio.gather(
        *(client.stream(chat_messages(3_000_000 + i, long_words), max_tokens=16) for i in range(num_long))
    )
    stop.set()
    await asyncio.gather(*short_tasks)
    return LongPromptResult(list(long), short, long_sent)


def level_table(levels: list[LevelResult], with_rss: bool) -> str:
    head = (
        "| streams | requests | prompt tok | output tok/s | requests/s "
        "| TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | max gap s | errors |"
    )
    rule = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    with_preemptions = any(lv.preemptions is not None for lv in levels)
    if with_rss:
        head, rule = head + " server RSS MiB |", rule + "---:|"
    if with_preemptions:
        head, rule = head + " preemptions |", rule + "---:|"
    lines = [head, rule]
    for lv in levels:
        ok = lv.ok
        ttfts = [s.ttft for s in ok]
        gaps = [g for s in ok for g in s.gaps]
        prompt = statistics.mean(s.prompt_tokens for s in ok) if ok else 0
        row = (
            f"| {lv.concurrency} | {len(ok)} | {prompt:.0f} | {lv.output_tps:.1f} | {lv.requests_per_s:.2f} | "
            f"{percentile(ttfts, 50):.2f} | {percentile(ttfts, 99):.2f} | {1000 * percentile(gaps, 50):.0f} | "
            f"{1000 * percentile(gaps, 99):.0f} | {max(gaps, default=float('nan')):.2f} | {len(lv.streams) - len(ok)} |"
        )
        row += f" {lv.server_rss_mib:.0f} |" if with_rss else ""
        if with_preemptions:
            row += " - |" if lv.preemptions is None else f" {lv.preemptions:.0f} |"
        lines.append(row)
    return "\n".join(lines)


def long_table(r: LongPromptResult) -> str:
    ttfts = [s.ttft for s in r.long if s.token_times]
    prompt = statistics.mean(s.prompt_tokens for s in r.long) if r.long else 0
    return "\n".join(
        [
            "| long prompts | prompt tok | long TTFT p50 s | long TTFT max s "
            "| short streams | short max gap s | errors |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {len(r.long)} | {prompt:.0f} | {percentile(ttfts, 50):.2f} | {max(ttfts, default=float('nan')):.2f} | "
            f"{len(r.short)} | {r.short_max_gap:.2f} | {sum(1 for s in r.long + r.short if s.error)} |",
        ]
    )


def plot(levels: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the PNG only
    import matplotlib.pyplot as plt

    xs = [lv.concurrency for lv in levels]
    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    ax_tps.plot(xs, [lv.output_tps for lv in levels], "o-")
    ax_tps.set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    ax_ttft.plot(xs, [percentile([s.ttft for s in lv.ok], 50) for lv in levels], "o-", label="p50")
    ax_ttft.plot(xs, [percentile([s.ttft for s in lv.ok], 99) for lv in levels], "s--", label="p99")
    ax_ttft.set(xlabel="concurrent streams", ylabel="seconds", title="time to first token")
    ax_ttft.legend()
    for ax in (ax_tps, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)  # from zero, so a small change does not look like a large one
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a server drains), then SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SpawnedServer:
    """`llmserve serve` on a free loopback port; stopped with SIGTERM."""

    def __init__(self, extra_args: list[str]) -> None:
        self.port = free_port()
        # The server's output for its whole life, and kept afterwards (its name is in the errors): no `with`.
        self.log = tempfile.NamedTemporaryFile(prefix="llmserve-bench-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *extra_args,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    async def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.perf_counter() + timeout
        async with httpx.AsyncClient() as http:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llmserve exited with {self.proc.returncode}; log: {self.log.name}")
                try:
                    if (await http.get(f"http://127.0.0.1:{self.port}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"llmserve not healthy after {timeout:.0f}s; log: {self.log.name}")

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass(slots=True)
class Run:
    server: str  # what was measured, for the report
    model: str
    levels: list[LevelResult]
    long: LongPromptResult | None
    idle_rss_mib: float  # 0 when the server was not spawned here


async def measure(args: argparse.Namespace) -> Run:
    server = SpawnedServer(shlex.split(args.server_args)) if args.spawn else None
    try:
        if server is not None:
            started = time.perf_counter()
            await server.wait_ready()
            print(
                f"spawned llmserve on {server.url} "
                f"(ready in {time.perf_counter() - started:.1f}s; log {server.log.name})",
                file=sys.stderr,
            )
        pid = server.proc.pid if server is not None else None
        top = max(args.concurrency, default=1)
        client = Client(
            server.url if server else args.url,
            args.model,
            args.api_key,
            args.max_tokens,
            max(top, 2 * args.long_streams),
        )
        await client.resolve_model()
        words = await size_prompt(client, args.prompt_tokens)
        await run_level(client, 1, 1, words, -10, None)  # warm-up, not reported
        idle_rss = RssSampler(pid).read_kib() / 1024
        print(f"model {client.model}; {words} words = ~{args.prompt_tokens} prompt tokens", file=sys.stderr)

        levels: list[LevelResult] = []
        next_index = 0  # request i always gets text i, so runs with the same flags send the same prompts
        for c in args.concurrency:
            n = max(c * args.requests_per_stream, args.min_requests)
            levels.append(await run_level(client, c, n, words, next_index, pid))
            next_index += n
            print(f"  {c} streams: {levels[-1].output_tps:.1f} output tok/s", file=sys.stderr, flush=True)

        long_result = None
        if args.long_prompts:
            long_words = await size_prompt(client, args.long_prompt_tokens)
            long_result = await run_long_prompts(client, words, long_words, args.long_streams, args.long_streams)
        await client.close()
    finally:
        if server is not None:
            server.stop()
    described = f"llmserve spawned with `{args.server_args}`" if args.server_args else "llmserve spawned with defaults"
    return Run(described if server else args.url, client.model, levels, long_result, idle_rss)


def write_report(args: argparse.Namespace, run: Run) -> str:
    report = [
        "# serve_bench results",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; server: {run.server}; model: {run.model}; "
        f"{os.cpu_count()} CPUs, load average at end {os.getloadavg()[0]:.1f} (client and server share the CPUs).",
        f"Streaming chat completions, ~{args.prompt_tokens} prompt tokens (distinct text per request), "
        f"{args.max_tokens} output tokens, ignore_eos, temperature 0; closed loop, "
        f"{args.requests_per_stream} requests per stream (at least {args.min_requests}).",
        "",
        f"Command: `{shlex.join([_short_path(sys.executable), *sys.argv])}`",
        "",
    ]
    if run.levels:
        report += [level_table(run.levels, with_rss=args.spawn), ""]
        if args.spawn:
            report += [f"Server RSS idle (after warm-up): {run.idle_rss_mib:.0f} MiB.", ""]
    if run.long is not None:
        report += [
            f"## Long prompts: {args.long_streams} x ~{args.long_prompt_tokens} tokens arrive "
            f"while {args.long_streams} short streams decode",
            "",
            long_table(run.long),
            "",
        ]
    if run.levels and args.out:
        png = Path(args.out).with_suffix(".png")
        title = (
            f"{run.server}, {run.model}: ~{args.prompt_tokens} prompt tok, "
            f"{args.max_tokens} output tok, EOS ignored, T=0"
        )
        plot(run.levels, png, title)
        report += [f"![throughput and TTFT vs concurrency]({png.name})", ""]
    return "\n".join(report)


def _short_path(path: str) -> str:
    """The path relative to the repository when it is inside it (`.venv/bin/python`), else as given."""
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (ignored with --spawn)"
    )
    parser.add_argument(
        "--spawn", action="store_true", help="start `llmserve serve` on a free loopback port, stop it after"
    )
    parser.add_argument(
        "--server-args", default="", help="extra `llmserve serve` flags with --spawn, e.g. '--quantization int8'"
    )
    parser.add_argument("--model", default="", help="model id; default: the first of /v1/models")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    parser.add_argument(
        "--concurrency", type=int, nargs="*", default=[1, 4, 16], help="stream counts; none = skip the levels"
    )
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    parser.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=146)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--long-prompts", action="store_true", help="also run long prompts arriving while short streams decode"
    )
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument(
        "--long-streams", type=int, default=4, help="long prompts, and short streams decoding meanwhile"
    )
    parser.add_argument("--out", default="", help="write the markdown report here and the plot next to it (.png)")
    args = parser.parse_args()
    text = write_report(args, asyncio.run(measure(args)))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
