"""Structured output (xgrammar) against the same load unconstrained, in one process on one engine (issue 14).

    .venv/bin/python bench/structured_output.py                              # 16 streams, 2 rounds
    .venv/bin/python bench/structured_output.py --streams 16 --rounds 3 -- --num-threads 1

1. Compile time of a typical JSON schema (6 properties: bounded strings, an integer range, an enum, an array with
   maxItems, a nested object): first use (a new spec, a cache miss; median over --compile-samples schemas that
   differ in their property names) and cached (`GrammarCache.lookup` hit).
2. Loads of --streams concurrent requests with the same chat-templated prompts ("Describe city #i as JSON ..."),
   temperature --temperature with a seed per stream, stepped through `Engine.step()` in this thread:
     unconstrained    no grammar, EOS ignored, each stream's max_tokens = the length its shared-schema output had
                      in an untimed calibration pass (so both loads generate the same tokens per stream)
     shared schema    every stream the same schema, compiled before the timer starts (a cache hit)
     16 schemas       a distinct, new schema per stream (the shared one with its properties renamed by synonyms,
                      so outputs stay about as long), compiled inside the timed window: 16 cache misses,
                      serially, before the first step (a server compiles in its routes, alongside the engine)
     16 precompiled   new distinct schemas again, compiled before the timer starts
   Constrained requests stop at the grammar's end (EOS); --max-tokens (128) only catches a runaway: a complete
   object is ~70-95 tokens with this model, and one cut short is counted, not validated.
   The loads alternate in order over --rounds (forward, then reversed); the table shows medians. Output tok/s =
   generated tokens / (first add to last token); decode tok/s leaves out the steps until every stream had a token.
3. Every finished constrained output is decoded and checked with `jsonschema` against its schema.
4. A profile pass at --streams: perf_counter accumulators monkeypatched (here, not in the library) around the
   matcher's fill_next_token_bitmask / accept_token / is_terminated, the bitmask allocation and apply, the sampler
   and the model runner, per engine step, for the shared-schema, distinct-schema and unconstrained loads.

Flags after `--` are `llmserve serve` flags (Settings). On a shared 2-core machine compare rows of one run."""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jsonschema  # noqa: E402
import torch  # noqa: E402
import xgrammar  # noqa: E402
from engine_throughput import LevelResult, bench_settings  # noqa: E402  (its tok/s, decode tok/s and ms/step definitions)

import model.engine.engine as engine_module  # noqa: E402
import model.engine.model_runner as runner_module  # noqa: E402
import model.layers.sampler as sampler_module  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.sampling_params import SamplingParams  # noqa: E402
from model.structured_output import GrammarSpec  # noqa: E402

CLIMATES = ["arid", "temperate", "tropical", "continental", "polar", "mediterranean"]


# Property names by variant: schema `i` takes synonym (i // 3**k) % 3 for property k, so variants 0..728 are all
# different specs (each a cache miss and a grammar of its own) whose JSON is about as long as variant 0's.
SYNONYMS = [
    ("name", "city", "title"),
    ("country", "nation", "state"),
    ("population", "inhabitants", "residents"),
    ("climate", "weather", "zone"),
    ("landmarks", "sights", "attractions"),
    ("mayor", "leader", "governor"),
]


def city_schema(variant: int = 0) -> dict:
    """A typical response schema, every value bounded so a 135M model closes the object; variant 0 is the shared
    one, others rename its properties."""
    name, country, population, climate, landmarks, mayor = (
        syn[(variant // 3**k) % 3] for k, syn in enumerate(SYNONYMS)
    )
    short = {"type": "string", "minLength": 1, "maxLength": 12}
    return {
        "type": "object",
        "properties": {
            name: short,
            country: short,
            population: {"type": "integer", "minimum": 0, "maximum": 40_000_000},
            climate: {"type": "string", "enum": CLIMATES},
            landmarks: {"type": "array", "items": short, "minItems": 1, "maxItems": 2},
            mayor: {
                "type": "object",
                "properties": {"name": short, "since": {"type": "integer", "minimum": 1900, "maximum": 2026}},
                "required": ["name", "since"],
                "additionalProperties": False,
            },
        },
        "required": [name, country, population, climate, landmarks, mayor],
        "additionalProperties": False,
    }


def city_prompts(engine: Engine, n: int) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Describe city #{i + 1} as JSON: its name, country, population, climate, "
                    "one or two landmarks, and its mayor.",
                }
            ]
        )
        for i in range(n)
    ]


# ---- compile time ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class CompileTimes:
    cache_build_ms: float | None  # the engine's GrammarCache (xgrammar's vocabulary view), built on first use
    first_in_process_ms: float
    first_use_ms: list[float]  # one per new schema
    lookup_hit_us: float  # GrammarCache.lookup of a cached spec
    request_hit_us: float  # GrammarSpec.json_schema(dict) + compile() on a hit: what a request with a known schema pays
    matcher_us: float  # a GrammarMatcher from the compiled grammar (the engine makes one per sequence)


def measure_compile(engine: Engine, samples: int) -> CompileTimes:
    ready = getattr(engine, "grammars_ready", True)  # the engine builds its cache on the first constrained request
    started = time.perf_counter()
    cache = engine.grammars
    build_ms = None if ready else 1e3 * (time.perf_counter() - started)

    def compile_ms(variant: int) -> float:
        spec = GrammarSpec.json_schema(city_schema(variant))
        assert cache.lookup(spec) is None, "expected a new spec"
        started = time.perf_counter()
        cache.compile(spec)
        return 1e3 * (time.perf_counter() - started)

    first = compile_ms(1)  # the process's first JSON-schema compile, shown apart in case it pays one-time costs
    first_use = [compile_ms(2 + i) for i in range(samples)]
    schema = city_schema(2)
    spec = GrammarSpec.json_schema(schema)
    reps = 2000
    started = time.perf_counter()
    for _ in range(reps):
        cache.lookup(spec)
    lookup_us = 1e6 * (time.perf_counter() - started) / reps
    started = time.perf_counter()
    for _ in range(reps):
        cache.compile(GrammarSpec.json_schema(schema))
    request_us = 1e6 * (time.perf_counter() - started) / reps
    constraint = cache.lookup(spec)
    started = time.perf_counter()
    for _ in range(200):
        engine_module.new_matcher(constraint)
    matcher_us = 1e6 * (time.perf_counter() - started) / 200
    return CompileTimes(build_ms, first, first_use, lookup_us, request_us, matcher_us)


# ---- loads -------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class LoadRun:
    result: LevelResult
    tokens: list[list[int]]
    finish: list[str]
    schemas: list[dict | None]
    compile_ms: float = 0.0  # compile time inside the timed window


def run_load(
    engine: Engine,
    name: str,
    prompts: list[list[int]],
    make_params: Callable[[int], SamplingParams],
    schemas: list[dict | None],
) -> LoadRun:
    """Submit every stream (make_params runs inside the timed window, so a compile there is counted), then step
    until all finish."""
    n = len(prompts)
    misses, compile_s = engine.grammars.misses, engine.grammars.compile_seconds_total
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{name}-{i}", ids, make_params(i))
    engine._drain_inbox(False)  # the step loop's own intake, without its worker thread
    index = {f"{name}-{i}": i for i in range(n)}
    tokens: list[list[int]] = [[] for _ in range(n)]
    finish = [""] * n
    seen: set[int] = set()
    prefill_done = 0.0
    steps = decode_steps = output_tokens = decode_tokens = batch_sum = 0
    while engine.scheduler.has_work():
        outs = engine.step()
        steps += 1
        new = 0
        for o in outs:
            i = index[o.request_id]
            tokens[i].extend(o.new_token_ids)
            new += len(o.new_token_ids)
            if o.finish_reason is not None:
                finish[i] = o.finish_reason
        output_tokens += new
        if prefill_done:
            decode_steps += 1
            decode_tokens += new
            batch_sum += len(outs)
        else:
            seen.update(index[o.request_id] for o in outs)
            if len(seen) == n:
                prefill_done = time.perf_counter() - started
    seconds = time.perf_counter() - started
    result = LevelResult(
        concurrency=n,
        prompt_tokens=sum(map(len, prompts)) // n,
        output_tokens=output_tokens,
        seconds=seconds,
        prefill_seconds=prefill_done,
        decode_tokens=decode_tokens,
        steps=steps,
        decode_steps=decode_steps,
        mean_batch=batch_sum / max(decode_steps, 1),
    )
    compiled_ms = 1e3 * (engine.grammars.compile_seconds_total - compile_s) if engine.grammars.misses > misses else 0.0
    return LoadRun(result, tokens, finish, schemas, compiled_ms)


@dataclass(slots=True)
class Validation:
    finished: int = 0
    valid: int = 0
    by_length: int = 0  # hit max_tokens: an unfinished object
    errors: list[str] = field(default_factory=list)


def validate(engine: Engine, run: LoadRun, into: Validation) -> None:
    for toks, reason, schema in zip(run.tokens, run.finish, run.schemas, strict=True):
        if schema is None:
            continue
        if reason != "stop":
            into.by_length += 1
            continue
        into.finished += 1
        text = engine.tokenizer.decode(toks, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), schema)
            into.valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            into.errors.append(f"{text!r}: {str(exc).splitlines()[0]}")


# ---- profile -----------------------------------------------------------------------------------------------------
class Accumulators:
    """perf_counter totals around library calls, installed by monkeypatching and removed by restore()."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        raw = vars(owner).get(attr, original)  # a classmethod as defined, for restore()
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started
                calls[label] += 1

        self._undo.append((owner, attr, raw))
        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


PROFILED = [  # (owner, attribute, label); the first three are what a constraint adds to a step
    (xgrammar.GrammarMatcher, "fill_next_token_bitmask", "fill_next_token_bitmask"),
    (xgrammar, "apply_token_bitmask_inplace", "apply_token_bitmask_inplace"),
    (xgrammar.GrammarMatcher, "accept_token", "accept_token"),
    (xgrammar.GrammarMatcher, "is_terminated", "is_terminated"),
    (xgrammar, "allocate_token_bitmask", "allocate_token_bitmask"),
    (sampler_module, "apply_penalties", "apply_penalties (logits clone + mask)"),
    (sampler_module.Sampler, "forward", "Sampler.forward"),
    (runner_module.SamplingBatch, "build", "SamplingBatch.build"),
    (runner_module.ModelRunner, "run", "ModelRunner.run"),
    (Engine, "step", "Engine.step"),
]


def profile(
    engine: Engine,
    prompts: list[list[int]],
    loads: list[tuple[str, Callable[[int], SamplingParams], list[dict | None]]],
) -> None:
    """One pass of each load with the accumulators in; ms per step of each wrapped call, load by load."""
    acc = Accumulators()
    for owner, attr, label in PROFILED:
        acc.wrap(owner, attr, label)
    rows: list[tuple[str, dict[str, float], dict[str, int], LevelResult]] = []
    try:
        for name, make, schemas in loads:
            acc.reset()
            run = run_load(engine, f"profile-{name}", prompts, make, schemas)
            rows.append((name, dict(acc.seconds), dict(acc.calls), run.result))
    finally:
        acc.restore()
    print(
        f"\n## Where a constraint's time goes: {len(prompts)} streams, one pass of each load, ms per engine step "
        "(perf_counter around each call)\n"
    )
    print("| call | " + " | ".join(name for name, *_ in rows) + " | µs/call (first load) |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for _, _, label in PROFILED:
        cells = [f"{1e3 * sec.get(label, 0.0) / res.steps:.2f}" for _, sec, _, res in rows]
        _, sec, calls, _ = rows[0]
        print(
            f"| {label} | " + " | ".join(cells) + f" | {1e6 * sec.get(label, 0.0) / max(calls.get(label, 0), 1):.0f} |"
        )
    print(
        "| steps (tokens/req mean) | "
        + " | ".join(f"{res.steps} ({res.output_tokens / res.concurrency:.0f})" for *_, res in rows)
        + " | |"
    )
    grammar_calls = (
        "fill_next_token_bitmask",
        "apply_penalties (logits clone + mask)",
        "accept_token",
        "is_terminated",
        "allocate_token_bitmask",
    )
    print()
    for name, sec, _calls, res in rows:
        grammar = sum(sec.get(k, 0.0) for k in grammar_calls)
        print(
            f"{name}: constraint work (fill + alloc + clone/apply + accept + is_terminated) "
            f"{1e3 * grammar / res.steps:.2f} ms/step = {100 * grammar / sec['Engine.step']:.0f} % of Engine.step "
            f"({1e3 * sec['Engine.step'] / res.steps:.1f} ms)"
        )


# ---- main --------------------------------------------------------------------------------------------------------
def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests per load")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="max_tokens of a constrained request (a complete object is ~50-90 tokens)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="times every load runs (order alternates); medians reported"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy; otherwise seeded per stream")
    parser.add_argument("--compile-samples", type=int, default=8, help="new schemas timed for first-use compile")
    parser.add_argument("--no-profile", action="store_true", help="skip the profile pass")
    args = parser.parse_args(own)

    settings = bench_settings(["serve", *server_flags])
    engine = Engine(settings)
    print(f"# structured output\n\n{engine.describe()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; xgrammar {xgrammar_version()}"
    )
    print(
        f"{args.streams} streams, temperature {args.temperature} (seed = stream), "
        f"max_tokens {args.max_tokens} constrained, "
        f"{args.rounds} rounds, max_num_batched_tokens={settings.max_num_batched_tokens}\n"
    )

    # 1. compile time
    ct = measure_compile(engine, args.compile_samples)
    print(f"## Schema compile (6 properties, nested object; grammar cache of {settings.grammar_cache_size})\n")
    print("| | ms |\n|---|---:|")
    if ct.cache_build_ms is not None:
        print(
            "| grammar cache built (the first constrained request only: tokenizer info for xgrammar) "
            f"| {ct.cache_build_ms:.0f} |"
        )
    print(f"| first JSON-schema compile in the process | {ct.first_in_process_ms:.1f} |")
    print(
        f"| first use of a new schema, median of {len(ct.first_use_ms)} (min-max) "
        f"| {statistics.median(ct.first_use_ms):.1f} "
        f"({min(ct.first_use_ms):.1f}-{max(ct.first_use_ms):.1f}) |"
    )
    print(f"| cached: `lookup` hit | {ct.lookup_hit_us / 1e3:.4f} |")
    print(f"| cached: `GrammarSpec.json_schema(dict)` + `compile` hit | {ct.request_hit_us / 1e3:.4f} |")
    print(f"| a GrammarMatcher per sequence | {ct.matcher_us / 1e3:.4f} |")
    print(
        "\nissue 14 goal: first-use compile < 50 ms -> "
        f"{'met' if statistics.median(ct.first_use_ms) < 50 else 'NOT met'}\n",
        flush=True,
    )

    # 2. loads
    n = args.streams
    prompts = city_prompts(engine, n)
    temp = args.temperature
    seed = None if temp == 0 else 0

    def params(i: int, max_tokens: int, constraint=None, ignore_eos: bool = False) -> SamplingParams:
        return SamplingParams(
            temperature=temp,
            seed=None if seed is None else i,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            constraint=constraint,
        )

    shared_schema = city_schema()
    shared = engine.grammars.compile(GrammarSpec.json_schema(shared_schema))

    def shared_params(i: int) -> SamplingParams:
        return params(i, args.max_tokens, engine.grammars.compile(GrammarSpec.json_schema(shared_schema)))

    # untimed calibration (and warm-up: allocations, prefix cache of the prompts): each stream's constrained length
    calib = run_load(engine, "calibrate", prompts, shared_params, [shared_schema] * n)
    lengths = [len(t) for t in calib.tokens]
    print(
        f"calibration (shared schema, untimed): tokens per stream {min(lengths)}-{max(lengths)}, median "
        f"{statistics.median(lengths):.0f}; {sum(r == 'length' for r in calib.finish)} of {n} hit max_tokens\n",
        file=sys.stderr,
    )

    def plain_params(i: int) -> SamplingParams:
        return params(i, lengths[i], ignore_eos=True)

    loads = ["unconstrained", "shared schema", f"{n} schemas, compiled in load", f"{n} schemas, precompiled"]
    runs: dict[str, list[LoadRun]] = {name: [] for name in loads}
    next_variant = 2 + args.compile_samples  # variants 1.. went to the compile timings; each load takes new ones
    checks: dict[str, Validation] = {name: Validation() for name in loads[1:]}
    for r in range(args.rounds):
        order = loads if r % 2 == 0 else loads[::-1]
        for name in order:
            if name == "unconstrained":
                make, schemas = plain_params, [None] * n
            elif name == "shared schema":
                assert engine.grammars.lookup(shared.spec) is not None
                make, schemas = shared_params, [shared_schema] * n
            else:
                precompiled = name.endswith("precompiled")
                schemas = [city_schema(next_variant + i) for i in range(n)]
                next_variant += n
                specs = [GrammarSpec.json_schema(s) for s in schemas]
                assert all(engine.grammars.lookup(s) is None for s in specs)
                if precompiled:
                    for s in specs:
                        engine.grammars.compile(s)

                def make(i: int, specs=specs) -> SamplingParams:
                    return params(i, args.max_tokens, engine.grammars.compile(specs[i]))

            run = run_load(engine, f"r{r}-{name}", prompts, make, schemas)
            runs[name].append(run)
            if name in checks:
                validate(engine, run, checks[name])
            print(
                f"  round {r + 1}: {name}: {run.result.output_tps:.1f} output tok/s, "
                f"{run.result.output_tokens} tokens, "
                f"{run.result.seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    base = statistics.median(x.result.output_tps for x in runs["unconstrained"])
    base_dec = statistics.median(x.result.decode_tps for x in runs["unconstrained"])
    print(f"## Loads: {n} streams, median of {args.rounds} rounds\n")
    print(
        "| load | tokens/req (mean) | hit max_tokens | valid JSON / finished | compile in window ms | output tok/s | "
        "decode tok/s | ms/decode step | output vs unconstrained | decode vs unconstrained |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in loads:
        rs = runs[name]
        tps = statistics.median(x.result.output_tps for x in rs)
        dec = statistics.median(x.result.decode_tps for x in rs)
        ms = statistics.median(x.result.ms_per_decode_step for x in rs)
        toks = statistics.mean(x.result.output_tokens for x in rs) / n
        lim = (
            "- (matched)"
            if name == "unconstrained"
            else f"{sum(f == 'length' for x in rs for f in x.finish)}/{n * len(rs)}"
        )
        cmp_ms = statistics.median(x.compile_ms for x in rs)
        v = checks.get(name)
        valid = f"{v.valid}/{v.finished}" if v else "-"
        print(
            f"| {name} | {toks:.1f} | {lim} | {valid} | {cmp_ms:.0f} | {tps:.1f} | {dec:.1f} | {ms:.1f} | "
            f"{tps / base:.2f}x | {dec / base_dec:.2f}x |"
        )
    ratio = statistics.median(x.result.output_tps for x in runs["shared schema"]) / base
    print(
        f"\nissue 14 goal: {n} streams, cached schema >= 0.9x unconstrained -> {ratio:.2f}x, "
        f"{'met' if ratio >= 0.9 else 'NOT met'}"
    )
    print(
        f"grammar cache: {engine.grammars.hits} hits, {engine.grammars.misses} misses, {len(engine.grammars)} entries"
    )
    print(
        f"jsonschema: {sum(v.valid for v in checks.values())} of {sum(v.finished for v in checks.values())} finished "
        f"constrained outputs valid; {sum(v.by_length for v in checks.values())} cut at max_tokens (not checked)"
    )
    for v in checks.values():
        for e in v.errors[:3]:
            print(f"  invalid: {e}")
    sample = runs["shared schema"][0]
    print(f"example output: {engine.tokenizer.decode(sample.tokens[0], skip_special_tokens=True)}", flush=True)

    # 4. profile
    if not args.no_profile:
        schemas = [city_schema(next_variant + i) for i in range(n)]
        specs = [engine.grammars.compile(GrammarSpec.json_schema(x)).spec for x in schemas]

        def distinct_params(i: int) -> SamplingParams:
            return params(i, args.max_tokens, engine.grammars.compile(specs[i]))

        profile(
            engine,
            prompts,
            [
                ("shared schema", shared_params, [shared_schema] * n),
                (f"{n} schemas, precompiled", distinct_params, schemas),
                ("unconstrained", plain_params, [None] * n),
            ],
        )


def xgrammar_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


if __name__ == "__main__":
    main()
