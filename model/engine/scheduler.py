"""Scheduler: which sequences run this step and with how many tokens.

Running sequences go first (oldest first), each with one decode token or the next chunk of its prompt; then
waiting ones are admitted while the token budget, the sequence cap and free blocks allow. A long prompt (more
tokens than long_prefill_token_threshold) goes in chunks of at most that many, one such prompt per
step, as vLLM's --long-prefill-token-threshold with one long partial prefill: short prompts fill the rest of a
larger budget, so a burst of them is prefilled in fewer steps, while a long one never stretches the step that
running streams wait on. When blocks run out the newest running sequence is preempted: its blocks are freed and
it is recomputed later (slowed, never failed)."""

from collections import deque
from dataclasses import dataclass, field

from model.engine.block_manager import BlockManager
from model.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step (1 = decode), proposed ones included
    num_spec: int = 0  # of those, proposed tokens (seq.spec_token_ids[:num_spec]) to verify

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens, so it produces the next token."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_spec == len(self.seq)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # single-token rows first
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: none
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) wherever it is and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)  # full blocks stay hashed, so the recompute mostly hits the cache
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _is_long(self, seq: Sequence) -> bool:
        """A prompt longer than the threshold, still prefilling (its last chunk too: beside another long prompt's
        chunk it would double the step)."""
        return 0 < self.long_prefill_token_threshold < len(seq) and len(seq) - seq.num_computed_tokens > 1

    def _tokens_this_step(self, seq: Sequence, budget: int, long_taken: bool) -> tuple[int, bool]:
        """How many of seq's tokens to compute this step (0 for a long prompt while another one's chunk is in the
        step) and whether seq is a long prompt."""
        n = min(len(seq) - seq.num_computed_tokens, budget)
        if not self._is_long(seq):
            return n, False
        return (0 if long_taken else min(n, self.long_prefill_token_threshold)), True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        long_taken = False  # a long prompt's chunk is in this step
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n, long = self._tokens_this_step(seq, budget, long_taken)
            if n <= 0:
                continue
            long_taken |= long
            spec = 0
            if seq.spec_token_ids and n == len(seq) - seq.num_computed_tokens:  # proposals count in the budget
                spec = min(len(seq.spec_token_ids), budget - n)
                if spec and not bm.can_append(seq, n + spec):
                    spec = 0  # no room to check proposals: decode plainly rather than preempt anyone for them
                n += spec
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            bm.append(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, spec))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            bm.allocate_prompt(seq)
            n, long = self._tokens_this_step(seq, budget, long_taken)
            if n == 0:  # a long prompt behind another: first come, first served, it goes in with the next step
                bm.free_sequence(seq)
                break
            long_taken |= long
            if not bm.can_append(seq, n):
                bm.free_sequence(seq)  # hand back the cached blocks it was about to reuse
                break
            bm.append(seq, n)
            self.waiting.popleft()
            bm.prefix_queries += len(seq)
            bm.prefix_hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

        out.scheduled.sort(key=lambda s: s.num_tokens != 1)  # stable: decode-like rows first
        return out

    def postprocess(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[ScheduledSeq]:
        """Append each sampling row's tokens (one, or the accepted proposals and one more), advance computed counts
        over the tokens whose KV is now valid, register full blocks, and hand back rejected proposals' blocks.
        Returns the rows that sampled; the engine decides which of them finished."""
        sampling_rows = [s for s in out.scheduled if s.samples]
        accepted: dict[int, int] = {}
        for s, tokens in zip(sampling_rows, sampled, strict=True):
            s.seq.token_ids.extend(tokens)
            accepted[id(s)] = len(tokens) - 1  # proposals kept: their KV, computed this step, is valid
        for s in out.scheduled:
            old = s.seq.num_computed_tokens
            s.seq.num_computed_tokens += s.num_tokens - s.num_spec + accepted.get(id(s), 0)
            self.block_manager.register_computed(s.seq, old)
            if s.num_spec:
                self.block_manager.trim(s.seq)
            s.seq.spec_token_ids = []
        return sampling_rows
