# vllm-from-scratch/03_prefix_cache/test_prefix_cache_local.py
import pytest
from prefix_cache_local import PrefixCacheLocal, BLOCK_SIZE, compute_block_hash


SYS_PROMPT = list(range(32))  # 2块的系统提示词


class TestHashChain:
    def test_full_blocks_only(self):
        """只有满块才被缓存"""
        cache = PrefixCacheLocal(max_cached_blocks=10)
        # 17 tokens: 1完整块 + 1剩余
        tokens = list(range(17))
        chain = cache.compute_hash_chain(tokens)
        assert len(chain) == 1  # 只有1个完整块

    def test_chain_dependency(self):
        """链式哈希：相同内容但不同前缀，哈希不同"""
        cache = PrefixCacheLocal(max_cached_blocks=10)
        tokens1 = list(range(32))    # [0..31]
        tokens2 = list(range(16, 48))  # [16..47]

        chain1 = cache.compute_hash_chain(tokens1)
        chain2 = cache.compute_hash_chain(tokens2)

        # block1 内容相同: tokens[0:16] vs tokens[16:32]，不同
        # 但即使内容相同，parent_hash 也不同
        assert chain1[0][0] != chain2[0][0]  # 哈希不同（内容不同）

    def test_deterministic(self):
        """相同输入必须产生相同哈希"""
        cache = PrefixCacheLocal(max_cached_blocks=10)
        tokens = list(range(16))
        h1 = cache.compute_hash_chain(tokens)
        h2 = cache.compute_hash_chain(tokens)
        assert h1[0][0] == h2[0][0]


class TestPrefixCache:
    @pytest.fixture
    def cache(self):
        return PrefixCacheLocal(max_cached_blocks=20)

    def test_cold_miss(self, cache):
        """冷启动：没有缓存，miss"""
        tokens = SYS_PROMPT + list(range(100, 116))
        blocks, num_cached = cache.match_prefix(tokens)
        assert len(blocks) == 0
        assert num_cached == 0

    def test_cache_then_hit(self, cache):
        """缓存后能命中"""
        tokens = SYS_PROMPT + list(range(100, 116))

        # 第一次：miss，但缓存
        blocks, num_cached = cache.match_prefix(tokens)
        assert num_cached == 0
        cache.cache_computed_blocks(tokens)

        # 第二次：命中
        blocks2, num_cached2 = cache.match_prefix(tokens)
        assert num_cached2 == len(tokens) // BLOCK_SIZE * BLOCK_SIZE
        assert len(blocks2) > 0

    def test_partial_prefix_hit(self, cache):
        """部分前缀命中"""
        tokens_a = SYS_PROMPT + list(range(100, 148))  # 4块
        cache.cache_computed_blocks(tokens_a)

        # 新请求只共享前缀（SYS_PROMPT 部分）
        tokens_b = SYS_PROMPT + list(range(200, 248))  # 不同后缀
        blocks, num_cached = cache.match_prefix(tokens_b)

        # 只有 SYS_PROMPT 的2块命中
        assert num_cached == 32  # BLOCK_SIZE * 2

    def test_lru_eviction(self):
        """LRU淘汰：最久未用的块先被驱逐"""
        cache = PrefixCacheLocal(max_cached_blocks=3)

        # 缓存3块（填满）
        cache.cache_computed_blocks(list(range(16)))   # 块A
        cache.cache_computed_blocks(list(range(16, 32)))  # 块B（不同前缀链，独立）

        # 让cache再学习一个不同的3-token链
        tokens_c = list(range(200, 248))  # 3块新内容
        cache.cache_computed_blocks(tokens_c)
        # 现在缓存满了（3块）

        # 再缓存一个新块，触发LRU淘汰
        tokens_new = list(range(300, 316))
        cache.cache_computed_blocks(tokens_new)

        # 缓存大小不超过max
        assert cache.num_cached_blocks <= 3

    def test_shared_prefix_multi_requests(self, cache):
        """多请求共享前缀，ref_cnt 正确增减"""
        # 缓存系统提示词
        cache.cache_computed_blocks(SYS_PROMPT)
        blocks, _ = cache.match_prefix(SYS_PROMPT)

        # 请求A和B都使用这些块
        cache.touch(blocks)  # 请求A
        cache.touch(blocks)  # 请求B
        assert all(b.ref_cnt == 2 for b in blocks)

        # A完成
        cache.release(blocks)
        assert all(b.ref_cnt == 1 for b in blocks)

        # B完成
        cache.release(blocks)
        assert all(b.ref_cnt == 0 for b in blocks)

    def test_ref_blocks_not_evicted(self):
        """正在使用的块不应该被LRU淘汰"""
        cache = PrefixCacheLocal(max_cached_blocks=2)
        tokens = list(range(32))  # 2块
        cache.cache_computed_blocks(tokens)
        blocks, _ = cache.match_prefix(tokens)
        cache.touch(blocks)  # 标记为使用中

        # 尝试触发淘汰
        for i in range(10):
            new_tokens = list(range(1000 + i * 16, 1016 + i * 16))
            cache.cache_computed_blocks(new_tokens)  # 触发淘汰

        # 使用中的块应该还在
        blocks2, num_cached = cache.match_prefix(tokens)
        assert num_cached == 32  # 仍然命中

        cache.release(blocks)


if __name__ == '__main__':
    pytest.main([__file__, '-v'])
