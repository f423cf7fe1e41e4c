"""A global KV pool: engines publish full KV blocks by chained hash, and fetch each other's.

The local prefix cache (``prefix_block_manager``) forgets a block the moment its memory is
reused, and it only serves the engine that computed it. Mooncake's idea is a second tier: a pool
of memory spread over many machines, keyed by the same chained block hash, that any engine can
publish to and load from. Because the hash of a block covers its whole prefix (and the salt and
LoRA id), a key names exactly one K/V content, whichever engine computed it.

``GlobalKVPool`` does the engine's side of it:

* :meth:`GlobalKVPool.publish` serializes each block's K/V for all layers,
  ``kv_cache[:, :, block_id]`` of shape ``[2, layers, block_size, kv_heads, head_dim]``, behind a
  small header (shape, dtype, token ids, checksum) and stores it under the block's hash.
* :meth:`GlobalKVPool.query` counts how many leading blocks of a chain the pool holds.
* :meth:`GlobalKVPool.fetch` reads them, validates every header against what the caller expects,
  and copies the K/V into the caller's own (different) physical blocks.

Anything that goes wrong on the way (the store down, a key evicted between query and fetch, a
short or corrupt value) ends the usable prefix there with a warning: the blocks not loaded are
simply recomputed by the forward pass, so a fault costs time, never correctness.

Storage sits behind :class:`KVPoolBackend` (``put_many`` / ``get_many`` / ``exists_many``):
:class:`EmbeddedKVPool` is an in-process LRU dict (the default: no services), and
:class:`MooncakeKVPool` is the real Mooncake Store, a master process plus the memory segments
that engines (or a standalone ``mooncake_client``) contribute, reached over TCP.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch
import xxhash

from prefix_cache_local import BlockHash

MAGIC = b"VFKV"
_HEADER_LEN = struct.Struct("<4sI")  # magic, length of the JSON header that follows


class KVPoolError(RuntimeError):
    """The backing store failed (down, unreachable, out of space)."""


class KVBlockCorrupt(ValueError):
    """A fetched value is not the block that was asked for (short, corrupt, wrong shape)."""


# ---------------------------------------------------------------------- serialization
def serialize_block(kv: torch.Tensor, token_ids: tuple[int, ...]) -> bytes:
    """One block's K/V ``[2, layers, block_size, kv_heads, head_dim]`` as header + raw bytes."""
    payload = kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "shape": list(kv.shape),
            "dtype": str(kv.dtype).removeprefix("torch."),
            "token_ids": list(token_ids),
            "nbytes": len(payload),
            "xxh64": xxhash.xxh64_hexdigest(payload),
        }
    ).encode()
    return b"".join((_HEADER_LEN.pack(MAGIC, len(header)), header, payload))


def deserialize_block(
    value: bytes, shape: tuple[int, ...], dtype: torch.dtype, token_ids: tuple[int, ...]
) -> torch.Tensor:
    """Parse and check a stored block; raise :class:`KVBlockCorrupt` unless it is exactly the
    block of ``token_ids`` with this ``shape`` and ``dtype``."""
    if len(value) < _HEADER_LEN.size:
        raise KVBlockCorrupt(f"value too short ({len(value)} bytes)")
    magic, header_len = _HEADER_LEN.unpack_from(value)
    if magic != MAGIC:
        raise KVBlockCorrupt(f"bad magic {magic!r}")
    try:
        header = json.loads(value[_HEADER_LEN.size : _HEADER_LEN.size + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVBlockCorrupt(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise KVBlockCorrupt("header is not a JSON object")
    payload = value[_HEADER_LEN.size + header_len :]
    expected = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "token_ids": list(token_ids)}
    for field, want in expected.items():
        if header.get(field) != want:
            raise KVBlockCorrupt(f"header {field} is {str(header.get(field))[:60]}, expected {str(want)[:60]}")
    if len(payload) != header.get("nbytes"):
        raise KVBlockCorrupt(f"payload is {len(payload)} bytes, header says {header.get('nbytes')}")
    if xxhash.xxh64_hexdigest(payload) != header.get("xxh64"):
        raise KVBlockCorrupt("payload checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


# ---------------------------------------------------------------------- backends
class KVPoolBackend(ABC):
    """A key-value store of bytes. Keys are strings; a first write wins (no overwrite)."""

    name = "backend"

    @abstractmethod
    def put_many(self, items: dict[str, bytes]) -> None:
        """Store every item; raise :class:`KVPoolError` if the store refuses."""

    @abstractmethod
    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Values in key order, ``None`` for a key the store does not hold."""

    @abstractmethod
    def exists_many(self, keys: list[str]) -> list[bool]:
        """Presence of each key; raise :class:`KVPoolError` if the store cannot answer."""

    def close(self) -> None:  # noqa: B027  (optional: a backend holding nothing need not override it)
        """Release connections and memory."""


class EmbeddedKVPool(KVPoolBackend):
    """An in-process pool: a thread-safe dict evicting least recently used values past a capacity.

    Every ``GlobalKVPool`` given the same instance shares it, which is how tests and the demo
    model several engines in one process without any service.
    """

    name = "embedded"

    def __init__(self, capacity_bytes: int = 1 << 30):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def put_many(self, items: dict[str, bytes]) -> None:
        with self._lock:
            for key, value in items.items():
                if key in self._data or len(value) > self.capacity_bytes:
                    continue
                while self._nbytes + len(value) > self.capacity_bytes:
                    _, old = self._data.popitem(last=False)
                    self._nbytes -= len(old)
                self._data[key] = bytes(value)
                self._nbytes += len(value)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            out = []
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
            return out

    def exists_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._data for key in keys]

    def remove(self, key: str) -> None:
        """Drop one key (what an eviction does; used to test fetch-after-eviction)."""
        with self._lock:
            value = self._data.pop(key, None)
            if value is not None:
                self._nbytes -= len(value)

    def __len__(self) -> int:
        return len(self._data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeKVPool(KVPoolBackend):
    """The real Mooncake Store (``mooncake.store.MooncakeDistributedStore``) over TCP.

    Args:
        master_addr: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_url: its HTTP metadata server, ``http://host:port/metadata``.
        local_hostname: this engine's ``host:port`` in the transfer engine; every engine needs a
            distinct one (default: loopback and a free port).
        global_segment_size: bytes of this process's memory lent to the pool. Values may be
            placed there, and vanish when this process exits; 0 lends nothing, so values live
            in other segments (e.g. a standalone ``mooncake_client``) and outlive this process.
        local_buffer_size: bytes of the staging buffer used by put/get.
        protocol: ``"tcp"`` (``"rdma"`` on machines with RDMA NICs).
        setup_attempts: how many times to try reaching the master before giving up.

    Raises :class:`KVPoolError` when the store cannot be reached.
    """

    name = "mooncake"

    def __init__(
        self,
        master_addr: str,
        metadata_url: str,
        local_hostname: str | None = None,
        global_segment_size: int = 64 << 20,
        local_buffer_size: int = 64 << 20,
        protocol: str = "tcp",
        setup_attempts: int = 3,
    ):
        if setup_attempts < 1:
            raise ValueError(f"setup_attempts must be >= 1, got {setup_attempts}")
        if global_segment_size < 0:
            raise ValueError(f"global_segment_size must be >= 0, got {global_segment_size}")
        if local_buffer_size <= 0:
            raise ValueError(f"local_buffer_size must be positive, got {local_buffer_size}")
        # Without this Mooncake advertises the machine's first interface, unreachable on loopback.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise KVPoolError(f"the Mooncake store cannot be imported: {exc}") from exc
        # A master that has only just opened its port can drop a first connection (RPC "End of
        # file", code -600): each attempt gets a fresh store, and a fresh port when none is given.
        for attempt in range(1, setup_attempts + 1):
            self.local_hostname = local_hostname or f"127.0.0.1:{_free_port()}"
            self._store = MooncakeDistributedStore()
            rc = self._store.setup(
                self.local_hostname, metadata_url, global_segment_size, local_buffer_size, protocol, "", master_addr
            )
            if rc == 0:
                break
            self._store.close()  # releases the failed attempt's buffers at once, not at collection
            if attempt < setup_attempts:
                time.sleep(0.5 * attempt)
        else:
            raise KVPoolError(
                f"Mooncake setup failed with code {rc} after {setup_attempts} attempts "
                f"(master {master_addr}, metadata {metadata_url})"
            )
        self._closed = False

    def put_many(self, items: dict[str, bytes]) -> None:
        if not items:
            return
        rc = self._store.put_batch(list(items), list(items.values()))
        if rc != 0:
            raise KVPoolError(f"Mooncake put_batch failed with code {rc}")

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        # Mooncake reads a missing (or unreachable) key back as b'': the caller treats it as gone.
        return [value or None for value in self._store.get_batch(keys)] if keys else []

    def exists_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._store.batch_is_exist(keys)
        if any(code < 0 for code in codes):
            raise KVPoolError(f"Mooncake batch_is_exist failed with code {min(codes)}")
        return [code == 1 for code in codes]

    def remove(self, key: str) -> int:
        """Remove one key; returns Mooncake's code (non-zero while a reader holds its lease)."""
        return self._store.remove(key)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.close()


# ---------------------------------------------------------------------- the pool
class GlobalKVPool:
    """Publish, query and fetch KV blocks by chained hash through a :class:`KVPoolBackend`.

    Args:
        backend: where blocks live; a private :class:`EmbeddedKVPool` when omitted.
        namespace: part of every key; must identify the model and KV layout (two models'
            blocks with the same token ids must never meet).
        block_size: tokens per block; ``query`` answers in tokens (leading blocks held times
            this).

        retry_after_s: after the store itself fails (down, unreachable), the pool answers "miss"
            at once for this long instead of asking again: a dead master costs one timeout per
            ``retry_after_s``, not one per request.

    Counters: ``num_published`` / ``num_fetched`` blocks, ``num_faults`` fetches or queries that
    fell back to recompute.
    """

    def __init__(
        self,
        backend: KVPoolBackend | None = None,
        namespace: str = "default",
        block_size: int = 16,
        retry_after_s: float = 10.0,
    ):
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty string without '/', got {namespace!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.backend = backend if backend is not None else EmbeddedKVPool()
        self.namespace = namespace
        self.block_size = block_size
        self.num_published = 0
        self.num_fetched = 0
        self.num_faults = 0
        self.retry_after_s = retry_after_s
        self._unavailable_until = 0.0

    def block_key(self, block_hash: BlockHash) -> str:
        return f"vfs/{self.namespace}/{block_hash.hex()}"

    def _fault(self, message: str) -> None:
        self.num_faults += 1
        warnings.warn(
            f"global KV pool ({self.backend.name}): {message}; recomputing instead", RuntimeWarning, stacklevel=3
        )

    def _store_failed(self, message: str) -> None:
        self._unavailable_until = time.monotonic() + self.retry_after_s
        self._fault(f"{message}; not asking again for {self.retry_after_s:g} s")

    @property
    def available(self) -> bool:
        """False for ``retry_after_s`` after the store failed."""
        return time.monotonic() >= self._unavailable_until

    def _num_leading_present(self, block_hashes: list[BlockHash]) -> int:
        if not self.available:
            return 0
        try:
            present = self.backend.exists_many([self.block_key(h) for h in block_hashes])
        except Exception as exc:  # any store failure is a miss, never an engine crash
            self._store_failed(f"query failed ({exc})")
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def query(self, block_hashes: list[BlockHash]) -> int:
        """Tokens of the longest prefix of the chain ``block_hashes`` that the pool holds."""
        return self._num_leading_present(block_hashes) * self.block_size

    def publish(
        self,
        block_hashes: list[BlockHash],
        block_token_ids: list[tuple[int, ...]],
        kv_cache: torch.Tensor,
        block_ids: list[int],
    ) -> int:
        """Store the blocks ``block_ids`` of ``kv_cache`` under their hashes; returns how many
        were new. Blocks the pool already holds are not sent again."""
        if not len(block_hashes) == len(block_token_ids) == len(block_ids):
            raise ValueError("block_hashes, block_token_ids and block_ids must have the same length")
        keys = [self.block_key(h) for h in block_hashes]
        if not self.available:
            return 0
        try:
            present = self.backend.exists_many(keys)
            items = {
                key: serialize_block(kv_cache[:, :, block_id], tuple(tokens))
                for key, tokens, block_id, there in zip(keys, block_token_ids, block_ids, present)
                if not there
            }
            self.backend.put_many(items)
        except Exception as exc:
            self._store_failed(f"publish failed ({exc})")
            return 0
        self.num_published += len(items)
        return len(items)

    def fetch(
        self,
        block_hashes: list[BlockHash],
        block_token_ids: list[tuple[int, ...]],
        kv_cache: torch.Tensor,
        block_ids: list[int],
    ) -> int:
        """Load the leading blocks of the chain into ``kv_cache[:, :, block_ids[i]]``.

        Returns how many blocks were loaded: all of them, or fewer when a block is missing or
        invalid (a warning says which). Loading stops at the first bad block, because a later
        block is useless without the K/V of every block before it.
        """
        if not len(block_hashes) == len(block_token_ids) == len(block_ids):
            raise ValueError("block_hashes, block_token_ids and block_ids must have the same length")
        if not block_hashes:
            return 0
        shape = tuple(kv_cache[:, :, 0].shape)
        if not self.available:
            self._fault("the store failed recently")
            return 0
        try:
            values = self.backend.get_many([self.block_key(h) for h in block_hashes])
        except Exception as exc:
            self._store_failed(f"fetch failed ({exc})")
            return 0
        for i, (value, tokens, block_id) in enumerate(zip(values, block_token_ids, block_ids)):
            if value is None:
                self._fault(f"block {i} ({block_hashes[i].hex()[:12]}) vanished before fetch")
                return i
            try:
                kv = deserialize_block(value, shape, kv_cache.dtype, tuple(tokens))
            except KVBlockCorrupt as exc:
                self._fault(f"block {i} ({block_hashes[i].hex()[:12]}) is invalid: {exc}")
                return i
            kv_cache[:, :, block_id].copy_(kv)
            self.num_fetched += 1
        return len(block_hashes)

    # ------------------------------------------------------------------ with a block manager
    def publish_sequence(self, seq, block_manager, kv_cache: torch.Tensor) -> int:
        """Publish every full, computed block of ``seq`` (after its prefill); returns new blocks."""
        n = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        hashes = block_manager.block_hashes(seq)[:n]
        return self.publish(hashes, [tuple(seq.block(i)) for i in range(n)], kv_cache, seq.block_table[:n])

    def load_sequence(self, seq, block_manager, kv_cache: torch.Tensor) -> int:
        """Extend ``seq``'s computed prefix from the pool; returns the tokens loaded.

        Call it after the block manager attached the local hits and allocated the rest (so
        ``seq.num_computed_tokens`` is block-aligned). The pool's blocks are loaded into the
        sequence's own next blocks, capped like local hits (the last prompt token is always
        recomputed), and registered in the local prefix cache.
        """
        if block_manager.block_size != self.block_size:
            raise ValueError(f"block_manager.block_size {block_manager.block_size} != pool's {self.block_size}")
        if seq.num_computed_tokens % self.block_size:
            raise ValueError("load_sequence needs a block-aligned seq.num_computed_tokens")
        start = seq.num_computed_tokens // self.block_size
        end = min(block_manager.max_hit_blocks(seq), len(seq.block_table))
        hashes = block_manager.block_hashes(seq)[start:end]
        n = self._num_leading_present(hashes)
        n = self.fetch(
            hashes[:n],
            [tuple(seq.block(i)) for i in range(start, start + n)],
            kv_cache,
            seq.block_table[start : start + n],
        )
        seq.num_computed_tokens += n * self.block_size
        seq.num_cached_tokens += n * self.block_size
        block_manager.cache_full_blocks(seq)
        return n * self.block_size
