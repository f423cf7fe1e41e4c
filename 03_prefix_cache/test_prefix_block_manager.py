"""Tests of the prefix-caching block manager (chapter 01's BlockManager, subclassed)."""

import random

import pytest

import prefix_cache_local
from block_manager import BlockManager
from prefix_block_manager import PrefixCachingBlockManager
from sequence import Sequence

BS = 4


def run_prefill(bm: PrefixCachingBlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its prefix hits, 'compute' the rest, register full blocks."""
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_cached_tokens = len(hits) * BS
    seq.num_computed_tokens = seq.num_tokens  # the forward pass computed the rest
    bm.cache_full_blocks(seq)
    return hits


def free_all_and_check(bm: PrefixCachingBlockManager, *seqs: Sequence) -> None:
    """Free every sequence: no block may stay held, and the manager's invariants must hold."""
    for seq in seqs:
        bm.free(seq)
    assert bm.all_blocks_free()
    bm.check_invariants()


def test_is_a_block_manager():
    assert issubclass(PrefixCachingBlockManager, BlockManager)


def test_second_request_hits_shared_prefix():
    bm = PrefixCachingBlockManager(16, BS)
    a = Sequence(list(range(10)), BS)
    assert run_prefill(bm, a) == []
    b = Sequence(list(range(8)) + [100, 101, 102], BS)
    hits = run_prefill(bm, b)
    assert hits == a.block_table[:2]
    assert [bm.blocks[h].ref_count for h in hits] == [2, 2]
    bm.check_invariants()
    free_all_and_check(bm, a, b)


def test_hit_is_capped_so_last_token_is_recomputed():
    bm = PrefixCachingBlockManager(16, BS)
    a = Sequence(list(range(8)), BS)  # exactly two full blocks
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    hits = bm.get_computed_blocks(Sequence(list(range(8)), BS))
    assert hits == table[:1], (
        f"an 8-token prompt whose 2 blocks are both cached hits only block 0 (max_hit_blocks), got {hits}: the "
        "last prompt token must be recomputed, its logits give the first output token"
    )
    assert bm.get_computed_blocks(Sequence(list(range(9)), BS)) == table[:2]


def test_a_missing_block_ends_the_hit():
    bm = PrefixCachingBlockManager(16, BS)
    a = Sequence(list(range(13)), BS)
    run_prefill(bm, a)
    del bm.cached_block_hash_to_block[bm.blocks[a.block_table[1]].block_hash]  # block 1 is gone
    hits = bm.get_computed_blocks(Sequence(list(range(13)), BS))
    assert hits == a.block_table[:1], (
        f"block 1 of the prefix is not cached, so block 2 (whose K/V depends on it) cannot be reused: "
        f"expected {a.block_table[:1]}, got {hits}"
    )


def test_only_computed_blocks_are_registered():
    bm = PrefixCachingBlockManager(16, BS)
    seq = Sequence(list(range(12)), BS)
    assert bm.allocate_slots(seq, 12)
    seq.num_computed_tokens = 5  # a first chunk of 5 tokens: only block 0 holds computed K/V
    bm.cache_full_blocks(seq)
    registered = sorted(bm.cached_block_hash_to_block.values())
    assert registered == seq.block_table[:1], (
        f"after computing 5 tokens only block 0 is full and computed; registered {registered}: a block "
        "whose K/V is not written yet must not be found by another request"
    )
    seq.num_computed_tokens = 12
    bm.cache_full_blocks(seq)
    assert sorted(bm.cached_block_hash_to_block.values()) == sorted(seq.block_table)


def test_freed_blocks_keep_hash_and_are_evicted_lru_tail_first():
    bm = PrefixCachingBlockManager(4, BS)
    a = Sequence(list(range(12)) + [99], BS)  # 3 full blocks + 1 token = all 4 blocks
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_blocks == 3 and bm.all_blocks_free()
    # One new block is needed: the least recently freed one goes, and free() released the tail
    # first, so the partial block, then the chain's last full block are reused before its head.
    c = Sequence([500, 501], BS)
    assert bm.allocate_slots(c, 2)
    assert c.block_table == [table[3]]
    d = Sequence([600, 601], BS)
    assert bm.allocate_slots(d, 2)
    assert d.block_table == [table[2]] and bm.num_evictions == 1, (
        f"reusing block {table[2]}, which still carried a hash, is an eviction: drop its hash from "
        f"cached_block_hash_to_block and count it (num_evictions={bm.num_evictions})"
    )
    hits = bm.get_computed_blocks(Sequence(list(range(13)), BS))
    assert len(hits) == 2, (
        f"block {table[2]} now holds d's tokens, so the prompt's hits stop before it: got {hits}; a reused "
        "block's old hash must not find it any more"
    )
    bm.check_invariants()


def test_only_unreferenced_blocks_are_evicted():
    bm = PrefixCachingBlockManager(4, BS)
    a = Sequence(list(range(9)), BS)
    run_prefill(bm, a)  # holds 3 blocks, 2 of them cached
    c = Sequence([7] * 4, BS)
    assert bm.allocate_slots(c, 4)  # takes the only free block
    assert not bm.can_allocate_slots(Sequence([1], BS), 1)
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 2


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(prefix_cache_local, "compute_block_hash", lambda p, t, e=None: b"\0" * 16)
    bm = PrefixCachingBlockManager(16, BS)
    a = Sequence(list(range(9)), BS)
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 1  # every block has the same hash: only the first registers
    b = Sequence([50, 51, 52, 53, 54], BS)
    hits = bm.get_computed_blocks(b)
    assert hits == [], f"same hash, other tokens: a collision is a miss (compare the block's token ids), got {hits}"
    assert bm.get_computed_blocks(Sequence(list(range(5)), BS)) == a.block_table[:1]


def test_cache_salt_isolates_tenants():
    bm = PrefixCachingBlockManager(16, BS)
    run_prefill(bm, Sequence(list(range(9)), BS, cache_salt="tenant-a"))
    for other in ("tenant-b", None):
        hits = bm.get_computed_blocks(Sequence(list(range(9)), BS, cache_salt=other))
        assert hits == [], f"cache_salt={other!r} hit tenant-a's blocks {hits}: the extra keys enter the hash"
    assert len(bm.get_computed_blocks(Sequence(list(range(9)), BS, cache_salt="tenant-a"))) == 2


def test_lora_id_enters_every_block_hash():
    a, b = Sequence(list(range(9)), BS), Sequence(list(range(9)), BS)
    b.lora_id = 3
    bm = PrefixCachingBlockManager(16, BS)
    ha, hb = bm.block_hashes(a), bm.block_hashes(b)
    assert len(ha) == 2 and all(x != y for x, y in zip(ha, hb)), "the LoRA id enters every block's hash"


def test_hashes_are_stable_across_processes():
    import subprocess
    import sys

    code = (
        "from prefix_cache_local import hash_block_chain;"
        "print(hash_block_chain(list(range(9)), 4, cache_salt='s')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""}
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {prefix_cache_local.hash_block_chain(list(range(9)), 4, cache_salt="s")[-1].hex()}


def test_decode_hashes_each_block_once(monkeypatch):
    calls = []
    real = prefix_cache_local.compute_block_hash
    monkeypatch.setattr(prefix_cache_local, "compute_block_hash", lambda p, t, e=None: calls.append(1) or real(p, t, e))
    bm = PrefixCachingBlockManager(64, BS)
    seq = Sequence(list(range(6)), BS)
    run_prefill(bm, seq)
    for t in range(100):
        seq.append_token(1000 + t)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert len(calls) == seq.num_tokens // BS == bm.num_cached_blocks
    bm.check_invariants()


def test_statistics_in_tokens():
    bm = PrefixCachingBlockManager(32, BS)
    assert bm.hit_rate == 0.0
    system = list(range(100, 116))  # 4 full blocks
    for user in range(5):
        seq = Sequence(system + [user, user + 1], BS)
        run_prefill(bm, seq)
        bm.free(seq)
    assert bm.prefix_cache_queries == 5 * 18
    assert bm.prefix_cache_hits == 4 * 16
    assert bm.hit_rate == pytest.approx(64 / 90)


def test_preempted_sequence_rehits_its_own_blocks():
    bm = PrefixCachingBlockManager(16, BS)
    seq = Sequence(list(range(11)), BS)
    run_prefill(bm, seq)
    seq.append_token(5)
    old = list(seq.block_table)
    bm.free(seq)  # preemption by recompute
    seq.num_computed_tokens = 0
    hits = bm.get_computed_blocks(seq)
    assert hits == old[:2]  # 12 tokens: 3 full blocks, the cap leaves 2


def test_concurrent_duplicate_prefix_is_not_double_registered():
    bm = PrefixCachingBlockManager(16, BS)
    a, b = Sequence(list(range(9)), BS), Sequence(list(range(9)), BS)
    for s in (a, b):
        assert bm.allocate_slots(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    assert bm.num_cached_blocks == 2
    bm.check_invariants()
    free_all_and_check(bm, a, b)


def test_nano_vllm_wrappers_use_the_cache():
    bm = PrefixCachingBlockManager(16, BS)
    a = Sequence(list(range(10)), BS)
    assert bm.can_allocate(a)
    bm.allocate(a)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = Sequence(list(range(10)), BS)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    b.num_computed_tokens = b.num_tokens
    b.append_token(3)
    assert bm.can_append(b)
    bm.may_append(b)
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.all_blocks_free()


def test_reset_prefix_cache():
    bm = PrefixCachingBlockManager(8, BS)
    a = Sequence(list(range(9)), BS)
    run_prefill(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(Sequence(list(range(9)), BS)) == []
    bm.check_invariants()


def test_block_size_mismatch_raises():
    with pytest.raises(ValueError, match="block_size"):
        PrefixCachingBlockManager(8, BS).get_computed_blocks(Sequence([1, 2, 3], 8))


@pytest.mark.parametrize("seed", range(6))
def test_randomized_shared_prefixes(seed):
    """Admit, prefill in chunks, decode and free many sequences in random order.

    A fake KV cache records, for every written slot, the full token prefix it was computed
    from; every hit must point at blocks whose recorded content equals the sequence's own.
    """
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    bm = PrefixCachingBlockManager(rng.randint(12, 40), bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 4 * bs))] for _ in range(4)]
    fake_kv: dict[int, tuple] = {}  # slot -> token prefix ending at that position
    live: list[Sequence] = []
    waiting: list[Sequence] = []

    def compute(seq, n):
        start = seq.num_computed_tokens
        for pos, slot in zip(range(start, start + n), bm.slot_mapping(seq, start, start + n)):
            fake_kv[slot] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)

    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 3 * bs))]
            waiting.append(Sequence(prompt, bs))
        elif op < 0.5 and waiting:
            seq = waiting.pop(rng.randrange(len(waiting)))
            hits = bm.get_computed_blocks(seq)
            for i, block_id in enumerate(hits):
                assert bm.blocks[block_id].token_ids == tuple(seq.block(i))
                for off in range(bs):
                    assert fake_kv[block_id * bs + off] == tuple(seq.token_ids[: i * bs + off + 1])
            assert len(hits) * bs < seq.num_tokens
            chunk = rng.randint(1, seq.num_tokens - len(hits) * bs)
            if bm.allocate_slots(seq, chunk, hits):
                seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * bs
                compute(seq, chunk)
                live.append(seq)
            else:
                waiting.append(seq)
        elif op < 0.85 and live:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
            n = min(rng.randint(1, 2 * bs), seq.num_tokens - seq.num_computed_tokens)
            if bm.allocate_slots(seq, n):
                compute(seq, n)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            if rng.random() < 0.3:  # preempted: back to waiting, recomputed from scratch
                seq.num_computed_tokens = 0
                waiting.append(seq)
        bm.check_invariants()
        for seq in live:
            for i, block_id in enumerate(seq.block_table[: seq.num_computed_tokens // bs]):
                for off in range(bs):
                    assert fake_kv[block_id * bs + off] == tuple(seq.token_ids[: i * bs + off + 1])
    free_all_and_check(bm, *live)
    bm.check_invariants()
    assert 0 < bm.prefix_cache_hits <= bm.prefix_cache_queries
