"""BlockManager: allocation, reference counts, prefix hashes and LRU eviction. No weights."""

from model.engine.block_manager import BlockManager
from model.engine.sequence import SamplingParams, Sequence


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=4))


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """Pretend the model computed every token of s (as the scheduler does after a step)."""
    n = len(s) - s.num_computed_tokens
    bm.append(s, n)
    old = s.num_computed_tokens
    s.num_computed_tokens += n
    bm.register_computed(s, old)


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    bm.allocate_prompt(s)
    assert s.num_cached_tokens == 0
    compute_all(bm, s)
    assert len(s.block_table) == 3 and bm.num_free == 5
    bm.free_sequence(s)
    assert bm.num_free == 8 and s.block_table == []


def test_prefix_hit_reuses_full_blocks_and_counts_refs() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))  # blocks [0..3], [4..7] full, [8, 9] partial
    bm.allocate_prompt(a)
    compute_all(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    bm.allocate_prompt(b)
    assert b.num_cached_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]


def test_hit_never_covers_the_last_token() -> None:
    # A prompt that is exactly two full cached blocks must still compute one token to get logits.
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    bm.allocate_prompt(a)
    compute_all(bm, a)
    b = seq(list(range(8)))
    bm.allocate_prompt(b)
    assert b.num_cached_tokens == 4


def test_freed_hashed_blocks_stay_cached_until_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate_prompt(a)
    compute_all(bm, a)
    bm.free_sequence(a)
    assert bm.num_free == 4
    b = seq([1, 2, 3, 4, 9])
    bm.allocate_prompt(b)
    assert b.num_cached_tokens == 4  # still cached after the owner finished
    bm.free_sequence(b)
    # Fill the pool with something else: the cached blocks are evicted, then a lookup misses.
    c = seq([7, 7, 7, 7, 7, 7, 7, 7])
    bm.allocate_prompt(c)
    compute_all(bm, c)
    bm.free_sequence(c)
    d = seq([1, 2, 3, 4, 9])
    bm.allocate_prompt(d)
    assert d.num_cached_tokens == 0


def test_different_prefix_same_block_tokens_do_not_collide() -> None:
    # The hash is chained: the same tokens after a different prefix are a different block.
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 0])
    bm.allocate_prompt(a)
    compute_all(bm, a)
    b = seq([9, 9, 3, 4, 0])
    bm.allocate_prompt(b)
    assert b.num_cached_tokens == 0


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate_prompt(a)
    compute_all(bm, a)
    b = seq([1, 2, 3, 4, 5])
    bm.allocate_prompt(b)
    assert b.num_cached_tokens == 0
