"""One request's state inside the engine, and the plain dataclasses that cross the engine's boundary."""

import enum
import time
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

from model.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import xgrammar

__all__ = ["SamplingParams", "TokenLogprob", "StepOutput", "Sequence", "SequenceStatus"]


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos / stop id), "length", "abort"; None = still running
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    queue_time: float | None = None  # on a request's first output: seconds from add_request to its first step


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_counter = count()


class Sequence:
    """One request's tokens, KV blocks and progress. `num_computed_tokens` tokens already have KV in the cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # from the prefix cache at the last admission
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        # Advanced with every sampled token. A preempted sequence keeps its output tokens and recomputes their KV,
        # so its matcher stays in step with them and never needs a rollback.
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.spec_token_ids: list[int] = []  # proposed next tokens, checked by this step's forward (not yet output)
        self.spec_misses = 0  # proposals rejected whole, in a row
        self.spec_pause = 0  # decode steps left without proposals (backing off after misses)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
