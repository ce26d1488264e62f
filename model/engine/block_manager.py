"""BlockManager: the KV pool's blocks, their reference counts, and automatic prefix caching.

A full block is identified by a chained hash of (previous block's hash, its tokens). Once a block's KV is
computed its hash is registered, so a later sequence with the same prefix reuses it. Blocks whose count drops to
zero keep their hash and stay reusable; they are evicted least-recently-freed first when space is needed."""

from collections import OrderedDict
from dataclasses import dataclass, field

from model.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def _evict(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()

    def allocate_prompt(self, seq: Sequence) -> bool:
        """Give a waiting sequence its cached prefix blocks. Leaves at least one token to compute, so the step
        produces logits. Returns False (and changes nothing) if not even the cached blocks can be held."""
        assert not seq.block_table
        hits: list[Block] = []
        if self.enable_prefix_caching:
            prev: int | None = None
            num_full = (len(seq) - 1) // self.block_size
            for i in range(num_full):
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                h = self.chain_hash(prev, tokens)
                block_id = self.hash_to_block.get(h)
                if block_id is None or self.blocks[block_id].token_ids != tokens:
                    break
                hits.append(self.blocks[block_id])
                prev = h
        for block in hits:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1
        seq.block_table = [b.block_id for b in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        return True

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) <= self.num_free

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make seq's block table cover the KV of num_new_tokens more tokens."""
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block_id)

    def register_computed(self, seq: Sequence, old_computed: int) -> None:
        """Hash the blocks that became full while computing tokens old_computed..seq.num_computed_tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = old_computed // bs, seq.num_computed_tokens // bs
        prev = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if block.hash is None:
                block.hash, block.token_ids = self.chain_hash(prev, tokens), tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
            prev = block.hash

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: after speculation, rejected proposals' KV."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_sequence(self, seq: Sequence) -> None:
        # Reversed so a sequence's tail is evicted before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)  # unhashed blocks are reused first
