"""Chapter 03's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Drawn: token ids (negative, huge, none), parent hashes and extra keys (valid or not), lives of a
prefix-caching block manager and of the stand-alone cache (prompts sharing prefixes, the same
prompt again, chunks, decodes, frees, tenants, evictions, and hash collisions: a cached block whose
token ids are not the ones its hash stands for), stored KV blocks corrupted every way a store can
corrupt them, and stores that lose blocks or go down.
"""

from __future__ import annotations

import json
import warnings

import torch

from global_kv_pool import (
    _HEADER_LEN,
    EmbeddedKVPool,
    GlobalKVPool,
    KVPoolError,
    deserialize_block,
    serialize_block,
)
from prefix_block_manager import PrefixCachingBlockManager
from prefix_cache_local import BLOCK_SIZE, NONE_HASH, PrefixCacheLocal, compute_block_hash
from sequence import Sequence

COLLISION = "a cached block whose token ids differ from the looked-up block's is a hash collision: a miss"


def test_compute_block_hash(differential):
    book_hash = differential.book(compute_block_hash)

    def check(rng):
        parent = rng.choice(
            [None, NONE_HASH, compute_block_hash(None, [rng.randint(0, 9)]), b"\x00" * 8, "not bytes", bytes(16)]
        )
        n = rng.choice([0, 1, rng.randint(1, 40)])
        tokens = [rng.choice([rng.randint(0, 200), rng.randint(-(2**63), 2**63 - 1), -1]) for _ in range(n)]
        tokens = rng.choice([tokens, tuple(tokens)])
        extra = rng.choice(
            [None, (), ("tenant",), (3,), (3, "salt"), (None,), (1.5,), (float("nan"),), (object(),), ("é",)]
        )
        differential.agree(
            f"compute_block_hash({parent!r}, {tokens!r}, extra_keys={extra!r})",
            differential.call(compute_block_hash, parent, tokens, extra),
            differential.call(book_hash, parent, tokens, extra),
            meaning="xxh3_128 of parent hash (NONE_HASH for None) || token count and ids as little-endian int64 || "
            "the extra keys as compact JSON; anything but a 16-byte parent or JSON-able keys is a ValueError",
        )

    differential.run(check, examples=200)


def _manager_state(bm: PrefixCachingBlockManager, seqs: list[Sequence]) -> dict:
    return {
        "free queue": list(bm.free_block_ids),
        "reference counts": [b.ref_count for b in bm.blocks],
        "blocks' hashes": [b.block_hash.hex()[:12] if b.block_hash else None for b in bm.blocks],
        "blocks' token ids": [list(b.token_ids) for b in bm.blocks],
        "hash -> block": sorted((h.hex()[:12], b) for h, b in bm.cached_block_hash_to_block.items()),
        "evictions": bm.num_evictions,
        "queries and hits (tokens)": (bm.prefix_cache_queries, bm.prefix_cache_hits),
        "block tables": [list(s.block_table) for s in seqs],
        "registered blocks per sequence": [s.num_registered_blocks for s in seqs],
    }


def _run_prefix_manager_life(differential, method: str, rng) -> None:
    """One random life, the same for a manager with the method in place and one with the book's:
    admissions with prefix hits (whole prompts or chunks), decodes, frees, collisions."""
    bs, num_blocks = rng.choice([1, 2, 3, 4]), rng.randint(2, 16)
    yours, book = (
        PrefixCachingBlockManager(num_blocks, bs),
        differential.twin(PrefixCachingBlockManager, method)(num_blocks, bs),
    )
    bases = [[rng.randrange(1, 40) for _ in range(24)] for _ in range(2)]
    prompts = []
    for _ in range(rng.randint(1, 5)):
        if prompts and rng.random() < 0.3:
            prompts.append(list(rng.choice(prompts)))  # the same prompt again: a full hit, capped
        else:
            shared = rng.randint(0, 24)
            prompts.append(rng.choice(bases)[:shared] + [rng.randrange(1, 40) for _ in range(rng.randint(1, 10))])
    salts = [rng.choice([None, None, "tenant-a", "tenant-b"]) for _ in prompts]
    sides = {
        "yours": (yours, [Sequence(p, bs, s) for p, s in zip(prompts, salts)]),
        "book": (book, [Sequence(p, bs, s) for p, s in zip(prompts, salts)]),
    }
    history = [f"PrefixCachingBlockManager({num_blocks}, block_size={bs}), prompts {prompts}, salts {salts}"]
    for _ in range(rng.randint(1, 14)):
        i = rng.randrange(len(prompts))
        op = rng.choice(["admit", "admit", "step", "decode", "free", "collide"])
        chunk = rng.choice([None, rng.randint(1, 6)])  # the whole rest, or a chunk of it
        cached = sorted(book.cached_block_hash_to_block.values())
        victim = rng.choice(cached) if cached else None
        other = tuple(rng.randrange(1, 40) for _ in range(bs))
        results = {}
        for side, (bm, seqs) in sides.items():
            seq, out = seqs[i], []
            if op == "admit" and not seq.block_table:
                hits = bm.get_computed_blocks(seq)
                n = seq.num_tokens - len(hits) * bs if chunk is None else min(chunk, seq.num_tokens - len(hits) * bs)
                ok = bm.allocate_slots(seq, n, hits)
                out = [f"get_computed_blocks -> {hits}", f"allocate_slots({n}) -> {ok}"]
                if ok:
                    seq.num_computed_tokens = len(hits) * bs + n
                    bm.cache_full_blocks(seq)
            elif op == "step" and seq.block_table and seq.num_computed_tokens < seq.num_tokens:
                n = seq.num_tokens - seq.num_computed_tokens if chunk is None else chunk
                n = min(n, seq.num_tokens - seq.num_computed_tokens)
                ok = bm.allocate_slots(seq, n)
                out = [f"allocate_slots({n}) -> {ok}"]
                if ok:
                    seq.num_computed_tokens += n
                    bm.cache_full_blocks(seq)
            elif op == "decode" and seq.block_table and seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(other[0])
                ok = bm.allocate_slots(seq, 1)
                out = [f"append a token, allocate_slots(1) -> {ok}"]
                if ok:
                    seq.num_computed_tokens += 1
                    bm.cache_full_blocks(seq)
            elif op == "free" and seq.block_table:
                bm.free(seq)
                seq.num_computed_tokens = 0
                out = ["free"]
            elif op == "collide" and victim is not None:
                bm.blocks[victim].token_ids = other  # the hash now stands for other tokens
                out = [f"block {victim} holds other tokens under its hash"]
            results[side] = out
        history.append(f"{op} seq {i}: " + "; ".join(results["book"]) if results["book"] else f"{op} seq {i}: -")
        differential.agree(
            " -> ".join(history[-6:]),
            differential.call(lambda r=results: r["yours"]),
            differential.call(lambda r=results: r["book"]),
            meaning="hits are the longest chain of cached blocks holding the sequence's own tokens, capped so the "
            "last token is recomputed; only full computed blocks are registered, once, first holder wins; a "
            "freed block keeps its hash until the block is handed out again. " + COLLISION,
            state=(_manager_state(yours, sides["yours"][1]), _manager_state(book, sides["book"][1])),
        )


def test_get_computed_blocks(differential):
    differential.run(lambda rng: _run_prefix_manager_life(differential, "get_computed_blocks", rng), examples=150)


def test_cache_full_blocks(differential):
    differential.run(lambda rng: _run_prefix_manager_life(differential, "cache_full_blocks", rng), examples=150)


def test_allocate_block(differential):
    differential.run(lambda rng: _run_prefix_manager_life(differential, "_allocate_block", rng), examples=150)


def _stored_block(rng):
    """A serialized block and what a fetch expects of it, then damaged the ways a store can damage it."""
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    shape = (2, rng.randint(1, 3), rng.choice([1, 2, 4]), rng.randint(1, 2), rng.choice([1, 4]))
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(rng.getrandbits(32))).to(dtype)
    tokens = tuple(rng.randrange(0, 500) for _ in range(shape[2]))
    value = bytearray(serialize_block(kv, tokens))
    header_len = _HEADER_LEN.unpack_from(value)[1]
    header_end = _HEADER_LEN.size + header_len
    damage = rng.choice(
        ["none", "none", "short", "magic", "header", "not an object", "shape", "dtype", "tokens", "nbytes",
         "payload", "extra bytes", "missing field"]
    )  # fmt: skip
    header = json.loads(value[_HEADER_LEN.size : header_end])
    if damage == "short":
        value = value[: rng.randrange(0, len(value))]
    elif damage == "magic":
        value[0:4] = b"XXXX"
    elif damage == "header":
        value[_HEADER_LEN.size] = ord("}")
    elif damage == "payload" and header_end < len(value):
        value[rng.randrange(header_end, len(value))] ^= 0xFF
    elif damage == "extra bytes":
        value += b"\x00"
    elif damage in ("not an object", "shape", "dtype", "tokens", "nbytes", "missing field"):
        if damage == "not an object":
            header = [header]
        elif damage == "shape":
            header["shape"] = list(reversed(header["shape"]))
        elif damage == "dtype":
            header["dtype"] = "int8"
        elif damage == "tokens":
            header["token_ids"] = header["token_ids"][::-1] + [1]
        elif damage == "nbytes":
            header["nbytes"] += 1
        else:
            del header[rng.choice(["shape", "dtype", "token_ids", "nbytes", "xxh64"])]
        raw = json.dumps(header).encode()
        value = bytearray(_HEADER_LEN.pack(b"VFKV", len(raw))) + raw + value[header_end:]
    return bytes(value), shape, dtype, tokens, damage


def test_deserialize_block(differential):
    book_deserialize = differential.book(deserialize_block)

    def check(rng):
        value, shape, dtype, tokens, damage = _stored_block(rng)
        differential.agree(
            f"deserialize_block(<{len(value)} bytes, damage: {damage}>, shape={shape}, dtype={dtype}, "
            f"token_ids={tokens})",
            differential.call(deserialize_block, value, shape, dtype, tokens),
            differential.call(book_deserialize, value, shape, dtype, tokens),
            meaning="a stored block is returned only when its magic, JSON header (shape, dtype, token ids), payload "
            "size and xxh64 checksum all match what the caller expects; anything else is KVBlockCorrupt",
        )

    differential.run(check, examples=250)


class _DownPool(EmbeddedKVPool):
    """A store whose reads fail."""

    name = "down"

    def get_many(self, keys):
        raise KVPoolError("connection refused")


def test_fetch(differential):
    BookPool = differential.twin(GlobalKVPool, "fetch")

    def check(rng):
        layers, bs, heads, dim = rng.randint(1, 2), rng.choice([1, 2, 4]), rng.randint(1, 2), rng.choice([1, 4])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        num_blocks, n = rng.randint(1, 6), rng.randint(0, 5)
        source = torch.randn(2, layers, n, bs, heads, dim, generator=gen).to(dtype)
        tokens = [tuple(rng.randrange(0, 100) for _ in range(bs)) for _ in range(n)]
        hashes = []
        for t in tokens:
            hashes.append(compute_block_hash(hashes[-1] if hashes else None, t))
        down = rng.random() < 0.1
        stores = [(_DownPool if down else EmbeddedKVPool)() for _ in range(2)]
        pools = [GlobalKVPool(stores[0], block_size=bs), BookPool(stores[1], block_size=bs)]
        damage = []
        for i in range(n):
            what = rng.choice(["stored"] * 4 + ["missing", "corrupt", "other tokens", "other dtype"])
            damage.append(what)
            block = source[:, :, i]
            value = {
                "stored": serialize_block(block, tokens[i]),
                "corrupt": serialize_block(block, tokens[i])[:-1] + b"!",
                "other tokens": serialize_block(block, tuple(reversed(tokens[i])) + (0,)),
                "other dtype": serialize_block(block.to(torch.float16), tokens[i]),
            }.get(what)
            for pool in pools:
                if value is not None and not down:
                    EmbeddedKVPool.put_many(pool.backend, {pool.block_key(hashes[i]): value})
        recently_failed = rng.random() < 0.05
        block_ids = rng.sample(range(num_blocks), min(n, num_blocks))
        asked_tokens = list(tokens[: len(block_ids)])
        asked_hashes = hashes[: len(block_ids)]
        if rng.random() < 0.05 and asked_hashes:
            asked_tokens = asked_tokens[:-1]  # lengths that disagree: a ValueError
        caches = [torch.zeros(2, layers, num_blocks, bs, heads, dim, dtype=dtype) for _ in pools]
        outcomes = []
        for pool, cache in zip(pools, caches):
            if recently_failed:
                pool._unavailable_until = float("inf")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                outcomes.append(differential.call(pool.fetch, asked_hashes, asked_tokens, cache, block_ids))

        def state(pool, cache):
            return {"kv_cache": cache, "blocks fetched": pool.num_fetched, "faults": pool.num_faults}

        differential.agree(
            f"fetch of a chain of {len(asked_hashes)} blocks into blocks {block_ids} ({', '.join(damage) or 'empty'}"
            f"{', store down' if down else ''}{', store failed recently' if recently_failed else ''})",
            *outcomes,
            meaning="blocks load in chain order into the caller's blocks until the first one that is missing or "
            "invalid (a fault, counted and warned about); a store that fails is a fault too, never an exception; the "
            "result is how many blocks were loaded",
            state=(state(pools[0], caches[0]), state(pools[1], caches[1])),
        )

    differential.run(check, examples=150)


def _local_state(cache: PrefixCacheLocal) -> dict:
    return {
        "cached blocks, least recently used first": [
            (h.hex()[:12], b.block_id, list(b.token_ids), b.ref_cnt) for h, b in cache._cache.items()
        ],
        "tokens looked up, found": (cache._total_count, cache._hit_count),
        "evictions": cache.num_evictions,
    }


def test_match_prefix(differential):
    BookCache = differential.twin(PrefixCacheLocal, "match_prefix")

    def check(rng):
        capacity = rng.randint(1, 8)
        caches = [PrefixCacheLocal(capacity), BookCache(capacity)]
        base = [rng.randrange(1, 30) for _ in range(4 * BLOCK_SIZE)]
        held: list[list] = [[], []]
        history = [f"PrefixCacheLocal({capacity})"]
        for _ in range(rng.randint(1, 8)):
            length = rng.randint(0, 4 * BLOCK_SIZE + 3)
            prompt = base[: rng.randint(0, length)]
            prompt = prompt + [rng.randrange(1, 30) for _ in range(length - len(prompt))]
            extra, salt = rng.choice([None, None, ("lora-1",)]), rng.choice([None, None, "tenant"])
            op = rng.choice(["cache", "match", "match", "release", "collide"])
            keys = list(caches[1]._cache)
            victim = rng.choice(keys) if keys else None
            starts_using = rng.random() < 0.5  # a request starts using the blocks a match finds: on both sides
            outcomes = []
            for i, cache in enumerate(caches):
                if op == "cache":
                    blocks = cache.cache_computed_blocks(prompt, extra, salt)
                    outcomes.append(differential.call(lambda b=blocks: [x.block_id for x in b]))
                elif op == "match":
                    out = differential.call(cache.match_prefix, prompt, extra, salt)
                    if out.error is None:
                        blocks, num_tokens = out.value
                        out.value = ([b.block_id for b in blocks], num_tokens)
                        if starts_using:
                            cache.touch(blocks)
                            held[i].append(blocks)
                    outcomes.append(out)
                elif op == "release" and held[i]:
                    cache.release(held[i].pop(0))
                    outcomes.append(differential.call(lambda: None))
                elif op == "collide" and victim is not None and victim in cache._cache:
                    cache._cache[victim].token_ids = tuple(range(1000, 1000 + BLOCK_SIZE))
                    outcomes.append(differential.call(lambda: None))
                else:
                    outcomes.append(differential.call(lambda: None))
            history.append(f"{op}({len(prompt)} tokens, extra_keys={extra}, cache_salt={salt})")
            differential.agree(
                " -> ".join(history[-5:]),
                *outcomes,
                meaning="match_prefix returns the cached blocks of the longest prefix whose every block is cached with "
                "the prompt's own tokens, and their token count; it moves each hit to the most recently used end "
                "and counts looked-up and found tokens. " + COLLISION,
                state=(_local_state(caches[0]), _local_state(caches[1])),
            )

    differential.run(check, examples=150)
