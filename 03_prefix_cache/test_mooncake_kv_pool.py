"""The global KV pool on the real Mooncake Store: two engine processes, both segment modes, faults.

Each test starts its own ``mooncake_master`` (and ``mooncake_client`` where needed) on free
loopback ports and stops it; nothing outlives the test. Skipped only where the Mooncake package
cannot be imported.
"""

import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from global_kv_pool import GlobalKVPool, MooncakeKVPool, serialize_block
from kv_pool_peer import MiniEngine, prompt_tokens
from mooncake_launcher import MooncakeClient, MooncakeMaster, mooncake_unavailable_reason
from sequence import Sequence

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(mooncake_unavailable_reason() is not None, reason=str(mooncake_unavailable_reason())),
]

PEER = str(Path(__file__).with_name("kv_pool_peer.py"))
BS = 16
PROMPT_LEN = 70  # 4 full blocks from the pool, 6 tokens recomputed
NAMESPACE = "toy-kv-model-seed0"  # what kv_pool_peer.py uses


@pytest.fixture
def master():
    with MooncakeMaster() as m:
        yield m
    assert not m.running


def peer_args(master, role, out, **flags):
    argv = [
        sys.executable,
        PEER,
        "--role",
        role,
        "--master",
        master.master_addr,
        "--metadata",
        master.metadata_url,
        "--out",
        str(out),
    ]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv


def run_peer(master, role, out, **flags) -> dict:
    proc = subprocess.run(peer_args(master, role, out, **flags), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(out)


class HeldPeer:
    """A publishing engine kept alive (its Mooncake segment with it) until ``stop()``."""

    def __init__(self, master, out, **flags):
        self.proc = subprocess.Popen(
            peer_args(master, "publish", out, hold=True, **flags),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout=120)
        if not line or line[0].strip() != "READY":
            self.stop()
            raise RuntimeError(f"publishing peer did not become ready: {line}")
        self.report = torch.load(out)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def assert_same_result(a: dict, b: dict):
    assert torch.equal(a["kv"], b["kv"])  # bit-exact K/V, read through each engine's block table
    assert torch.equal(a["attention"], b["attention"])


@pytest.mark.slow
def test_engine_segment_mode_blocks_vanish_with_their_engine(master, tmp_path):
    """Values placed in engine A's own segment serve B while A lives, and vanish when it exits."""
    a = HeldPeer(master, tmp_path / "a.pt", segment_mb=32)
    try:
        assert a.report["published"] == 4 and a.report["tokens_from_pool"] == 0
        # B lends no memory, so nothing it publishes can land in its own (nonexistent) segment.
        b = run_peer(master, "fetch", tmp_path / "b.pt", segment_mb=0, reserved_blocks=9)
    finally:
        a.stop()
    assert a.proc.returncode == 0
    assert b["tokens_from_pool"] == 64 and b["tokens_computed"] == PROMPT_LEN - 64
    assert set(a.report["block_table"]).isdisjoint(b["block_table"])
    assert_same_result(a.report, b)
    assert b["warnings"] == []

    c = run_peer(master, "fetch", tmp_path / "c.pt", segment_mb=32)
    assert c["tokens_from_pool"] == 0 and c["tokens_computed"] == PROMPT_LEN
    assert_same_result(a.report, c)


@pytest.mark.slow
def test_client_mode_blocks_outlive_their_engine(master, tmp_path):
    """With a mooncake_client holding the pool, A can exit before B even starts."""
    with MooncakeClient(master, segment_size="64 MB"):
        a = run_peer(master, "publish", tmp_path / "a.pt", segment_mb=0)
        assert a["published"] == 4
        b = run_peer(master, "fetch", tmp_path / "b.pt", segment_mb=0, reserved_blocks=5)
    assert b["tokens_from_pool"] == 64 and b["warnings"] == []
    assert_same_result(a, b)


@pytest.fixture
def store(master):
    backend = MooncakeKVPool(master.master_addr, master.metadata_url, global_segment_size=32 << 20)
    yield backend
    backend.close()


def test_mooncake_backend_basics(store):
    assert store.exists_many(["k1", "k2"]) == [False, False]
    store.put_many({"k1": b"abc", "k2": b"x" * 70000})
    assert store.exists_many(["k1", "k2", "k3"]) == [True, True, False]
    assert store.get_many(["k2", "k3", "k1"]) == [b"x" * 70000, None, b"abc"]


def _prompt_and_hashes(engine):
    prompt = prompt_tokens(1, PROMPT_LEN)
    return prompt, engine.block_manager.block_hashes(Sequence(prompt, BS))


@pytest.mark.slow
def test_mooncake_fault_key_evicted_between_query_and_fetch():
    """Mooncake leases a key that was just checked (10 s by default) precisely so that it is
    not evicted before the fetch; with a 100 ms lease the eviction can be forced."""
    with MooncakeMaster(["--default_kv_lease_ttl=100"]) as short_lease_master:
        store = MooncakeKVPool(
            short_lease_master.master_addr, short_lease_master.metadata_url, global_segment_size=32 << 20
        )
        try:
            _evicted_between_query_and_fetch(store)
        finally:
            store.close()


def _evicted_between_query_and_fetch(store):
    pool = GlobalKVPool(store, namespace=NAMESPACE, block_size=BS)
    MiniEngine(pool).prefill(prompt_tokens(1, PROMPT_LEN))
    b = MiniEngine(pool, reserved_blocks=3)
    prompt, hashes = _prompt_and_hashes(b)
    real_exists = store.exists_many
    evicted = []

    def exists_then_evict(keys):
        answer = real_exists(keys)
        if not evicted:  # load_sequence's query: evict block 1 once its lease is over
            time.sleep(0.3)
            evicted.append(store.remove(pool.block_key(hashes[1])))
        return answer

    store.exists_many = exists_then_evict
    with pytest.warns(RuntimeWarning, match="vanished before fetch"):
        seq = b.prefill(prompt)
    assert evicted == [0] and b.tokens_from_pool == BS
    assert torch.equal(b.gather_kv(seq), b.model.compute_kv(prompt))


@pytest.mark.parametrize("kind", ["short", "corrupt"])
def test_mooncake_fault_bad_value(store, kind):
    pool = GlobalKVPool(store, namespace=NAMESPACE, block_size=BS)
    b = MiniEngine(pool, reserved_blocks=2)
    prompt, hashes = _prompt_and_hashes(b)
    good = serialize_block(b.model.compute_kv(prompt)[:, :, 2 * BS : 3 * BS], tuple(prompt[2 * BS : 3 * BS]))
    bad = good[: len(good) // 2] if kind == "short" else good[:-1] + bytes([good[-1] ^ 1])
    store.put_many({pool.block_key(hashes[2]): bad})  # planted before the real block is published
    MiniEngine(pool).prefill(prompt)
    with pytest.warns(RuntimeWarning, match="invalid"):
        seq = b.prefill(prompt)
    assert b.tokens_from_pool == 2 * BS
    assert torch.equal(b.gather_kv(seq), b.model.compute_kv(prompt))


@pytest.mark.slow
def test_mooncake_fault_store_down(master):
    backend = MooncakeKVPool(master.master_addr, master.metadata_url, global_segment_size=16 << 20)
    try:
        pool = GlobalKVPool(backend, namespace=NAMESPACE, block_size=BS)
        MiniEngine(pool).prefill(prompt_tokens(2, PROMPT_LEN))
        master.stop()
        b = MiniEngine(pool)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seq = b.prefill(prompt_tokens(2, PROMPT_LEN))
        assert any("query failed" in str(w.message) for w in caught)
        assert b.tokens_from_pool == 0
        assert torch.equal(b.gather_kv(seq), b.model.compute_kv(seq.token_ids))
    finally:
        backend.close()


@pytest.mark.slow
def test_setup_against_no_master_raises_pool_error():
    from global_kv_pool import KVPoolError, _free_port

    with pytest.raises(KVPoolError, match="setup failed"):
        MooncakeKVPool(f"127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}/metadata")
