"""The bridge between the engine's worker thread and the event loop.

The engine calls `on_outputs` from its worker thread after every step; one `call_soon_threadsafe` per step hands the
whole batch to the loop, which routes each `StepOutput` to its request's `asyncio.Queue`. Nothing on the loop ever
waits on the model. A `RequestStream` is one API request: `n` choices x prompts, each an engine request
`f"{id}-{i}"`, each with its own `TextEmitter` (stop strings, UTF-8 safety). A stop-string hit finishes the choice
with "stop" and aborts its engine request, as vLLM's output processor does.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.detokenizer import TextEmitter
from model.engine.sequence import StepOutput
from model.sampling_params import SamplingParams, TokenLogprob
from server.errors import APIError

if TYPE_CHECKING:
    from model.engine.engine import Engine
    from server.metrics import ServerMetrics

logger = logging.getLogger("llmserve.server")


class EngineDeadError(APIError):
    def __init__(self, reason: str | None = None) -> None:
        because = f" ({reason})" if reason else ""
        super().__init__(
            503, f"the inference engine has stopped{because}; the server must be restarted", code="engine_dead"
        )


@dataclass(slots=True)
class Delta:
    """What one engine step gave one choice, turned into text."""

    index: int  # choice index: prompt_index * n + sample_index
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class _Choice:
    engine_id: str
    emitter: TextEmitter
    prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    pending: bool = False  # counted in AsyncEngine.num_pending (added, no token yet)


class RequestStream:
    """One API request's choices; iterate for `Delta`s; `close()` aborts whatever has not finished."""

    def __init__(self, engine: "AsyncEngine", request_id: str, choices: list[_Choice], n: int) -> None:
        self._engine = engine
        self.request_id = request_id
        self._choices = choices
        self.n = n
        self._queue: asyncio.Queue[tuple[int, StepOutput] | BaseException] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.completion_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self._choices)

    @property
    def num_choices(self) -> int:
        return len(self._choices)

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens; a prompt sampled n times is counted once, as OpenAI does."""
        firsts = self._choices[:: self.n]
        return sum(c.prompt_tokens for c in firsts), self.completion_tokens, sum(c.cached_tokens for c in firsts)

    def _put(self, item: tuple[int, StepOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            choice = self._choices[index]
            if choice.finished:  # the engine's answer to our own abort after a stop string
                continue
            yield self._to_delta(index, choice, out)

    def _to_delta(self, index: int, choice: _Choice, out: StepOutput) -> Delta:
        now = time.monotonic()
        metrics = self._engine.metrics
        if out.new_token_ids:
            if choice.first_token_time is None:
                choice.first_token_time = now
                choice.cached_tokens = out.num_cached_tokens
                if metrics:
                    metrics.ttft.observe(now - self.arrival)
                    # Only the engine knows when it first scheduled the request; observed once StepOutput says so.
                    queue_time = getattr(out, "queue_time", None)
                    if queue_time is not None:
                        metrics.queue_time.observe(queue_time)
            elif metrics and choice.last_token_time is not None:
                per_token = (now - choice.last_token_time) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    metrics.itl.observe(per_token)
            choice.last_token_time = now
        text, used = choice.emitter.push_until_stop(out.new_token_ids)
        token_ids, logprobs = out.new_token_ids[:used], out.logprobs[:used] if out.logprobs else out.logprobs
        self.completion_tokens += len(token_ids)  # tokens past a stop string were never part of the answer
        finish = out.finish_reason
        if choice.emitter.stopped:
            if finish is None:  # the engine does not know about stop strings: free its blocks now
                self._engine.abort_engine_request(choice.engine_id)
            finish = "stop"
        elif finish is not None:
            # A character cut in half by max_tokens can never be completed: drop it rather than send U+FFFD
            # (the tokens still count in usage, and logprobs still show their bytes).
            text += choice.emitter.flush().rstrip("\ufffd")
        if finish is not None:
            self._finish(choice, finish)
        return Delta(
            index,
            text,
            list(token_ids),
            logprobs,
            finish,
            out.num_prompt_tokens or choice.prompt_tokens,
            out.num_cached_tokens,
        )

    def _finish(self, choice: _Choice, reason: str) -> None:
        choice.finished = True
        self._engine.forget(choice.engine_id)
        if self._engine.metrics:
            self._engine.metrics.finished(reason)
            if self.finished:
                self._engine.metrics.e2e.observe(time.monotonic() - self.arrival)

    def close(self) -> bool:
        """Abort every unfinished choice (client gone, error); True when anything had to be aborted."""
        aborted = False
        for choice in self._choices:
            if not choice.finished:
                aborted = True
                self._engine.abort_engine_request(choice.engine_id)
                self._finish(choice, "abort")
        return aborted


class AsyncEngine:
    """Owns the request-id -> queue routing; thread-safe entry point is only `_on_outputs`."""

    def __init__(self, engine: "Engine", metrics: "ServerMetrics | None" = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.dead = False
        self.failure: str | None = None
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # engine request id -> (stream, choice index)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.num_pending = 0  # choices submitted that have not produced a token: queued or in prefill
        self.num_pending_tokens = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start(self._on_outputs)
        self._watchdog = asyncio.create_task(self._watch())

    def shutdown(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        self.engine.shutdown()

    def _on_outputs(self, outputs: list[StepOutput]) -> None:  # worker thread
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed between the check and the call, at shutdown
                loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:  # event loop
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # already finished on our side (stop string, client gone)
                continue
            stream, index = route
            self._unpend(stream._choices[index])  # any output means the engine has scheduled it
            stream._put((index, out))

    def _unpend(self, choice: _Choice) -> None:
        if choice.pending:
            choice.pending = False
            self.num_pending -= 1
            self.num_pending_tokens -= choice.prompt_tokens

    async def _watch(self) -> None:
        """A dead worker thread would leave every queue waiting forever: fail them all instead."""
        while True:
            await asyncio.sleep(0.5)
            stats = self.engine.stats()
            if not stats.is_alive:
                self.dead = True
                self.failure = getattr(stats, "error", None)  # why, when the engine knows (a tensor-parallel rank)
                logger.error("engine worker thread is no longer alive; failing %d requests", len(self._routes))
                for stream, _ in list(self._routes.values()):
                    stream._put(EngineDeadError(self.failure))
                return

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> RequestStream:
        """Add every choice to the engine at once (returns immediately); ValueError when one can never fit."""
        if self.dead:
            raise EngineDeadError(self.failure)
        tokenizer = self.engine.tokenizer
        choices = [
            _Choice(
                f"{request_id}-{i}",
                TextEmitter(tokenizer, stop or [], include_stop_str_in_output, skip_special_tokens),
                len(prompts[i // n]),
            )
            for i in range(len(prompts) * n)
        ]
        stream = RequestStream(self, request_id, choices, n)
        added: list[str] = []
        try:
            for i, choice in enumerate(choices):
                choice_params = params
                if params.seed is not None and i % n:  # n seeded samples must still differ from each other
                    choice_params = dataclasses.replace(params, seed=params.seed + i % n)
                self._routes[choice.engine_id] = (stream, i)
                self.engine.add_request(choice.engine_id, prompts[i // n], choice_params)
                added.append(choice.engine_id)
                choice.pending = True
                self.num_pending += 1
                self.num_pending_tokens += choice.prompt_tokens
        except BaseException:
            for engine_id in added:
                self.engine.abort(engine_id)
            for choice in choices:
                self._unpend(choice)
                self._routes.pop(choice.engine_id, None)
            raise
        return stream

    def abort_engine_request(self, engine_id: str) -> None:
        self.engine.abort(engine_id)
        route = self._routes.get(engine_id)
        if route is not None:
            self._unpend(route[0]._choices[route[1]])

    def forget(self, engine_id: str) -> None:
        route = self._routes.pop(engine_id, None)
        if route is not None:
            self._unpend(route[0]._choices[route[1]])
