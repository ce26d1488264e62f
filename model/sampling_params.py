"""Per-request decoding parameters and per-token logprobs: plain dataclasses shared by the sampler and the engine."""

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
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
