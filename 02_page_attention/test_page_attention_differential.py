"""Chapter 02's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Drawn: float32 and bfloat16, head dims, GQA ratios (1, 2, 4 query heads per kv head), softmax
scales other than 1/sqrt(head_dim), block sizes, block tables in any order with padding that holds
anything, context lengths on and off block boundaries, empty batches, prompt rows next to decode
rows, causal or not, and the malformed arguments each function must refuse.
"""

from __future__ import annotations

import torch

from block_manager import cdiv
from paged_attention import gather_kv, paged_attention_decode, paged_attention_varlen

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
ATTENTION = (
    "softmax(q k^T * scale) v over the keys each query may see: sequence b's first seq_len[b] tokens, read "
    "through its block table (token p in block block_table[p // block_size], slot p % block_size); query head "
    "h uses kv head h // (q heads / kv heads)"
)


def _paged_cache(rng, lens: list[int], dtype: torch.dtype, gqa: bool = True):
    """A cache with each sequence's tokens in shuffled physical blocks and large garbage everywhere
    else; block tables padded with anything (-1, 0, ids past the cache) past each sequence's blocks."""
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    bs = rng.choice([1, 2, 4, 8, 16])
    kv_heads = rng.choice([1, 2]) if gqa else 1
    head_dim = rng.choice([1, 4, 8, 16, 64])
    blocks = [cdiv(n, bs) for n in lens]
    num_blocks = sum(blocks) + rng.randint(0, 3) or 1
    k_cache = (torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen) * 4).to(dtype)
    v_cache = (torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen) * 4).to(dtype)
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks, default=0) + rng.randint(0, 2) or 1
    tables = []
    for nb in blocks:
        row = [physical.pop() for _ in range(nb)]
        tables.append(row + [rng.choice([-1, 0, num_blocks, num_blocks + 7]) for _ in range(width - nb)])
    block_tables = torch.tensor(tables, dtype=rng.choice([torch.int32, torch.int64])).reshape(len(lens), width)
    return k_cache, v_cache, block_tables, gen


def _scale(rng, head_dim: int) -> float:
    return rng.choice([head_dim**-0.5, 1.0, 0.05, rng.uniform(0.01, 2.0)])


def test_gather_kv(differential):
    book_gather = differential.book(gather_kv)

    def check(rng):
        lens = [rng.randint(0, 40) for _ in range(rng.randint(0, 4))]
        dtype = rng.choice([torch.float32, torch.bfloat16])
        k_cache, _, tables, _ = _paged_cache(rng, lens, dtype)
        max_len = max(lens, default=0)
        call = (
            f"gather_kv(cache [{', '.join(map(str, k_cache.shape))}] {dtype}, block_tables={tables.tolist()}, "
            f"max_len={max_len}) for sequences of {lens} tokens"
        )
        yours = differential.call(gather_kv, k_cache.clone(), tables.clone(), max_len)
        book = differential.call(book_gather, k_cache.clone(), tables.clone(), max_len)
        if yours.error is None and book.error is None and yours.value.shape == book.value.shape:
            # Past a sequence's own tokens the table holds padding: what comes back there is never read.
            for b, n in enumerate(lens):
                yours.value[b, n:] = book.value[b, n:]
        differential.agree(
            call,
            yours,
            book,
            meaning="row b, position p is cache[block_tables[b, p // block_size], p % block_size], blocks in table "
            "order, for every position below the sequence's length; the result is [B, max_len, kv heads, head dim]",
        )

    differential.run(check, examples=150)


def _decode_case(rng):
    lens = [rng.randint(1, 40) for _ in range(rng.randint(0, 5))]
    dtype = rng.choice([torch.float32, torch.bfloat16])
    k_cache, v_cache, tables, gen = _paged_cache(rng, lens, dtype)
    group = rng.choice([1, 2, 4])
    q = torch.randn(len(lens), k_cache.shape[2] * group, k_cache.shape[3], generator=gen).to(dtype)
    context_lens = torch.tensor(lens, dtype=rng.choice([torch.int32, torch.int64]))
    bad = rng.random() < 0.15 and lens
    if bad:  # an argument the function must refuse rather than broadcast or read past
        kind = rng.choice(["zero length", "one table row", "short lens", "dtype", "past the table"])
        if kind == "zero length":
            context_lens[rng.randrange(len(lens))] = 0
        elif kind == "one table row" and len(lens) > 1:
            tables = tables[:1]
        elif kind == "short lens" and len(lens) > 1:
            context_lens = context_lens[:-1]
        elif kind == "dtype":
            q = q.to(torch.float16)
        elif kind == "past the table":
            context_lens[rng.randrange(len(lens))] = tables.shape[1] * k_cache.shape[1] + 1
    return q, k_cache, v_cache, tables, context_lens, dtype


def test_paged_attention_decode(differential):
    book_decode = differential.book(paged_attention_decode)

    def check(rng):
        q, k_cache, v_cache, tables, context_lens, dtype = _decode_case(rng)
        scale = _scale(rng, q.shape[-1])
        longest = int(context_lens.max()) if context_lens.numel() else 0
        max_len = rng.choice([None, None, longest + rng.randint(0, 3)]) if longest else None
        call = (
            f"paged_attention_decode(q [{', '.join(map(str, q.shape))}] {q.dtype}, k/v_cache "
            f"[{', '.join(map(str, k_cache.shape))}], block_tables={tables.tolist()}, "
            f"context_lens={context_lens.tolist()}, scale={scale:.4g}, max_len={max_len})"
        )
        args = (k_cache, v_cache, tables, context_lens, scale, max_len)
        differential.agree(
            call,
            differential.call(paged_attention_decode, q.clone(), *args),
            differential.call(book_decode, q.clone(), *args),
            meaning=ATTENTION + "; one query per sequence, at its last position",
            **TOL[dtype],
        )

    differential.run(check, examples=150)


def test_paged_attention_varlen(differential):
    book_varlen = differential.book(paged_attention_varlen)

    def check(rng):
        num_seqs = rng.randint(0, 4)
        kv_lens = [rng.randint(1, 40) for _ in range(num_seqs)]
        # New tokens per sequence: a whole prompt, a chunk after cached context, one decode token, none.
        q_lens = [rng.choice([n, 1, 0, rng.randint(0, n)]) for n in kv_lens]
        dtype = rng.choice([torch.float32, torch.bfloat16])
        k_cache, v_cache, tables, gen = _paged_cache(rng, kv_lens, dtype)
        group = rng.choice([1, 2, 4])
        q = torch.randn(sum(q_lens), k_cache.shape[2] * group, k_cache.shape[3], generator=gen).to(dtype)
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        seq_lens_k = list(kv_lens)
        if num_seqs and rng.random() < 0.15:  # offsets or lengths the function must refuse
            kind = rng.choice(["start", "end", "more new than keys", "no keys"])
            b = rng.randrange(num_seqs)
            if kind == "start":
                cu = [c + 1 for c in cu]
            elif kind == "end":
                cu[-1] += 1
            elif kind == "more new than keys" and q_lens[b] > 0:
                seq_lens_k[b] = q_lens[b] - 1
            elif kind == "no keys":
                seq_lens_k[b] = 0
        cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)
        lens_k = torch.tensor(seq_lens_k, dtype=rng.choice([torch.int32, torch.int64]))
        scale, causal = _scale(rng, q.shape[-1]), rng.random() < 0.8
        call = (
            f"paged_attention_varlen(q [{', '.join(map(str, q.shape))}] {dtype}, k/v_cache "
            f"[{', '.join(map(str, k_cache.shape))}], cu_seqlens_q={cu}, seq_lens_k={seq_lens_k}, "
            f"block_tables={tables.tolist()}, scale={scale:.4g}, causal={causal})"
        )
        args = (k_cache, v_cache, cu_seqlens_q, lens_k, tables, scale, causal)
        differential.agree(
            call,
            differential.call(paged_attention_varlen, q.clone(), *args),
            differential.call(book_varlen, q.clone(), *args),
            meaning=ATTENTION + "; sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and sit at its "
            "last positions, so with causal=True query i of q_len sees keys up to kv_len - q_len + i",
            **TOL[dtype],
        )

    differential.run(check, examples=120)
