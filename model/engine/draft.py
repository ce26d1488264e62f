"""Draft-model proposals: a smaller model with the target's vocabulary guesses the next k tokens greedily.

It runs in the engine's thread with a ModelRunner and a KV pool of its own. Each sequence it drafts for has a
draft-side Sequence that mirrors the target's tokens: before each round it keeps the KV of the prefix both still
share, computes the rest in one forward that also gives the first proposal, then one decode step per further
proposal, all sequences batched."""

import logging

from config import Settings
from model.engine.block_manager import BlockManager
from model.engine.model_runner import ModelRunner
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import SamplingParams, Sequence
from model.engine.speculative import SpeculativeConfig

log = logging.getLogger("llmserve.draft")


class DraftProposer:
    def __init__(
        self, config: SpeculativeConfig, settings: Settings, target_vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self.k = config.num_speculative_tokens
        memory = config.draft_kv_cache_memory or max(settings.kv_cache_memory // 4, 1)
        draft_settings = settings.model_copy(
            update={
                "model": config.model,
                "kv_cache_memory": memory,
                "torch_compile": False,
                "speculative_config": "",
            }
        )
        self.runner = ModelRunner(draft_settings, eos_token_ids)
        if self.runner.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.runner.config.vocab_size} tokens) is not the "
                f"target's ({target_vocab_size})"
            )
        self.block_manager = BlockManager(self.runner.num_blocks, settings.block_size, enable_prefix_caching=False)
        self.max_model_len = self.runner.max_model_len
        self.states: dict[str, Sequence] = {}
        log.info(
            "draft model %s: %d layers, KV cache %d blocks",
            config.model,
            self.runner.config.num_layers,
            self.runner.num_blocks,
        )

    def retain(self, request_ids: set[str]) -> None:
        """Free the draft state of every sequence but these."""
        self.release(set(self.states) - request_ids)

    def release(self, request_ids: set[str] | None = None) -> None:
        """Free the draft state of these sequences (None: of all)."""
        for request_id in list(self.states) if request_ids is None else request_ids & set(self.states):
            self.block_manager.free_sequence(self.states.pop(request_id))

    def propose_batch(self, rows: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[Sequence | None] = [self._sync(seq, limit) for seq, limit in rows]
        limits = [min(limit, self.k) for _, limit in rows]
        proposals: list[list[int]] = [[] for _ in rows]
        for _ in range(max(limits, default=0)):
            scheduled: list[ScheduledSeq] = []
            owners: list[int] = []  # the row each scheduled draft proposes for
            for i, draft in enumerate(drafts):
                if draft is None or len(proposals[i]) >= limits[i]:
                    continue
                n = len(draft) - draft.num_computed_tokens  # the unshared tail (round 0), then one token
                if not self.block_manager.can_append(draft, n):
                    self.release({draft.request_id})  # no room: this sequence goes without proposals
                    drafts[i], proposals[i] = None, []
                    continue
                self.block_manager.append(draft, n)
                scheduled.append(ScheduledSeq(draft, n))
                owners.append(i)
            if not scheduled:
                break
            sampled = self.runner.run(scheduled, [None] * len(scheduled))
            assert sampled is not None
            for s, i, tokens in zip(scheduled, owners, sampled.tokens, strict=True):
                s.seq.num_computed_tokens += s.num_tokens
                s.seq.token_ids.append(tokens[0])
                proposals[i].append(tokens[0])
        return proposals

    def _sync(self, seq: Sequence, limit: int) -> Sequence | None:
        """The draft-side sequence with the target's tokens, its KV kept for the prefix they still share."""
        if limit <= 0 or len(seq) + limit > self.max_model_len:
            return None
        draft = self.states.get(seq.request_id)
        if draft is None:
            draft = Sequence(seq.request_id, seq.token_ids, SamplingParams(temperature=0, max_tokens=1))
            self.states[seq.request_id] = draft
        else:
            shared = 0
            for a, b in zip(draft.token_ids, seq.token_ids):  # noqa: B905 - the shorter one bounds the prefix
                if a != b:
                    break
                shared += 1
            draft.token_ids = list(seq.token_ids)
            draft.num_computed_tokens = min(draft.num_computed_tokens, shared, len(seq) - 1)
            self.block_manager.trim(draft)
        return draft
