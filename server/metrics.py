"""Prometheus metrics under vLLM's names, so that existing vLLM dashboards work unchanged.

Engine-side numbers (running/waiting, KV usage, prefix cache, token totals, preemptions) are read from
`Engine.stats()` at scrape time by a custom collector, so they can never drift from the engine's own counts.
Latencies are observed by the server as outputs arrive. Each app gets its own registry (tests build several).
"""

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from model.engine.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so that histogram_quantile() over mixed fleets lines up.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], "EngineStats | None"]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:  # still loading: export nothing rather than made-up zeros
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])  # exposed as NAME_total
            family.add_metric(labels, value)
            return family

        total = max(stats.kv_blocks_total, 1)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats.kv_blocks_used / total)
        yield gauge("llmserve:kv_blocks_used", "KV-cache blocks held by requests.", stats.kv_blocks_used)
        yield gauge("llmserve:kv_blocks_total", "KV-cache blocks in all.", stats.kv_blocks_total)
        yield gauge("llmserve:num_waiting_tokens", "Prompt tokens of waiting requests.", stats.num_waiting_tokens)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Generation tokens processed.", stats.generation_tokens_total)
        yield counter("vllm:num_preemptions", "Preemptions of running requests.", stats.num_preemptions)
        yield counter(
            "llmserve:grammar_cache_hits",
            "Constraints (schemas, regexes, tool sets) found compiled.",
            stats.grammar_cache_hits,
        )
        yield counter("llmserve:grammar_cache_misses", "Constraints compiled on first use.", stats.grammar_cache_misses)
        yield gauge("llmserve:grammar_cache_entries", "Compiled grammars kept.", stats.grammar_cache_entries)
        yield counter("vllm:spec_decode_num_drafts", "Sequence-steps with proposed tokens checked.", stats.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens checked.", stats.spec_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", stats.spec_accepted_tokens)
        yield gauge(
            "llmserve:spec_decode_acceptance_rate",
            "Accepted over proposed tokens since start.",
            stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1),
        )
        yield gauge("llmserve:engine_alive", "1 while the engine worker thread runs.", 1.0 if stats.is_alive else 0.0)
        yield gauge("llmserve:tensor_parallel_size", "Ranks the model is split over.", stats.tensor_parallel_size)
        yield counter(
            "llmserve:all_reduce_seconds",
            "Rank 0's time inside tensor-parallel all-reduces, waiting for the other ranks included.",
            stats.all_reduce_seconds,
        )


class ServerMetrics:
    """The registry of one app and the handles the request path observes."""

    def __init__(self, model_name: str, stats: Callable[[], "EngineStats | None"]) -> None:
        disable_created_metrics()  # as vLLM does: the *_created series double the output and no dashboard reads them
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(
            model_name
        )
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS).labels(
            model_name
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", _REQUEST_BUCKETS
        ).labels(model_name)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival until the first engine step ran the request.",
            _REQUEST_BUCKETS,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "llmserve:client_disconnects",
            "Requests whose client went away before the answer was complete.",
            label,
            registry=self.registry,
        ).labels(model_name)
        self.rejected = Counter(
            "llmserve:requests_rejected",
            "Requests refused by admission control (429) or during shutdown (503).",
            ["model_name", "status"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):  # export zeros from the start so rate() has a baseline
            self._success.labels(model_name, reason)
        self.registry.register(_EngineCollector(model_name, stats))
        # process_resident_memory_bytes, process_virtual_memory_bytes, process_cpu_seconds_total, open fds, start
        # time (from /proc; nothing on platforms without it): the memory of a server that runs for weeks
        ProcessCollector(registry=self.registry)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
