"""A block hash stands for its whole prefix, and a prefix lookup stops at the first miss."""

from prefix_cache_local import BLOCK_SIZE, PrefixCacheLocal, compute_block_hash


def test_a_block_hash_depends_on_its_whole_prefix():
    block = tuple(range(BLOCK_SIZE))
    first_a = compute_block_hash(None, tuple(range(100, 100 + BLOCK_SIZE)))
    first_b = compute_block_hash(None, tuple(range(200, 200 + BLOCK_SIZE)))
    after_a, after_b = compute_block_hash(first_a, block), compute_block_hash(first_b, block)
    assert after_a != after_b, (
        "the same tokens after two different first blocks got one hash: a block's K/V depends on every "
        "token before it, so its hash must chain in the parent hash"
    )
    assert compute_block_hash(None, block) not in (after_a, after_b), "a first block and a second block share a hash"


def test_match_stops_at_the_first_missing_block():
    cache = PrefixCacheLocal(8)
    prompt = list(range(3 * BLOCK_SIZE + 1))
    chain = cache.cache_computed_blocks(prompt)
    del cache._cache[chain[1].block_hash]  # the middle block was evicted
    matched, num_tokens = cache.match_prefix(prompt)
    assert matched == chain[:1] and num_tokens == BLOCK_SIZE, (
        f"block 1 is gone, so only block 0 can be reused (block 2's K/V was computed after block 1's); "
        f"got blocks {[b.block_id for b in matched]} and {num_tokens} tokens"
    )


def test_hit_rate_counts_tokens():
    cache = PrefixCacheLocal(8)
    cache.cache_computed_blocks(list(range(2 * BLOCK_SIZE)))
    prompt = list(range(2 * BLOCK_SIZE)) + [7] * 8
    cache.match_prefix(prompt)
    assert cache.cache_hit_rate == (2 * BLOCK_SIZE) / len(prompt), (
        f"{2 * BLOCK_SIZE} of {len(prompt)} prompt tokens were found: the hit rate is in tokens, "
        f"got {cache.cache_hit_rate}"
    )
