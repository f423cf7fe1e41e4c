"""The global KV pool: serialization, the embedded backend, and fault handling.

Every fault test checks the three promises: a warning, fewer blocks loaded, and K/V (hence
attention) equal to a fresh computation, because the engine recomputes what it did not load.
"""

import sys
import types
import warnings

import pytest
import torch

from global_kv_pool import (
    EmbeddedKVPool,
    GlobalKVPool,
    KVBlockCorrupt,
    KVPoolBackend,
    KVPoolError,
    MooncakeKVPool,
    deserialize_block,
    serialize_block,
)
from kv_pool_peer import MiniEngine, prompt_tokens
from sequence import Sequence

BS = 16
PROMPT = prompt_tokens(0, 70)  # 4 full blocks + 6 tokens: 4 blocks can come from the pool


def assert_correct(engine, seq):
    """The engine's cache holds exactly the K/V a fresh computation gives."""
    assert torch.equal(engine.gather_kv(seq), engine.model.compute_kv(seq.token_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_serialize_roundtrip(dtype):
    kv = torch.randn(2, 3, BS, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    tokens = tuple(range(BS))
    out = deserialize_block(serialize_block(kv, tokens), tuple(kv.shape), dtype, tokens)
    assert out.dtype == dtype and torch.equal(out, kv)


def _corruptions(value: bytes):
    flipped = bytearray(value)
    flipped[-1] ^= 0xFF
    return {
        "short": value[:-3],
        "tiny": value[:5],
        "magic": b"XXXX" + value[4:],
        "payload": bytes(flipped),
        "header": value[:8] + b"}" + value[9:],
        "not-a-dict": value[:4] + b"\x02\0\0\0[]" + value[9:],
    }


def test_deserialize_rejects_every_corruption():
    kv = torch.randn(2, 1, BS, 1, 4)
    tokens = tuple(range(BS))
    value = serialize_block(kv, tokens)
    for bad in _corruptions(value).values():
        with pytest.raises(KVBlockCorrupt):
            deserialize_block(bad, tuple(kv.shape), kv.dtype, tokens)
    with pytest.raises(KVBlockCorrupt, match="token_ids"):
        deserialize_block(value, tuple(kv.shape), kv.dtype, tuple(range(1, BS + 1)))
    with pytest.raises(KVBlockCorrupt, match="shape"):
        deserialize_block(value, (2, 1, BS, 2, 2), kv.dtype, tokens)
    with pytest.raises(KVBlockCorrupt, match="dtype"):
        deserialize_block(value, tuple(kv.shape), torch.float16, tokens)


def test_second_engine_loads_blocks_into_other_physical_blocks():
    pool = GlobalKVPool(EmbeddedKVPool(), block_size=BS)
    a, b = MiniEngine(pool), MiniEngine(pool, reserved_blocks=7)
    sa, sb = a.prefill(PROMPT), b.prefill(PROMPT)
    assert pool.num_published == 4 and pool.query(b.block_manager.block_hashes(sb)) == 64
    assert b.tokens_from_pool == 64 and b.tokens_computed == 6
    assert set(sa.block_table).isdisjoint(sb.block_table)
    assert torch.equal(a.gather_kv(sa), b.gather_kv(sb))
    assert torch.equal(a.attention(sa), b.attention(sb))
    # Loaded blocks entered b's local prefix cache: a third request hits locally, not the pool.
    sc = b.prefill(PROMPT)
    assert b.tokens_from_local == 64 and b.tokens_from_pool == 64
    for e, s in ((a, sa), (b, sb), (b, sc)):
        assert_correct(e, s)
        e.finish(s)
    b.close()
    assert a.block_manager.all_blocks_free() and b.block_manager.all_blocks_free()


def test_pool_only_shares_blocks_of_the_same_prefix():
    pool = GlobalKVPool(EmbeddedKVPool(), block_size=BS)
    MiniEngine(pool).prefill(PROMPT)
    b = MiniEngine(pool)
    other = PROMPT[:BS] + [(t + 1) % 512 for t in PROMPT[BS : 2 * BS]] + PROMPT[2 * BS :]
    seq = b.prefill(other)
    assert b.tokens_from_pool == BS  # only the first block is the same prefix
    assert_correct(b, seq)


def test_namespaces_do_not_mix():
    backend = EmbeddedKVPool()
    MiniEngine(GlobalKVPool(backend, namespace="model-a", block_size=BS)).prefill(PROMPT)
    b = MiniEngine(GlobalKVPool(backend, namespace="model-b", block_size=BS))
    b.prefill(PROMPT)
    assert b.tokens_from_pool == 0


def test_fault_key_evicted_between_query_and_fetch():
    backend = EmbeddedKVPool()
    pool = GlobalKVPool(backend, block_size=BS)
    MiniEngine(pool).prefill(PROMPT)
    b = MiniEngine(pool, reserved_blocks=3)
    real_exists = backend.exists_many

    def exists_then_evict(keys):
        answer = real_exists(keys)
        if len(keys) == 4:  # load_sequence's query: evict block 2 right after it
            backend.remove(keys[2])
        return answer

    backend.exists_many = exists_then_evict
    with pytest.warns(RuntimeWarning, match="vanished before fetch"):
        seq = b.prefill(PROMPT)
    assert b.tokens_from_pool == 2 * BS and b.tokens_computed == 70 - 2 * BS
    assert pool.num_faults == 1
    assert_correct(b, seq)


@pytest.mark.parametrize("kind", ["short", "payload", "magic", "tiny"])
def test_fault_corrupt_value(kind):
    backend = EmbeddedKVPool()
    pool = GlobalKVPool(backend, block_size=BS)
    b = MiniEngine(pool, reserved_blocks=2)
    hashes = b.block_manager.block_hashes(Sequence(PROMPT, BS))
    # Plant a bad value for block 1 before anyone publishes the real one (first write wins).
    good = serialize_block(torch.zeros(2, 2, BS, 2, 16), tuple(PROMPT[BS : 2 * BS]))
    backend.put_many({pool.block_key(hashes[1]): _corruptions(good)[kind]})
    MiniEngine(pool).prefill(PROMPT)
    with pytest.warns(RuntimeWarning, match="invalid"):
        seq = b.prefill(PROMPT)
    assert b.tokens_from_pool == BS
    assert_correct(b, seq)


def test_fault_wrong_tokens_under_a_key():
    """A value whose header names other tokens (a hash collision in the pool) is refused."""
    backend = EmbeddedKVPool()
    pool = GlobalKVPool(backend, block_size=BS)
    b = MiniEngine(pool)
    h0 = b.block_manager.block_hashes(Sequence(PROMPT, BS))[0]
    backend.put_many({pool.block_key(h0): serialize_block(torch.zeros(2, 2, BS, 2, 16), tuple(range(BS)))})
    with pytest.warns(RuntimeWarning, match="token_ids"):
        seq = b.prefill(PROMPT)
    assert b.tokens_from_pool == 0
    assert_correct(b, seq)


class DownBackend(KVPoolBackend):
    name = "down"

    def __init__(self):
        self.calls = 0

    def _refuse(self):
        self.calls += 1
        raise KVPoolError("connection refused")

    def put_many(self, items):
        self._refuse()

    def get_many(self, keys):
        self._refuse()

    def exists_many(self, keys):
        self._refuse()


def test_fault_store_down():
    pool = GlobalKVPool(DownBackend(), block_size=BS, retry_after_s=0)
    engine = MiniEngine(pool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq = engine.prefill(PROMPT)
    messages = [str(w.message) for w in caught]
    assert any("query failed" in m for m in messages) and any("publish failed" in m for m in messages)
    assert engine.tokens_from_pool == 0 and engine.tokens_computed == 70
    assert_correct(engine, seq)
    with pytest.warns(RuntimeWarning, match="fetch failed"):
        assert pool.fetch(engine.block_manager.block_hashes(seq)[:1], [tuple(PROMPT[:BS])], engine.kv_cache, [0]) == 0


def test_a_down_store_is_asked_again_only_after_retry_after_s():
    backend = DownBackend()
    pool = GlobalKVPool(backend, block_size=BS, retry_after_s=60)
    engine = MiniEngine(pool)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for seed in range(5):
            engine.finish(engine.prefill(prompt_tokens(seed, 40)))
    assert backend.calls == 1 and not pool.available  # one timeout, then misses at no cost
    assert engine.tokens_computed == 5 * 40 and engine.block_manager.all_blocks_free()
    pool._unavailable_until = 0.0  # the back-off has run out
    with pytest.warns(RuntimeWarning, match="query failed"):
        assert pool.query(engine.block_manager.block_hashes(Sequence(prompt_tokens(0, 40), BS))) == 0
    assert backend.calls == 2


def test_embedded_pool_evicts_lru_by_bytes():
    pool = EmbeddedKVPool(capacity_bytes=30)
    pool.put_many({"a": b"x" * 10, "b": b"y" * 10, "c": b"z" * 10})
    pool.get_many(["a"])  # a is now the most recently used
    pool.put_many({"d": b"w" * 10, "a": b"ignored: first write wins"})
    assert pool.exists_many(["a", "b", "c", "d"]) == [True, False, True, True]
    assert pool.get_many(["a", "b"]) == [b"x" * 10, None]


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="namespace"):
        GlobalKVPool(namespace="a/b")
    with pytest.raises(ValueError, match="block_size"):
        GlobalKVPool(block_size=0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        EmbeddedKVPool(0)
    pool = GlobalKVPool(block_size=BS)
    with pytest.raises(ValueError, match="same length"):
        pool.publish([b"\0" * 16], [], torch.zeros(2, 1, 4, BS, 1, 4), [0])


class FlakyMooncakeStore:
    """Stands in for ``mooncake.store.MooncakeDistributedStore``: the first setups fail like a
    master that drops a fresh connection (-600)."""

    failures_left = 0
    setups: list[str] = []
    closes = 0

    def setup(self, local_hostname, metadata_url, global_segment, local_buffer, protocol, device, master):
        FlakyMooncakeStore.setups.append(local_hostname)
        if FlakyMooncakeStore.failures_left > 0:
            FlakyMooncakeStore.failures_left -= 1
            return -600
        return 0

    def close(self):
        FlakyMooncakeStore.closes += 1


@pytest.fixture
def flaky_mooncake(monkeypatch):
    package = types.ModuleType("mooncake")
    store_module = types.ModuleType("mooncake.store")
    store_module.MooncakeDistributedStore = FlakyMooncakeStore
    package.store = store_module
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.store", store_module)
    FlakyMooncakeStore.setups = []
    FlakyMooncakeStore.closes = 0
    return FlakyMooncakeStore


def test_mooncake_setup_retries_a_dropped_first_connection(flaky_mooncake):
    flaky_mooncake.failures_left = 1
    backend = MooncakeKVPool("127.0.0.1:1", "http://127.0.0.1:2/metadata", setup_attempts=2)
    assert len(flaky_mooncake.setups) == 2
    assert backend.local_hostname == flaky_mooncake.setups[1]
    assert flaky_mooncake.closes == 1, "the failed attempt's store is closed"
    backend.close()


def test_mooncake_setup_gives_up_after_its_attempts(flaky_mooncake):
    flaky_mooncake.failures_left = 5
    with pytest.raises(KVPoolError, match="code -600 after 2 attempts"):
        MooncakeKVPool("127.0.0.1:1", "http://127.0.0.1:2/metadata", setup_attempts=2)
    assert len(flaky_mooncake.setups) == 2
    assert flaky_mooncake.closes == 2


def test_mooncake_setup_attempts_must_be_positive(flaky_mooncake):
    with pytest.raises(ValueError, match="setup_attempts"):
        MooncakeKVPool("127.0.0.1:1", "http://127.0.0.1:2/metadata", setup_attempts=0)
    assert flaky_mooncake.setups == []
