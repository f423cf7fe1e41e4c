"""The compiled CPU decode kernel equals dense attention and the torch path on fresh random inputs.

Shapes hit the edges: a length of 1, lengths ending on and just past a block boundary, shuffled
physical blocks with garbage (and -1) in every unused slot and table entry, GQA groups of 1, 4
and 6, every compiled head size, float32 / bfloat16 / float16, and q taken as a strided slice of
a fused QKV output. A kernel compiled once loads from the cache in every later process, whatever
build tool its PATH holds.
"""

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpp_kernel import compile_flags
from paged_attention import paged_attention_decode, paged_attention_varlen
from paged_attention_cpu import (
    HEAD_DIMS,
    KERNEL,
    cpu_kernel_available,
    paged_attention_decode_cpu,
    paged_attention_varlen_cpu,
)
from store_kvcache import store_kvcache
from test_paged_attention import (
    TOL,
    VARLEN_SHAPES,
    assert_each_sequence_matches_dense,
    assert_varlen_matches_dense,
    build_paged,
    decode_batch,
    varlen_batch,
)

needs_kernel = pytest.mark.skipif(
    not cpu_kernel_available(),
    reason="the C++ kernel could not be built here (no C++ compiler?); the engine uses the torch path",
)
TOL_CPU = {**TOL, torch.float16: dict(atol=5e-3, rtol=5e-3)}


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op threads set to n inside the block (the kernels' at::parallel_for uses them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_decode_kernel_matches_dense_and_torch(dtype, num_q_heads, num_kv_heads):
    q, k_cache, v_cache, bt, lens, ks, vs = decode_batch(num_q_heads, num_kv_heads, dtype, seed=11)
    out = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, 32**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_each_sequence_matches_dense(out, q, ks, vs, 32**-0.5, TOL_CPU[dtype])
    if dtype != torch.float16:
        torch.testing.assert_close(
            out.float(), paged_attention_decode(q, k_cache, v_cache, bt, lens, 32**-0.5).float(), **TOL[dtype]
        )


@needs_kernel
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_compiled_head_size_and_a_block_size_of_16(head_dim):
    q, k_cache, v_cache, bt, lens, ks, vs = decode_batch(
        6, 2, torch.bfloat16, seed=head_dim, kv_lens=(3, 33, 100), head_dim=head_dim, block_size=16
    )
    out = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, head_dim**-0.5)
    assert_each_sequence_matches_dense(out, q, ks, vs, head_dim**-0.5, TOL[torch.bfloat16])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1), (24, 1)])
def test_varlen_kernel_matches_dense_and_torch(dtype, num_q_heads, num_kv_heads):
    # The chapter's shapes plus a prompt of many query tiles after a cached context; 24 query heads
    # per KV head are more than a tile's lanes, so one row's heads span two tiles.
    shapes = [*VARLEN_SHAPES, (70, 107)]
    q, k_cache, v_cache, cu, lens, bt, ks, vs = varlen_batch(shapes, num_q_heads, num_kv_heads, 32, 8, dtype, seed=17)
    out = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, 32**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_varlen_matches_dense(out, q, cu, ks, vs, 32**-0.5, TOL_CPU[dtype])
    if dtype != torch.float16:
        torch.testing.assert_close(
            out.float(), paged_attention_varlen(q, k_cache, v_cache, cu, lens, bt, 32**-0.5).float(), **TOL[dtype]
        )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_kernel_every_tile_size_of_one_and_two_registers(dtype):
    """Sequences of 1 to 33 new rows, one query head per KV head: every tile size from one query
    to two registers (16 lanes with AVX2, 32 with AVX-512) and one past, so both tile widths and
    their partial last tiles are met, over blocks of 5 that a run of 16 keys crosses several times."""
    shapes = [(rows, rows + 7) for rows in range(1, 34)]
    q, k_cache, v_cache, cu, lens, bt, ks, vs = varlen_batch(shapes, 2, 2, 64, 5, dtype, seed=5)
    out = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, 64**-0.5)
    assert_varlen_matches_dense(out, q, cu, ks, vs, 64**-0.5, TOL_CPU[dtype])


@needs_kernel
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_kernel_every_compiled_head_size(head_dim):
    q, k_cache, v_cache, cu, lens, bt, ks, vs = varlen_batch(
        [(20, 20), (3, 40), (1, 17)], 6, 2, head_dim, 16, torch.bfloat16, seed=head_dim
    )
    out = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, head_dim**-0.5)
    assert_varlen_matches_dense(out, q, cu, ks, vs, head_dim**-0.5, TOL[torch.bfloat16])


@needs_kernel
def test_varlen_kernel_rejects_what_would_read_outside_the_cache():
    q, k_cache, v_cache, cu, lens, bt, _, _ = varlen_batch([(3, 5), (2, 3)], 4, 2, 16, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, torch.tensor([0, 3, 4]), lens, bt, 1.0)  # ends at 4, not 5
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, torch.tensor([0, 5]), lens, bt, 1.0)  # 1 sequence, 2 rows
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, torch.tensor([0, 4, 3, 5]), lens, bt, 1.0)
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, cu, torch.tensor([2, 3]), bt, 1.0)  # 3 new tokens, 2 keys
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, cu, torch.tensor([5, 64]), bt, 1.0)
    bad = bt.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bad, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen_cpu(q, k_cache, v_cache, cu.float(), lens, bt, 1.0)


@st.composite
def attention_batches(draw):
    """Sequences of 1-70 tokens with up to 24 new ones each (none for some: a batch may hold a
    sequence with nothing to attend this step; one each for a decode batch), over a cache whose
    every slot outside the sequences holds NaN: a kernel that reads one, even to weight it by zero,
    returns NaN."""
    decode = draw(st.booleans())
    lens = draw(st.lists(st.integers(1, 70), min_size=1, max_size=4))
    shapes = [(1 if decode else draw(st.integers(0, min(n, 24))), n) for n in lens]
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 5]))
    head_dim, block_size = draw(st.sampled_from(HEAD_DIMS)), draw(st.integers(1, 17))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**16))
    threads = draw(st.integers(1, 3))
    batch = varlen_batch(shapes, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, seed)
    k_cache, v_cache, bt = batch[1], batch[2], batch[5]
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for row, n in zip(bt.tolist(), lens):
        for p in range(n):
            used[row[p // block_size], p % block_size] = True
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")
    return decode, threads, batch


@needs_kernel
@settings(max_examples=60, deadline=None, derandomize=True)
@given(attention_batches())
def test_both_kernels_on_drawn_batches_read_only_their_sequences(drawn):
    """Every dtype, head size, block size and GQA group, lengths on and off block and register
    boundaries, odd contexts (the bfloat16 kernels multiply values in pairs), 1-3 threads (the
    bfloat16 decode splits the keys of a batch too small for its threads into runs)."""
    decode, threads, (q, k_cache, v_cache, cu, lens, bt, ks, vs) = drawn
    scale = q.shape[-1] ** -0.5
    tol = TOL_CPU[q.dtype]
    with torch_threads(threads):
        if decode:
            out = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, scale)
        else:
            out = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, scale)
    if decode:
        assert_each_sequence_matches_dense(out, q, ks, vs, scale, tol)
    else:
        assert_varlen_matches_dense(out, q, cu, ks, vs, scale, tol)


@needs_kernel
# Two sequences, so 2 or 6 (sequence, KV head) pairs: 2, 4, 8, 2 and 3 runs of keys each.
@pytest.mark.parametrize("threads,num_q_heads,num_kv_heads", [(2, 4, 1), (4, 4, 1), (8, 4, 1), (4, 9, 3), (8, 9, 3)])
def test_a_decode_of_few_sequences_splits_their_keys_into_runs_and_merges_them(threads, num_q_heads, num_kv_heads):
    """Two sequences give the threads too few (sequence, KV head) pairs for two items each: the
    bfloat16 kernel splits each pair's keys into runs, each with a softmax of its own
    maximum, and the merge must rescale every run's weights to the largest. The runs' maxima differ by
    construction: each sequence's first five keys lie along its queries and score far above the rest."""
    q, k_cache, v_cache, bt, lens, ks, vs = decode_batch(
        num_q_heads, num_kv_heads, torch.bfloat16, seed=threads, kv_lens=(300, 77), head_dim=64, block_size=16
    )
    group = num_q_heads // num_kv_heads
    for seq, k in enumerate(ks):
        k[:5] = 4 * q[seq].float().view(num_kv_heads, group, 64).mean(1).to(torch.bfloat16)
        for p in range(5):
            k_cache[bt[seq, p // 16], p % 16] = k[p]
    with torch_threads(threads):
        out = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, 64**-0.5)
    assert_each_sequence_matches_dense(out, q, ks, vs, 64**-0.5, TOL[torch.bfloat16])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_batch_sends_its_one_token_sequences_to_the_decode_kernel(dtype):
    """Decodes beside prompt chunks: the rows of the sequences that bring one token are the
    decode kernel's output for those sequences alone, bit for bit, and the other rows the varlen
    kernel's for the others alone (a sequence with no new token has no rows)."""
    shapes = [(1, 40), (17, 30), (1, 70), (0, 5), (5, 5), (1, 1)]
    q, k_cache, v_cache, cu, lens, bt, ks, vs = varlen_batch(shapes, 6, 2, 64, 16, dtype, seed=5)
    out = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, 0.125)
    assert_varlen_matches_dense(out, q, cu, ks, vs, 0.125, TOL_CPU[dtype])
    singles = [i for i, (n, _) in enumerate(shapes) if n == 1]
    rows = cu[singles].long()
    decoded = paged_attention_decode_cpu(q[rows], k_cache, v_cache, bt[singles], lens[singles], 0.125)
    assert torch.equal(out[rows], decoded)
    others = [i for i, (n, _) in enumerate(shapes) if n != 1]
    other_rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in others])
    sizes = torch.tensor([shapes[i][0] for i in others])
    other_cu = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(cu.dtype)
    alone = paged_attention_varlen_cpu(q[other_rows], k_cache, v_cache, other_cu, lens[others], bt[others], 0.125)
    assert torch.equal(out[other_rows], alone)


@needs_kernel
@pytest.mark.parametrize(
    "shapes",
    [[(1, 5), (1, 9), (1, 1)], [(4, 4), (1, 9), (3, 12)], [(0, 5), (2, 9)]],
    ids=["decode", "varlen", "as-many-rows-as-sequences-but-not-one-each"],
)
def test_the_store_and_attend_operator_stores_then_attends(shapes):
    """The operator a compiled forward calls: chapter 01's store, then the kernel the shape picks."""
    hq, hkv, d, bs, layers = 4, 2, 16, 4, 3
    q, k_cache, v_cache, cu, lens, bt, _, _ = varlen_batch(shapes, hq, hkv, d, bs, torch.float32, seed=7)
    kv_cache = torch.randn(2, layers, *k_cache.shape)
    kv_cache[0, 1], kv_cache[1, 1] = k_cache, v_cache
    tokens = q.shape[0]
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)  # k and v as strided slices, as the engine passes them
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    slots = torch.tensor([int(bt[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    slots = torch.cat([slots, torch.full((tokens - len(slots),), -1)])  # -1: store nothing
    expected_cache = kv_cache.clone()
    store_kvcache(k, v, expected_cache[0, 1], expected_cache[1, 1], slots)
    expected = paged_attention_varlen(q, expected_cache[0, 1], expected_cache[1, 1], cu, lens, bt, 0.25)
    out = torch.ops.vllm_fs_cpu.store_and_attend(q, k, v, kv_cache, 1, slots, cu, lens, bt, 0.25)
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    with pytest.raises(ValueError, match="slot_mapping"):
        torch.ops.vllm_fs_cpu.store_and_attend(q, k, v, kv_cache, 1, slots + 10**6, cu, lens, bt, 0.25)
    with pytest.raises(ValueError, match="layer"):
        torch.ops.vllm_fs_cpu.store_and_attend(q, k, v, kv_cache, layers, slots, cu, lens, bt, 0.25)


@needs_kernel
def test_strided_q_from_a_fused_qkv_in_both_kernels():
    hq, hkv, d, bs = 8, 2, 16, 4
    kv_lens = [5, 9, 1]
    k_cache, v_cache, bt, ks, vs = build_paged(kv_lens, hkv, d, bs, torch.float32, seed=21)
    qkv = torch.randn(3, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(3, hq, d)  # rows strided by the fused width, as the engine slices it
    lens = torch.tensor(kv_lens)
    out = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, 0.25)
    torch.testing.assert_close(out, paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.25), **TOL[torch.float32])
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    varlen = paged_attention_varlen_cpu(q, k_cache, v_cache, cu, lens, bt, 0.25)
    torch.testing.assert_close(varlen, out, **TOL[torch.float32])


@needs_kernel
def test_bad_arguments_raise_value_error_naming_them():
    k_cache, v_cache, bt, _, _ = build_paged([5, 3], 2, 16, 4, torch.float32, seed=3)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode_cpu(q, k_cache, v_cache, bt, torch.tensor([5, 0]), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode_cpu(q, k_cache, v_cache, bt, torch.tensor([5, 64]), 1.0)
    bad = bt.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode_cpu(q, k_cache, v_cache, bad, torch.tensor([5, 3]), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_decode_cpu(
            torch.randn(2, 4, 12), k_cache[..., :12], v_cache[..., :12], bt, torch.tensor([5, 3]), 1.0
        )
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_decode_cpu(torch.randn(2, 3, 16), k_cache, v_cache, bt, torch.tensor([5, 3]), 1.0)
    assert paged_attention_decode_cpu(
        q[:0], k_cache, v_cache, bt[:0], torch.tensor([], dtype=torch.int32), 1.0
    ).shape == (0, 4, 16)


def test_without_a_compiler_the_dispatcher_keeps_the_torch_path(tmp_path):
    """A machine that cannot build the kernel warns once and runs the torch path, not an error."""
    code = (
        "import torch\n"
        "from paged_attention_cpu import cpu_kernel_available\n"
        "from attention_backends import select_backend\n"
        "assert not cpu_kernel_available()\n"
        "assert select_backend(torch.randn(2, 4, 16), torch.randn(3, 4, 2, 16)) == 'torch'\n"
    )
    env = dict(os.environ, CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("could not be built") == 1
    assert not list(tmp_path.rglob("build_key.txt")), "a failed build must not look cached"


def test_loads_names_the_source_and_the_fallback_when_a_build_fails(caplog):
    """Every kernel module asks ``CppKernel.loads``: True when its loader succeeds, else False
    and one warning that says which source failed, why, and what runs instead."""

    def failing_build() -> None:
        raise RuntimeError("no C++ compiler")

    with caplog.at_level(logging.WARNING):
        assert not KERNEL.loads(failing_build, fallback="using the torch path")
        assert KERNEL.loads(lambda: None, fallback="unused")
    assert [r.getMessage() for r in caplog.records] == [
        "paged_attention_cpu.cpp could not be built (no C++ compiler); using the torch path"
    ]


def test_the_cache_key_names_everything_the_binary_depends_on(monkeypatch, tmp_path):
    key = KERNEL.build_key()
    assert [line.split()[0] for line in key.splitlines()] == ["source", "flags", "torch", "python", "cpu"]
    assert f"flags {' '.join(compile_flags())}" in key and f"torch {torch.__version__}" in key
    assert "-fopenmp" in " ".join(compile_flags())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert KERNEL.cache_dir(key).parent.parent == tmp_path and not KERNEL.is_cached(key)
    assert KERNEL.cache_dir(key + "cpu another\n") != KERNEL.cache_dir(key)


@needs_kernel
def test_a_cached_kernel_loads_without_compiling_whichever_ninja_is_on_path():
    """Two processes in a row, one finding pip's ninja first and one a system ninja or none."""
    so = KERNEL.kernel_path()
    before = so.stat()
    venv_bin = str(Path(sys.executable).parent)
    paths = [os.pathsep.join([venv_bin, os.environ.get("PATH", "")]), os.pathsep.join(["/usr/bin", "/bin"])]
    code = (
        "import logging, shutil\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "import paged_attention_cpu\n"
        "paged_attention_cpu.load_cpu_kernel()\n"
        "print(shutil.which('ninja'))\n"
    )
    ninjas = []
    for path in paths:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ, PATH=path)
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"loaded cached kernel {so}" in out.stderr and "compiling" not in out.stderr, out.stderr
        ninjas.append(out.stdout.strip())
    assert ninjas[0] == shutil.which("ninja", path=paths[0]) and ninjas[0] != ninjas[1]
    after = so.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
