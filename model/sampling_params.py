"""Per-request decoding parameters and per-token logprobs: plain dataclasses shared by the sampler and the engine."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.structured_output import Constraint


@dataclass(slots=True)
class SamplingParams:
    """What the sampler and the scheduler need of one request (stop *strings* live in the text emitter)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: over generated tokens
    frequency_penalty: float = 0.0  # OpenAI: over generated tokens
    repetition_penalty: float = 1.0  # HF: over prompt and generated tokens
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # eos and stop ids are suppressed until this many tokens
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k = sampled token's logprob plus the top k
    constraint: "Constraint | None" = None  # a compiled grammar the output must match (structured output, tools)

    def __post_init__(self) -> None:
        # Ranges of the OpenAI API (and vLLM's extras); the message names the parameter so the server can 400 on it.
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1 or 0 (off) or a positive number of tokens")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"{token_id} is not a token id")
            _check(-100 <= bias <= 100, "logit_bias", f"bias {bias} for token {token_id} must be in [-100, 100]")
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids (>= 0)")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "top_logprobs must be in [0, 20]")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{param}: {message}")
