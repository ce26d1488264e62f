"""Engine: owns the scheduler and the model runner, and runs the step loop in one worker thread.

Other threads talk to it through a thread-safe inbox (add / abort); outputs leave through the `on_outputs`
callback, called from the worker thread after every step."""

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Settings
from model.engine.block_manager import BlockManager
from model.engine.draft import DraftProposer
from model.engine.model_runner import ModelRunner
from model.engine.scheduler import Scheduler, SchedulerOutput
from model.engine.sequence import SamplingParams, Sequence, StepOutput
from model.engine.speculative import NgramProposer, SpeculativeConfig
from model.engine.workers import WorkerGroup
from model.parallel import SINGLE, TensorParallel
from model.structured_output import GrammarCache, GrammarError, new_matcher, tokenizer_info
from model.tokenizer import Tokenizer

log = logging.getLogger("llmserve.engine")


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    is_alive: bool
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    grammar_cache_entries: int = 0
    spec_drafts: int = 0  # steps in which a sequence had proposals checked
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    error: str | None = None  # why the worker thread stopped, once it has (a tensor-parallel rank died, ...)
    tensor_parallel_size: int = 1
    all_reduce_seconds: float = 0.0  # rank 0's time inside all-reduces, waiting for the other ranks included
    decode_step: str = "eager"  # compiling (eager steps serve meanwhile), compiled, or eager


@dataclass(slots=True)
class StepRecord:
    """What one step ran, for tests and the benchmark: (request id, tokens) per scheduled sequence."""

    rows: list[tuple[str, int]]
    num_preempted: int


class Engine:
    def __init__(
        self,
        settings: Settings,
        tokenizer: Tokenizer | None = None,
        record_steps: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        """`tp`: a tensor-parallel group whose process group and other ranks the caller runs (tests); without it,
        --tensor-parallel-size > 1 starts the other ranks here (model/engine/workers.py)."""
        self.settings = settings
        self.tokenizer = tokenizer or Tokenizer.load(
            settings.model_path, settings.chat_template, Path(settings.cache_dir) if settings.cache_dir else None
        )
        self.workers: WorkerGroup | None = None
        if tp is None and settings.tensor_parallel_size > 1:
            self.workers = WorkerGroup(settings)  # the other ranks load their slices while this one loads its own
            tp = self.workers.tp
        try:
            self.runner = ModelRunner(settings, sorted(self.tokenizer.eos_token_ids), tp or SINGLE)
            if self.workers is not None:
                self.workers.connect()
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(None)
            raise
        self.eos_token_ids = set(self.runner.eos_token_ids)  # one list for stopping and for min_tokens masking
        self._grammars: GrammarCache | None = None
        self.speculative = SpeculativeConfig.parse(settings.speculative_config)
        self.proposer: NgramProposer | DraftProposer | None = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            self.proposer = DraftProposer(
                self.speculative, settings, self.runner.config.vocab_size, self.runner.eos_token_ids
            )
        elif self.speculative is not None:
            self.proposer = NgramProposer(self.speculative)
        if self.speculative is not None:
            log.info(
                "speculative decoding: %s, %d tokens, while at most %d sequences run",
                self.speculative.method,
                self.speculative.num_speculative_tokens,
                self.speculative.max_batch_size,
            )
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            settings.long_prefill_token_threshold,
        )
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._sequences: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.is_alive = False
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.failure: str | None = None
        self.step_records: list[StepRecord] | None = [] if record_steps else None

    @property
    def grammars(self) -> GrammarCache:
        """Built on the first constrained request: start-up pays nothing for it. GrammarError when xgrammar cannot
        read this tokenizer's vocabulary (a constrained request's 400; the rest serves on)."""
        if self._grammars is None:
            try:
                info = tokenizer_info(self.tokenizer.hf, self.runner.config.vocab_size, self.runner.eos_token_ids)
            except Exception as exc:  # noqa: BLE001 - any failure of the vocabulary conversion means the same
                raise GrammarError(f"structured output is unavailable for this tokenizer: {exc}") from exc
            self._grammars = GrammarCache(info, self.settings.grammar_cache_size)
        return self._grammars

    @property
    def grammars_ready(self) -> bool:
        return self._grammars is not None

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def describe(self) -> str:
        c = self.runner.config
        return (
            f"model={self.settings.model_path} arch={c.architecture} layers={c.num_layers} "
            f"heads={c.num_heads}/{c.num_kv_heads} "
            f"dtype={str(self.runner.dtype).removeprefix('torch.')} device={self.runner.device} "
            f"attention={self.runner.attention_backend} kv_cache={self.block_manager.num_blocks} blocks x "
            f"{self.block_manager.block_size} tokens = {self.kv_capacity_tokens} tokens "
            f"in {str(self.runner.kv_dtype).removeprefix('torch.')} "
            f"max_model_len={self.max_model_len} "
            + (f"tensor_parallel={self.runner.tp.world_size} " if self.runner.tp.world_size > 1 else "")
            + f"loaded in {self.runner.load_seconds:.1f}s"
            + (f", decode step compiled in {self.runner.compile_seconds:.1f}s" if self.runner.compile_seconds else "")
        )

    # ---- called from any thread -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request could never run, whatever else is in flight."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were requested "
                f"({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion)"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"the request needs {total} tokens of KV cache but the server holds {self.kv_capacity_tokens}"
            )
        vocab = self.runner.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_token_ids, params)
        self._inbox.put(("add", Sequence(request_id, prompt_token_ids, params)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def start(self, on_outputs: Callable[[list[StepOutput]], None]) -> None:
        self._on_outputs = on_outputs
        self.is_alive = True
        self._thread = threading.Thread(target=self._loop, name="llmserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.is_alive = False
        healthy = self.failure is None
        if self.workers is not None:
            self.workers.shutdown(self.runner if healthy else None)
        elif healthy and self.runner.tp.world_size > 1:
            self.runner.stop_workers()  # the caller's ranks return from follow()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=sum(len(s) for s in list(self.scheduler.waiting)),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
            is_alive=self.is_alive,
            grammar_cache_hits=self._grammars.hits if self._grammars else 0,
            grammar_cache_misses=self._grammars.misses if self._grammars else 0,
            grammar_cache_entries=len(self._grammars) if self._grammars else 0,
            spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            error=self.failure,
            tensor_parallel_size=self.runner.tp.world_size,
            all_reduce_seconds=self.runner.tp.stats.all_reduce_seconds,
            decode_step=self.runner.decode_step_state,
        )

    # ---- worker thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop.is_set():
                if self.workers is not None:
                    self.workers.check()  # a rank that died while this one waited or computed
                if not self.scheduler.has_work() and (self.num_steps or time.monotonic() - started > 3):
                    self.runner.start_compile()  # idle after the first answers, or 3 s without any request
                outputs = self._drain_inbox(block=not self.scheduler.has_work())
                if self.scheduler.has_work():
                    outputs += self.step()
                else:
                    self.runner.keepalive()
                if outputs:
                    self._on_outputs(outputs)
        except Exception as exc:
            self.failure = self.workers.explain(exc) if self.workers is not None else f"{type(exc).__name__}: {exc}"
            log.exception("engine step failed; the engine is stopping: %s", self.failure)
            raise
        finally:
            self.is_alive = False

    def _drain_inbox(self, block: bool) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return outputs
            block = False
            if kind == "add":
                assert isinstance(item, Sequence)
                self._add(item)
            elif kind == "abort":
                assert isinstance(item, str)
                seq = self._sequences.pop(item, None)
                if seq is not None:
                    self.scheduler.remove(seq)
                    self._generators.pop(item, None)
                    if self.proposer is not None:
                        self.proposer.release({item})
                    outputs.append(StepOutput(item, [], "abort", None, seq.num_prompt_tokens, seq.num_cached_tokens))

    def _add(self, seq: Sequence) -> None:
        self._sequences[seq.request_id] = seq
        if seq.params.constraint is not None:
            seq.matcher = new_matcher(seq.params.constraint)
        if seq.params.seed is not None:
            self._generators[seq.request_id] = torch.Generator(device=self.runner.device).manual_seed(seq.params.seed)
        self.prompt_tokens_total += seq.num_prompt_tokens
        self.scheduler.add(seq)

    def _propose(self) -> None:
        """Proposed next tokens for each decoding sequence, while the batch is small enough for them to pay."""
        if self.proposer is None or self.speculative is None:
            return
        running = self.scheduler.running
        if len(running) > self.speculative.max_batch_size:
            self.proposer.release()  # a draft model's KV is rebuilt when speculation resumes
            return
        rows = []
        for seq in running:
            if seq.num_computed_tokens != len(seq) - 1:
                continue  # still in its prompt
            if seq.spec_pause:
                seq.spec_pause -= 1
                continue
            # room for every proposal and the token after them, within max_tokens and the context
            limit = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
            rows.append((seq, limit))
        self.proposer.retain({seq.request_id for seq, _ in rows})
        for (seq, _), proposals in zip(rows, self.proposer.propose_batch(rows), strict=True):
            seq.spec_token_ids = proposals

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, and return what each sampling sequence produced."""
        if not self.scheduler.running:
            self.runner.activate_compiled()  # between requests: no running sequence changes kernels halfway
        self._propose()
        sched: SchedulerOutput = self.scheduler.schedule()
        self.num_steps += 1
        if self.step_records is not None:
            self.step_records.append(
                StepRecord([(s.seq.request_id, s.num_tokens) for s in sched.scheduled], sched.num_preempted)
            )
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        generators = [self._generators.get(s.seq.request_id) for s in sched.scheduled if s.samples]
        result = self.runner.run(sched.scheduled, generators)
        sampled = result.tokens if result is not None else []
        rows = self.scheduler.postprocess(sched, sampled)
        outputs = []
        for i, s in enumerate(rows):
            seq, new = s.seq, sampled[i]
            if s.num_spec:
                self.spec_drafts += 1
                self.spec_draft_tokens += s.num_spec
                self.spec_accepted_tokens += len(new) - 1
                # A sequence whose proposals keep failing (open-ended chat) pauses proposing for 1, 3, 7, ... up to
                # 63 steps: checking proposals makes a step ~12 % slower, which only accepted tokens pay back.
                seq.spec_misses = 0 if len(new) > 1 else seq.spec_misses + 1
                seq.spec_pause = min(2**seq.spec_misses - 1, 63)
            reason = None
            for j, token in enumerate(new):  # the first token that ends the sequence drops the ones after it
                reason = self._finish_reason(seq, token, len(seq) - len(new) + j + 1)
                if reason is not None:
                    del seq.token_ids[len(seq) - len(new) + j + 1 :]
                    new = new[: j + 1]
                    break
            self.generation_tokens_total += len(new)
            logprobs = None
            if result is not None and result.logprobs is not None and result.logprobs[i]:
                logprobs = result.logprobs[i][: len(new)]
            out = StepOutput(seq.request_id, new, reason, logprobs, seq.num_prompt_tokens, seq.num_cached_tokens)
            if seq.num_output_tokens == len(new) and seq.first_scheduled_time is not None:
                out.queue_time = seq.first_scheduled_time - seq.arrival_time
            outputs.append(out)
            if reason is not None:
                self.scheduler.remove(seq)
                self._sequences.pop(seq.request_id, None)
                self._generators.pop(seq.request_id, None)
                if self.proposer is not None:
                    self.proposer.release({seq.request_id})
        return outputs

    def _finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Whether `token`, the sequence's token number `length`, ends it."""
        p = seq.params
        num_output = length - seq.num_prompt_tokens
        if seq.matcher is not None:
            if not seq.matcher.accept_token(token):  # the bitmask allowed only tokens the matcher accepts
                log.error("request %s: grammar rejected sampled token %d; finishing it", seq.request_id, token)
                return "stop"
            if seq.matcher.is_terminated():  # the grammar is complete and its stop token was sampled
                return "stop"
        if num_output >= p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None
