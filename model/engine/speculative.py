"""Speculative decoding: the configuration (vLLM's `--speculative-config` JSON) and the proposers.

A proposer guesses the next few tokens of a decoding sequence; the target model then checks all of them in one
forward (the engine already runs multi-token queries for chunked prefill). Verification samples the target's own
token at every proposed position and keeps the proposals up to the first disagreement, plus that first token of
the target's: the output is exactly what the target alone would sample. Proposals are deterministic (prompt lookup,
or a draft model's greedy choice): for a one-hot proposal this is Leviathan et al.'s rejection sampling, whose
acceptance test `u < p(x)` and residual `p` without `x` are what sampling from `p` and comparing does.
"""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from model.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Speculate only while this many sequences or fewer run: past it the batch keeps the cores busy and the extra
    # positions cost more than they save (bench/speculative.py measures it).
    max_batch_size: int = 2
    model: str = ""  # draft_model: a GGUF file or Hugging Face folder with the target's vocabulary
    draft_kv_cache_memory: int = 0  # draft_model: bytes of its own KV cache; 0 = a quarter of the target's

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig | None":
        """From `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'`; empty = off."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = {"prompt_lookup": "ngram", "draft": "draft_model"}.get(raw.get("method", "ngram"), raw.get("method"))
        raw.pop("method", None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"--speculative-config: method {method!r} is not supported (use 'ngram' or 'draft_model')")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch_size"}
        if method == "draft_model":
            known |= {"model", "draft_kv_cache_memory"}
            if not raw.get("model"):
                raise ValueError("--speculative-config: draft_model needs 'model' (a path)")
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        model = str(raw.pop("model", ""))
        config = cls(method, **{k: int(v) for k, v in raw.items()}, model=model)
        if not 1 <= config.num_speculative_tokens <= 16:
            raise ValueError("--speculative-config: num_speculative_tokens must be in [1, 16]")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if config.max_batch_size < 1:
            raise ValueError("--speculative-config: max_batch_size must be >= 1")
        return config


class NgramProposer:
    """Prompt lookup: find the last n tokens (n from max down to min) earlier in the sequence, prompt and output,
    and propose the tokens that followed their latest earlier occurrence."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose_batch(self, rows: list[tuple["Sequence", int]]) -> list[list[int]]:
        return [self.propose(seq.token_ids, limit) for seq, limit in rows]

    def retain(self, request_ids: set[str]) -> None:
        """Nothing is kept per sequence."""

    def release(self, request_ids: set[str] | None = None) -> None:
        """Nothing is kept per sequence."""

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        last = len(ids)
        # every earlier position holding the final token, latest first: where a match of the suffix may end
        ends = np.flatnonzero(ids[: last - 1] == ids[-1])[::-1]
        for n in range(min(self.n_max, last - 1), self.n_min - 1, -1):
            candidates = ends[ends >= n - 1]
            if candidates.size == 0:
                continue
            back = np.arange(n)
            matches = np.all(ids[candidates[:, None] - back] == ids[last - 1 - back], axis=1)
            if matches.any():
                end = int(candidates[int(np.argmax(matches))])
                return ids[end + 1 : end + 1 + k].tolist()
        return []
