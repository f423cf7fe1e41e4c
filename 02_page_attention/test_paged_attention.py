"""The torch paged-attention paths equal dense attention on fresh random inputs."""

import pytest
import torch

from paged_attention import dense_attention_reference, gather_kv, paged_attention_decode, paged_attention_varlen

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def build_paged(kv_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    """Random K/V per sequence written into shuffled physical blocks; garbage everywhere else."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype) * 50
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype) * 50
    physical = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n, nb in zip(kv_lens, blocks_per_seq):
        table = [physical.pop() for _ in range(nb)]
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(blocks_per_seq) + 1
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, ks, vs


def decode_batch(num_q_heads, num_kv_heads, dtype, seed, kv_lens=(1, 7, 16, 17, 40), head_dim=32, block_size=8):
    """One new query per sequence over build_paged's cache (default lengths: 1, and on and one
    past a block boundary). Returns ``q, k_cache, v_cache, block_tables, lens, ks, vs``."""
    k_cache, v_cache, bt, ks, vs = build_paged(list(kv_lens), num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q = torch.randn(len(kv_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k_cache, v_cache, bt, torch.tensor(kv_lens, dtype=torch.int32), ks, vs


def assert_each_sequence_matches_dense(out, q, ks, vs, scale, tol):
    """Row ``b`` of a decode output equals dense attention over sequence ``b``'s own K/V."""
    for b in range(len(ks)):
        ref = dense_attention_reference(q[b : b + 1], ks[b], vs[b], causal=True, scale=scale)
        hq, hkv = q.shape[1], ks[b].shape[1]
        torch.testing.assert_close(
            out[b : b + 1].float(),
            ref.float(),
            **tol,
            msg=lambda m, b=b, hq=hq, hkv=hkv: (
                f"sequence {b} ({len(ks[b])} keys) differs from dense attention over its own keys: positions "
                f"at or past its context length are masked, and of {hq} query heads over {hkv} kv heads, query "
                f"head h reads kv head h // {hq // hkv}.\n{m}"
            ),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_decode_matches_dense(dtype, num_q_heads, num_kv_heads):
    q, k_cache, v_cache, bt, lens, ks, vs = decode_batch(num_q_heads, num_kv_heads, dtype, seed=1)
    out = paged_attention_decode(q, k_cache, v_cache, bt, lens, 32**-0.5)
    assert_each_sequence_matches_dense(out, q, ks, vs, 32**-0.5, TOL[dtype])


def varlen_batch(shapes, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Packed queries for ``shapes`` ((new tokens, total tokens) per sequence) over build_paged's
    cache. Returns ``q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, ks, vs``."""
    kv_lens = [kv for _, kv in shapes]
    k_cache, v_cache, bt, ks, vs = build_paged(kv_lens, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q_lens = [ql for ql, _ in shapes]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), bt, ks, vs


def assert_varlen_matches_dense(out, q, cu, ks, vs, scale, tol):
    """Sequence ``b``'s rows of a varlen output equal causal dense attention over its own K/V."""
    for b in range(len(ks)):
        ref = dense_attention_reference(q[cu[b] : cu[b + 1]], ks[b], vs[b], causal=True, scale=scale)
        q_len, kv_len = int(cu[b + 1] - cu[b]), len(ks[b])
        torch.testing.assert_close(
            out[cu[b] : cu[b + 1]].float(),
            ref.float(),
            **tol,
            msg=lambda m, b=b, q_len=q_len, kv_len=kv_len: (
                f"sequence {b}: {q_len} new tokens after {kv_len - q_len} cached ones are query rows "
                f"cu_seqlens_q[{b}]:cu_seqlens_q[{b + 1}] at positions {kv_len - q_len}..{kv_len - 1}, so the "
                f"causal mask lets query i see keys 0..{kv_len - q_len} + i.\n{m}"
            ),
        )


# (new tokens, total tokens): a fresh prompt, a chunk after cached context, a decode row, a prompt
# that ends exactly on a block boundary, and a one-token prompt.
VARLEN_SHAPES = [(13, 13), (5, 21), (1, 9), (16, 32), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_with_cached_context_matches_dense(dtype):
    q, k_cache, v_cache, cu, lens, bt, ks, vs = varlen_batch(VARLEN_SHAPES, 8, 2, 16, 4, dtype, seed=3)
    out = paged_attention_varlen(q, k_cache, v_cache, cu, lens, bt, 16**-0.5)
    assert_varlen_matches_dense(out, q, cu, ks, vs, 16**-0.5, TOL[dtype])


def test_gather_kv_reads_blocks_in_table_order():
    # Sequence 0's blocks are scattered and out of order; sequence 1's table is padded with -1.
    k_cache, _, bt, ks, _ = build_paged([10, 3], 2, 4, 4, torch.float32, seed=6)
    gathered = gather_kv(k_cache, bt, 10)
    for b, k in enumerate(ks):
        for p in range(len(k)):
            assert torch.equal(gathered[b, p], k[p]), (
                f"position {p} of sequence {b} is slot {p % 4} of block block_tables[{b}][{p // 4}] = "
                f"{int(bt[b, p // 4])}: blocks come back in the table's order, each block's slots in order"
            )


def test_varlen_without_causal_mask_sees_every_key():
    hq, hkv, d, bs = 2, 2, 8, 4
    k_cache, v_cache, bt, ks, vs = build_paged([6], hkv, d, bs, torch.float32, seed=5)
    q = torch.randn(6, hq, d)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = paged_attention_varlen(q, k_cache, v_cache, cu, torch.tensor([6], dtype=torch.int32), bt, 0.5, causal=False)
    torch.testing.assert_close(out, dense_attention_reference(q, ks[0], vs[0], causal=False, scale=0.5))


def test_bad_shapes_raise_value_error():
    k_cache = torch.zeros(4, 4, 3, 8)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_decode(torch.zeros(1, 4, 8), k_cache, k_cache, bt, torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_attention_varlen(torch.zeros(3, 3, 8), k_cache, k_cache, torch.tensor([0, 3]), torch.tensor([2]), bt, 1.0)


def test_decode_rejects_arguments_that_would_broadcast_or_mismatch():
    k_cache = torch.zeros(4, 4, 2, 8)
    q = torch.zeros(3, 4, 8)
    bt = torch.zeros(3, 2, dtype=torch.int32)
    lens = torch.tensor([1, 5, 8])
    # One block-table row or one length for three queries would silently broadcast.
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(q, k_cache, k_cache, bt[:1], lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(q, k_cache, k_cache, bt, lens[:1], 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(q, k_cache, k_cache, bt[:2], lens[:2], 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(q, k_cache, k_cache, bt, torch.tensor([1, 0, 8]), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(q, k_cache, k_cache, bt, torch.tensor([1, 5, 9]), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_decode(q, k_cache, k_cache.half(), bt, lens, 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention_decode(q, k_cache, k_cache[:2], bt, lens, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention_decode(q, k_cache[..., :4], k_cache[..., :4], bt, lens, 1.0)


def test_varlen_rejects_inconsistent_offsets_and_lengths():
    k_cache = torch.zeros(4, 4, 2, 8)
    q = torch.zeros(5, 2, 8)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen(q, k_cache, k_cache, torch.tensor([0, 3, 4]), lens, bt, 1.0)  # ends at 4, not 5
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen(q, k_cache, k_cache, torch.tensor([0, 5]), lens, bt, 1.0)  # 1 sequence, 2 lengths
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen(q, k_cache, k_cache, torch.tensor([1, 3, 5]), lens, bt, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_varlen(q, k_cache, k_cache, torch.tensor([0, 3, 5]), lens, bt[:1], 1.0)
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_attention_varlen(q, k_cache, k_cache, torch.tensor([0, 3, 5]), torch.tensor([3, 9]), bt, 1.0)
