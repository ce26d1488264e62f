"""Speculative decoding by prompt lookup (issue 16): an input-grounded workload beside a chat workload, with and
without speculation, in one process on engines built once and kept.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative.py          # ~7 min on a busy 2-core machine
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative.py --quick  # 2 in turn, 8 at once, level 4: ~2.5 min
    .venv/bin/python bench/speculative.py --all-k -- --num-threads 1       # flags after `--`: Settings

Workloads (chat-templated user turns, EOS honoured, at most --max-tokens generated):
  grounded   16 distinct requests to return an edited copy of a given ~130-170-token text: 2 paragraphs x 4
             instructions (fix a typo, proofread, make it formal, repeat it with a word replaced) and 2 Python pieces
             x 4 instructions (type hints, docstrings, fix a bug, rename a variable); where prompt lookup pays.
             Greedy, and temperature 0.7 (seed = request).
  chat       16 open questions ("Tell me about volcanoes."), temperature --chat-temperature (0.7, seed = request).
  Request j is piece j % 4 with instruction (j + j // 4) % 4, so the first n requests of a load mix text and code.

Engines (one model load each, kept for the run): speculation off; prompt lookup with num_speculative_tokens k = 2,
4, 6 and max_batch_size 64 (on at every batch here); k = 4 with the default max_batch_size (off while more than that
sequences run). prompt_lookup_max 4, prompt_lookup_min 1. Prefix caching is off (rounds repeat the prompts; a hit in
round 2 is not what distinct requests get) and the KV cache is 320 MiB; flags after `--` (Settings) override both.

Loads: every engine of a load runs it at the same time, in lockstep by generated tokens (the next step goes to the
engine with the fewest tokens so far), and each engine's time is the time inside its own steps: all pass through
the load together, so a change in the machine's load (on a shared 2-core machine it moves a run by 30 % and more)
hits them alike. --rounds (2; engine order reversed in the even ones), medians.
  1 stream    the first --sequential (4) requests one after another: grounded greedy, grounded T=0.7 (off and k=4;
              --all-k for all), chat
  N streams   --streams (16) requests at once, grounded greedy and chat: off, k=4 at max_batch_size 64 and default
              (--all-k: k=2 and 6 too)
  threshold   the first max(--levels) (8) requests, n at a time (the next added when one finishes), for n in
              --levels (2 4 8): off against k=4 forced on (max_batch_size 64); rows 1 and N come from the tables
              above. The threshold is the largest n up to which every level paid (>= 1.0x) for both workloads.
Columns: output tok/s = generated tokens / the engine's time in the load; decode tok/s = tokens of the steps in which
no request was still in its prompt / their time; acceptance = accepted / proposed tokens; accepted/draft = accepted
tokens per verification (a sequence's step with proposals); steps = engine steps in the load; "= off": requests
whose tokens equal the off engine's (speculation is exact; batched float sums could still differ).

On a shared machine compare rows of one run and note the load average printed at the start and the end."""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from engine_throughput import LevelResult, bench_settings  # noqa: E402  (output tok/s, decode tok/s as the other engine benchmarks)

from config.settings import load_settings  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.speculative import SpeculativeConfig  # noqa: E402
from model.sampling_params import SamplingParams  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402

# ---- workloads ---------------------------------------------------------------------------------------------------
TEXTS = [
    (
        "The old lighthouse stood on the rocky point for more than a hundred years. Every evening the keeper "
        "climbed the spiral stairs, lit the great lamp and wound the clockwork that turned the lens. Ships "
        "passing the reef at night looked for its beam, and fishermen said they could set their watches by "
        "it. In the winter storms the keeper stayed awake until dawn, wiping salt from the windows and "
        "writing the weather in a thick leather book. When he retired, the town voted to keep the light "
        "burning, and volunteers now take turns climbing the stairs each dusk. The leather books are kept in "
        "the library, where children read them to learn how the sea has changed."
    ),
    (
        "Our team meeting on Tuesday covered three topics. First, the new billing service will move to the "
        "shared database next month, so every query that joins the invoices table must be reviewed before the "
        "migration. Second, the support rota changes: from the first of the month each engineer takes one "
        "week on call in turn, and the person on call answers pages within fifteen minutes. Third, the office "
        "will be closed on Friday for the network upgrade, so please work from home that day and check that "
        "your laptop connects to the virtual private network before Thursday evening. Questions about any of "
        "these can go to the team channel."
    ),
]
TYPOS = [("climbed", "climbd"), ("billing", "biling")]  # one misspelling per paragraph, for the fix-it tasks
CODES = [
    """def parse_config(path):
    result = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        if value == "":
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged
""",
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError("not enough " + name)
        self.items[name] = have - count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
""",
]
TEXT_TASKS = [
    lambda t, typo: "Fix the typo in this paragraph and return the corrected paragraph.\n\n" + t.replace(*typo, 1),
    lambda t, typo: "Proofread the following text and return it with any mistakes fixed.\n\n" + t.replace(*typo, 1),
    lambda t, typo: "Make this paragraph more formal. Return the full rewritten paragraph.\n\n" + t,
    lambda t, typo: f"Here is a paragraph:\n\n{t}\n\nRepeat the paragraph, replacing every 'and' with 'as well as'.",
]
CODE_TASKS = [
    lambda c: f"Rewrite this code with type hints.\n\n```python\n{c}```",
    lambda c: f"Add a docstring to every function in this code and return the whole code.\n\n```python\n{c}```",
    lambda c: (
        "Fix the bug in this Python code and return the corrected code.\n\n```python\n"
        + c.replace("return", "retrun", 1)
        + "```"
    ),
    lambda c: f"Rename the variable `key` to `name` in this code.\n\n```python\n{c}```",
]
QUESTIONS = [
    "Tell me about volcanoes.",
    "Why is the sky blue?",
    "What should I see on a first trip to Japan?",
    "How do bees make honey?",
    "Explain how a bicycle stays upright.",
    "What is the history of chess?",
    "Give me some tips for learning to cook.",
    "How do airplanes fly?",
    "What causes the seasons on Earth?",
    "Tell me about the Roman Empire.",
    "How does a refrigerator work?",
    "What are black holes?",
    "Why do cats purr?",
    "How can I sleep better?",
    "What is photosynthesis?",
    "Tell me about the deep ocean.",
]


def grounded_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    pieces = [("text", 0), ("text", 1), ("code", 0), ("code", 1)]
    out = []
    for j in range(n):
        kind, p = pieces[j % 4]
        task = (j + j // 4) % 4
        content = TEXT_TASKS[task](TEXTS[p], TYPOS[p]) if kind == "text" else CODE_TASKS[task](CODES[p])
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    return out


def chat_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[j % len(QUESTIONS)]}]) for j in range(n)
    ]


# ---- runs --------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    result: LevelResult
    tokens: list[list[int]]
    drafts: int
    draft_tokens: int
    accepted: int


class Driver:
    """One engine's share of a load: its requests with at most `concurrency` in flight (the next one added when one
    finishes), advanced one engine step per call so that the engines of a load can take turns. Only the time inside
    this driver's own calls counts: add_request, the intake and Engine.step."""

    def __init__(
        self, engine: Engine, tag: str, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
    ) -> None:
        self.engine, self.tag, self.prompts, self.params = engine, tag, prompts, params
        self.concurrency = concurrency
        self.queue = list(range(len(prompts)))
        self.in_flight: set[int] = set()
        self.has_token: set[int] = set()
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.generated = self.turns = 0
        self.before = engine.stats()
        self.busy = self.decode_seconds = 0.0
        self.decode_tokens = self.decode_steps = self.batch_sum = 0

    @property
    def done(self) -> bool:
        return not self.queue and not self.in_flight

    def step(self) -> None:
        started = time.perf_counter()
        engine = self.engine
        if len(self.in_flight) < self.concurrency and self.queue:
            while len(self.in_flight) < self.concurrency and self.queue:
                i = self.queue.pop(0)
                engine.add_request(f"{self.tag}-{i}", self.prompts[i], self.params[i])
                self.in_flight.add(i)
            engine._drain_inbox(False)  # the step loop's own intake, without its worker thread
        pure_decode = self.in_flight <= self.has_token  # no request of this step is still in its prompt
        outs = engine.step()
        new = 0
        for o in outs:
            i = int(o.request_id.rsplit("-", 1)[1])
            self.tokens[i].extend(o.new_token_ids)
            new += len(o.new_token_ids)
            self.has_token.add(i)
            if o.finish_reason is not None:
                self.in_flight.discard(i)
        seconds = time.perf_counter() - started
        self.busy += seconds
        self.generated += new
        self.turns += 1
        if pure_decode:
            self.decode_seconds += seconds
            self.decode_tokens += new
            self.decode_steps += 1
            self.batch_sum += len(outs)

    def run(self) -> Run:
        after = self.engine.stats()
        result = LevelResult(
            concurrency=self.concurrency,
            prompt_tokens=sum(map(len, self.prompts)) // len(self.prompts),
            output_tokens=self.generated,
            seconds=self.busy,
            prefill_seconds=self.busy - self.decode_seconds,
            decode_tokens=self.decode_tokens,
            steps=after.num_steps - self.before.num_steps,
            decode_steps=self.decode_steps,
            mean_batch=self.batch_sum / max(self.decode_steps, 1),
        )
        return Run(
            result,
            self.tokens,
            after.spec_drafts - self.before.spec_drafts,
            after.spec_draft_tokens - self.before.spec_draft_tokens,
            after.spec_accepted_tokens - self.before.spec_accepted_tokens,
        )


@dataclass(slots=True)
class Load:
    name: str  # table row label
    prompts: list[list[int]]
    params: list[SamplingParams]
    concurrency: int
    engines: list[str]
    runs: dict[str, list[Run]] = field(default_factory=dict)


def run_rounds(engines: dict[str, Engine], load: Load, rounds: int) -> None:
    """Every engine of the load runs it at the same time, in lockstep by generated tokens: the next step goes to the
    engine that has generated the fewest so far (ties: the fewest steps, then the round's order, reversed every
    round). All of them pass through the load together and finish together, so a change in the machine's load hits
    them alike."""
    for r in range(rounds):
        names = load.engines if r % 2 == 0 else load.engines[::-1]
        drivers = [
            Driver(engines[name], f"{load.name}-{name}-r{r}", load.prompts, load.params, load.concurrency)
            for name in names
        ]
        wall = time.perf_counter()
        while active := [d for d in drivers if not d.done]:
            min(active, key=lambda d: (d.generated, d.turns, drivers.index(d))).step()
        wall = time.perf_counter() - wall
        for name, driver in zip(names, drivers, strict=True):
            load.runs.setdefault(name, []).append(driver.run())
        print(
            f"  {load.name}, {len(load.prompts)} requests, {load.concurrency} at a time, round {r + 1} ({wall:.0f} s): "
            + ", ".join(f"{n} {load.runs[n][-1].result.output_tps:.1f}" for n in names)
            + " tok/s",
            file=sys.stderr,
            flush=True,
        )


def tps(runs: list[Run]) -> float:
    return statistics.median(r.result.output_tps for r in runs)


def acceptance(runs: list[Run]) -> tuple[str, str]:
    drafted, accepted, drafts = (sum(getattr(r, a) for r in runs) for a in ("draft_tokens", "accepted", "drafts"))
    if not drafted:
        return "-", "-"
    return f"{100 * accepted / drafted:.0f} %", f"{accepted / drafts:.2f}"


def print_table(title: str, loads: list[Load], labels: dict[str, str]) -> None:
    print(f"\n## {title}\n")
    print(
        "| workload | engine | tokens/req | output tok/s | vs off | decode tok/s | acceptance | accepted/draft | "
        "steps | tokens/step | = off |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        base = load.runs["off"]
        for name in load.engines:
            runs = load.runs[name]
            res = runs[0].result
            n = len(load.prompts)
            same = sum(a == b for a, b in zip(runs[0].tokens, base[0].tokens, strict=True))
            acc, per = acceptance(runs)
            dec = statistics.median(r.result.decode_tps for r in runs)
            print(
                f"| {load.name} | {labels[name]} | {res.output_tokens / n:.0f} | {tps(runs):.1f} | "
                f"{tps(runs) / tps(base):.2f}x | {dec:.1f} | {acc} | {per} | {res.steps} | "
                f"{res.output_tokens / res.steps:.2f} | {same}/{n} |"
            )


# ---- main --------------------------------------------------------------------------------------------------------
DEFAULT_MAX_BATCH = SpeculativeConfig.__dataclass_fields__["max_batch_size"].default


def spec_json(k: int, max_batch_size: int) -> str:
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
            "max_batch_size": max_batch_size,
        }
    )


def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 requests in turn at 1 stream, 8 at once for many streams, 48 tokens, threshold at 4 streams only",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (EOS honoured)")
    parser.add_argument("--sequential", type=int, default=4, help="requests one after another in a 1-stream load")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests of the many-streams loads")
    parser.add_argument(
        "--levels",
        type=int,
        nargs="*",
        default=[2, 4, 8],
        help="streams of the threshold loads: the first max(levels) requests, this many at a time",
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of every load on every engine (order alternates)")
    parser.add_argument(
        "--chat-temperature", type=float, default=0.7, help="chat workload temperature (seed = request)"
    )
    parser.add_argument(
        "--all-k", action="store_true", help="k = 2 and 6 in the grounded T=0.7 and many-streams loads too"
    )
    args = parser.parse_args(own)
    if args.quick:
        args.sequential, args.streams, args.max_tokens, args.levels = 2, 8, 48, [4]

    load_avg = os.getloadavg()
    settings_argv = ["serve", "--kv-cache-memory", str(320 << 20), "--no-enable-prefix-caching", *server_flags]
    base_settings = bench_settings(settings_argv)
    tokenizer = Tokenizer.load(base_settings.model_path, base_settings.chat_template)
    configs = {
        "off": "",
        "k2": spec_json(2, 64),
        "k4": spec_json(4, 64),
        "k6": spec_json(6, 64),
        "k4-mbs4": spec_json(4, DEFAULT_MAX_BATCH),
    }
    labels = {
        "off": "off",
        "k2": "k=2",
        "k4": "k=4",
        "k6": "k=6",
        "k4-mbs4": f"k=4, max_batch_size {DEFAULT_MAX_BATCH} (default)",
    }
    engines: dict[str, Engine] = {}
    started = time.perf_counter()
    for name, spec in configs.items():
        engines[name] = Engine(load_settings(settings_argv, speculative_config=spec)[1], tokenizer=tokenizer)
    load_s = time.perf_counter() - started
    print(f"# speculative decoding (prompt lookup)\n\n{engines['off'].describe()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average at start {load_avg[0]:.1f} / {load_avg[1]:.1f} "
        f"(1 / 5 min); {len(engines)} engines loaded in {load_s:.0f} s"
    )
    print(
        f"max_tokens {args.max_tokens} (EOS honoured), {args.rounds} rounds (medians), chat temperature "
        f"{args.chat_temperature}, prefix caching {'on' if base_settings.enable_prefix_caching else 'off'}, "
        f"max_num_batched_tokens {base_settings.max_num_batched_tokens}",
        flush=True,
    )

    n_max = max(args.streams, args.sequential, *args.levels)
    grounded, chat = grounded_prompts(tokenizer, n_max), chat_prompts(tokenizer, n_max)
    lengths = [len(p) for p in grounded]
    print(
        f"grounded prompts {min(lengths)}-{max(lengths)} tokens, chat prompts "
        f"{min(map(len, chat))}-{max(map(len, chat))}",
        flush=True,
    )

    def greedy(n: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=args.max_tokens) for _ in range(n)]

    def sampled(n: int, temperature: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens) for i in range(n)]

    def chat_params(n: int) -> list[SamplingParams]:
        return greedy(n) if args.chat_temperature == 0 else sampled(n, args.chat_temperature)

    # warm-up, untimed: first-call allocations, and a multi-token verification step on the speculating engines
    for name, engine in engines.items():
        warm = Driver(engine, f"warmup-{name}", grounded[:2], [SamplingParams(temperature=0, max_tokens=12)] * 2, 2)
        while not warm.done:
            warm.step()

    ks = ["off", "k2", "k4", "k6"]
    chat_label = "chat, greedy" if args.chat_temperature == 0 else f"chat, T={args.chat_temperature}"
    s = args.sequential
    one = [
        Load("grounded, greedy", grounded[:s], greedy(s), 1, ks),
        Load("grounded, T=0.7", grounded[:s], sampled(s, 0.7), 1, ks if args.all_k else ["off", "k4"]),
        Load(chat_label, chat[:s], chat_params(s), 1, ks),
    ]
    n = args.streams
    many_engines = ["off", "k2", "k4", "k6", "k4-mbs4"] if args.all_k else ["off", "k4", "k4-mbs4"]
    many = [
        Load("grounded, greedy", grounded[:n], greedy(n), n, many_engines),
        Load(chat_label, chat[:n], chat_params(n), n, many_engines),
    ]
    m = max(args.levels, default=0)  # every threshold level runs the same requests, c at a time
    levels = {
        c: [
            Load("grounded, greedy", grounded[:m], greedy(m), c, ["off", "k4"]),
            Load(chat_label, chat[:m], chat_params(m), c, ["off", "k4"]),
        ]
        for c in args.levels
    }
    bench_started = time.perf_counter()
    for load in one + many + [x for ls in levels.values() for x in ls]:
        run_rounds(engines, load, args.rounds)

    print_table(f"1 stream: {s} requests one after another", one, labels)
    print_table(f"{n} streams at once", many, labels)

    # threshold: k=4 forced on against off, by concurrent streams
    print("\n## Batch-size threshold: k=4 forced on (max_batch_size 64) against off, output tok/s\n")
    print(
        f"n streams: the first {m} requests of each workload, n at a time (the next one added when one finishes); "
        f"row 1 is the 1-stream table ({s} requests), row {n} the {n}-stream table.\n"
    )
    print(
        f"| streams | grounded off | grounded k=4 | ratio | acceptance | {chat_label} off | k=4 | ratio | acceptance |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows: list[tuple[int, list[Load]]] = [(1, [one[0], one[2]])] + sorted(levels.items()) + [(n, many)]
    pays: list[int] = []
    for c, (g, ch) in rows:
        cells, ok = [], True
        for load in (g, ch):
            off, on = tps(load.runs["off"]), tps(load.runs["k4"])
            ok &= on >= off
            cells += [f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x", acceptance(load.runs["k4"])[0]]
        print(f"| {c} | " + " | ".join(cells) + " |")
        if ok:
            pays.append(c)
    threshold = 0
    for c, _ in rows:  # the largest level up to which every level paid for both workloads
        if c not in pays:
            break
        threshold = c
    print(
        f"\nthreshold (largest batch where speculation still pays for both workloads, every smaller level too): "
        f"{threshold or 'none'}"
    )

    # issue 16's goals
    def ratios(load: Load) -> str:
        return ", ".join(f"{labels[k]} {tps(load.runs[k]) / tps(load.runs['off']):.2f}x" for k in load.engines[1:])

    g1 = tps(one[0].runs["k4"]) / tps(one[0].runs["off"])
    c1 = tps(one[2].runs["k4"]) / tps(one[2].runs["off"])
    m_default = min(tps(x.runs["k4-mbs4"]) / tps(x.runs["off"]) for x in many)
    m_forced = min(tps(x.runs["k4"]) / tps(x.runs["off"]) for x in many)
    print("\nissue 16 goals (k=4):")
    print(f"- 1 stream, grounded greedy >= 1.8x: {g1:.2f}x {'met' if g1 >= 1.8 else 'NOT met'} ({ratios(one[0])})")
    print(f"- 1 stream, chat >= 1.0x: {c1:.2f}x {'met' if c1 >= 1.0 else 'NOT met'} ({ratios(one[2])})")
    print(
        f"- {n} streams >= 0.95x (lower workload): default max_batch_size {DEFAULT_MAX_BATCH} {m_default:.2f}x "
        f"{'met' if m_default >= 0.95 else 'NOT met'}; "
        f"forced on {m_forced:.2f}x {'met' if m_forced >= 0.95 else 'NOT met'}"
    )
    print(f"\nload average at end {os.getloadavg()[0]:.1f}; loads took {time.perf_counter() - bench_started:.0f} s")
    sample = one[0].runs["k4"][0].tokens[0]
    print(f"example grounded output: {tokenizer.decode(sample, skip_special_tokens=True)[:160]!r}...")


if __name__ == "__main__":
    main()
