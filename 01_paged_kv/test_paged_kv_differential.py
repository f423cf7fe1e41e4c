"""Chapter 01's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Each test draws inputs across the function's whole domain (block sizes, tables that are not
contiguous, shared blocks, padding, negative positions, int32 and int64, float32 and bfloat16,
empty batches, too-small caches) and checks that the function in place does what the book's
does: the same values, the same errors, the same state left behind. With the book's own code in
place (the default) both sides are the book, and the tests check that every drawn input is one it
accepts.
"""

from __future__ import annotations

import torch

from block_manager import BlockManager
from kv_cache import build_slot_mapping
from sequence import Sequence
from store_kvcache import store_kvcache_torch


def _manager_state(bm: BlockManager, seqs: list[Sequence]) -> dict:
    return {
        "free queue (least recently freed first)": list(bm.free_block_ids),
        "used blocks": sorted(bm.used_block_ids),
        "reference counts": [b.ref_count for b in bm.blocks],
        "block tables": [list(s.block_table) for s in seqs],
    }


def _run_block_manager_life(differential, method: str, rng) -> None:
    """The same random life (allocations with and without prefix hits, frees) for a manager with
    the method in place and one with the book's; after every call both must be in the same state."""
    num_blocks, bs = rng.randint(1, 12), rng.choice([1, 2, 3, 4, 16])
    yours, book = BlockManager(num_blocks, bs), differential.twin(BlockManager, method)(num_blocks, bs)
    lengths = [rng.randint(1, 3 * bs * num_blocks) for _ in range(rng.randint(1, 4))]
    your_seqs = [Sequence(range(n), block_size=bs) for n in lengths]
    book_seqs = [Sequence(range(n), block_size=bs) for n in lengths]
    history = [f"BlockManager({num_blocks}, block_size={bs})"]
    for _ in range(rng.randint(1, 12)):
        i = rng.randrange(len(lengths))
        seq_y, seq_b = your_seqs[i], book_seqs[i]
        if seq_b.block_table and rng.random() < 0.3:
            call = f"free(seq {i})"
            out_y = differential.call(yours.free, seq_y)
            out_b = differential.call(book.free, seq_b)
            if out_b.error is None:
                seq_y.num_computed_tokens = seq_b.num_computed_tokens = 0
        else:
            hits: list[int] = []
            if not seq_b.block_table and rng.random() < 0.5:
                # A prefix hit: blocks another sequence holds, or idle ones (chapter 03's cached).
                held = [b for s in book_seqs for b in s.block_table]
                pool = sorted(set(held)) + list(book.free_block_ids)
                hits = rng.sample(pool, rng.randint(0, min(len(pool), 3)))
            n = rng.choice([-1, 0, 1, bs - 1, bs, bs + 1, rng.randint(0, 2 * bs * num_blocks)])
            call = f"allocate_slots(seq {i}, num_new_tokens={n}, computed_blocks={hits})"
            out_y = differential.call(yours.allocate_slots, seq_y, n, list(hits))
            out_b = differential.call(book.allocate_slots, seq_b, n, list(hits))
            if out_b.error is None and out_b.value:
                for s in (seq_y, seq_b):
                    s.num_computed_tokens += len(hits) * bs + n
        history.append(call)
        differential.agree(
            " -> ".join(history),
            out_y,
            out_b,
            meaning="a manager hands out whole blocks, attaches prefix hits first (one more holder each, an idle "
            "one leaves the free queue), fails without changing anything, and frees tail first by reference count",
            state=(_manager_state(yours, your_seqs), _manager_state(book, book_seqs)),
        )


def test_allocate_slots(differential):
    differential.run(lambda rng: _run_block_manager_life(differential, "allocate_slots", rng), examples=150)


def test_free(differential):
    differential.run(lambda rng: _run_block_manager_life(differential, "free", rng), examples=150)


def test_slot_mapping(differential):
    book_slot_mapping = differential.book(BlockManager.slot_mapping)

    def check(rng):
        num_blocks, bs = rng.randint(1, 16), rng.choice([1, 2, 3, 4, 16])
        bm = BlockManager(num_blocks, bs)
        seq = Sequence(range(rng.randint(1, num_blocks * bs)), block_size=bs)
        # Any blocks in any order: a sequence's blocks are wherever the manager found room.
        seq.block_table = rng.sample(range(num_blocks), rng.randint(0, num_blocks))
        capacity = len(seq.block_table) * bs
        end = rng.choice([capacity, capacity + 1, rng.randint(0, capacity + 2)])
        start = rng.randint(0, end)
        differential.agree(
            f"slot_mapping(seq, start={start}, end={end}) with block_table={seq.block_table}, block_size={bs}",
            differential.call(BlockManager.slot_mapping, bm, seq, start, end),
            differential.call(book_slot_mapping, bm, seq, start, end),
            meaning="slot of position p = block_table[p // block_size] * block_size + p % block_size; positions "
            "past the table are a ValueError",
        )

    differential.run(check, examples=200)


def test_build_slot_mapping(differential):
    book_build = differential.book(build_slot_mapping)

    def check(rng):
        batch, width, bs = rng.randint(0, 5), rng.randint(1, 6), rng.choice([1, 2, 4, 16])
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        table_dtype = rng.choice([torch.int32, torch.int64])
        # Padding past a sequence's blocks may hold anything: -1, 0, a huge id.
        tables = torch.randint(-1, 1000, (batch, width), generator=gen, dtype=table_dtype)
        decode = rng.random() < 0.4 or batch == 0
        n = batch if decode else rng.randint(0, 12)
        positions = torch.randint(0, width * bs + (1 if rng.random() < 0.2 else 0), (n,), generator=gen)
        for i in rng.sample(range(n), rng.randint(0, n)):
            positions[i] = rng.choice([-1, -1, -2, -100])  # padding
        positions = positions.to(rng.choice([torch.int32, torch.int64]))
        seq_ids = None if decode else torch.randint(0, batch, (n,), generator=gen) if batch else None
        if seq_ids is None and not decode:
            positions, n = positions[:batch], batch
        if seq_ids is not None:
            seq_ids = seq_ids.to(rng.choice([torch.int32, torch.int64]))
        call = (
            f"build_slot_mapping(block_tables={tables.tolist()}, positions={positions.tolist()}, block_size={bs}, "
            f"seq_ids={None if seq_ids is None else seq_ids.tolist()})"
        )
        differential.agree(
            call,
            differential.call(build_slot_mapping, tables.clone(), positions.clone(), bs, seq_ids),
            differential.call(book_build, tables.clone(), positions.clone(), bs, seq_ids),
            meaning="slot = block_tables[seq, p // block_size] * block_size + p % block_size as int64, -1 for a "
            "negative (padding) position, ValueError for a position past its row's table",
        )

    differential.run(check, examples=200)


def test_store_kvcache_torch(differential):
    book_store = differential.book(store_kvcache_torch)

    def check(rng):
        num_blocks, bs, heads, dim = (
            rng.randint(1, 5),
            rng.choice([1, 2, 4, 16]),
            rng.randint(1, 3),
            rng.choice([1, 4, 8]),
        )
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        num_slots = num_blocks * bs
        n = rng.randint(0, num_slots)
        slots = torch.randperm(num_slots, generator=gen)[:n]  # distinct: each slot holds one token
        for i in rng.sample(range(n), rng.randint(0, n)):
            slots[i] = -1  # "do not store"
        if n and rng.random() < 0.1:
            slots[rng.randrange(n)] = num_slots + rng.randint(0, 3)  # past the cache
        slots = slots.to(rng.choice([torch.int32, torch.int64]))
        key = torch.randn(n, heads, dim, generator=gen).to(dtype)
        value = torch.randn(n, heads, dim, generator=gen).to(dtype)
        cache = torch.randn(2, num_blocks, bs, heads, dim, generator=gen).to(dtype)
        mine, theirs = cache.clone(), cache.clone()
        differential.agree(
            f"store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping={slots.tolist()}) with {n} tokens of "
            f"{heads} kv heads x {dim}, cache of {num_blocks} blocks x {bs} slots, {dtype}",
            differential.call(store_kvcache_torch, key, value, mine[0], mine[1], slots.clone()),
            differential.call(book_store, key, value, theirs[0], theirs[1], slots.clone()),
            meaning="token i's K and V go to flat slot slot_mapping[i] of the cache itself (block slot // block_size, "
            "offset slot % block_size); a -1 slot stores nothing; a slot past the cache is a ValueError",
            state=({"k_cache": mine[0], "v_cache": mine[1]}, {"k_cache": theirs[0], "v_cache": theirs[1]}),
        )

    differential.run(check, examples=150)
