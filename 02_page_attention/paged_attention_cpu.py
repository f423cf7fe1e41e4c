"""Compiled CPU kernels for paged attention, and how they are built.

The torch path (:mod:`paged_attention`) serves a decode batch in three steps: gather every
sequence's blocks into a padded ``[B, L, Hkv, D]`` copy, mask the padding, and run
``scaled_dot_product_attention``. On a CPU all three cost more than the attention itself: the
copy doubles the bytes moved, short sequences pay for the longest, and SDPA's flash kernel tiles
for many query rows while a decode brings one. ``paged_attention_cpu.cpp`` reads each sequence's
keys and values in place through its block table, float32 math throughout on whole vector
registers, in two kernels:

* **decode** (one query per sequence): one work item per (sequence, query head); keys scored a
  register's worth at a time (sixteen with AVX-512), bfloat16 widened by two bit operations per
  two registers, the next block's keys prefetched.
* **varlen** (prompts, chunks, verification): one work item per tile of up to a register's worth
  of queries of one sequence that share a KV head, one query per lane, with an online softmax;
  each run of keys is widened once for the whole tile.

Measured on the book's 2-core CPU, 2 threads, bfloat16, 9 query / 3 KV heads of 64 (the default
model), block size 16 (medians of 7–9 runs):

=======================================  ===================  ==========
batch                                    gather + SDPA        C++ kernel
=======================================  ===================  ==========
decode, 32 sequences of 200-380 tokens   1.6 ms               0.24 ms
decode, 128 sequences of 150-290 tokens  7.2 ms               1.14 ms
8 prompts of 256 tokens                  10.2 ms              5.8 ms
one prompt of 2,048 tokens               47.4 ms              34.7 ms
=======================================  ===================  ==========

vLLM keeps the same kind of kernels for its CPU backend (``csrc/cpu/attention.cpp``).

Compiled once per machine and cached; a later process finds the cached shared object by a
fingerprint of everything the binary depends on (the ``.cpp`` bytes, the compile flags, torch's
and Python's versions, the CPU) and loads it directly, in milliseconds, without asking a build
tool. Only when no build matches is it compiled, by ``torch.utils.cpp_extension`` in a child
process (a C++ compiler is needed; ``setup.sh`` does this once so nothing waits later). The
build is tuned for the machine that compiles it (``-march=native``), hence the CPU in the
fingerprint. Where it cannot be built, :func:`cpu_kernel_available` is False and chapter 02's
dispatcher keeps the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from paged_attention import _check_paged_args

SOURCE = Path(__file__).resolve().parent / "paged_attention_cpu.cpp"
EXTENSION_NAME = "vllm_fs_paged_attention_cpu"
HEAD_DIMS = (16, 32, 64, 128, 256)
STAMP = "build_key.txt"
logger = logging.getLogger(__name__)

# The child process that compiles: cpp_extension.load writes build.ninja and the shared object
# into the given directory (and imports it once, which proves it loads).
_BUILD_SCRIPT = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    "load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], "
    "extra_cflags=sys.argv[4:])\n"
)


def compile_flags() -> list[str]:
    """The C++ flags the kernel is compiled with on this machine (part of the cache key)."""
    flags = ["-O3", "-ffast-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    # at::parallel_for is an inline OpenMP loop: without -fopenmp it would run on one thread.
    # On Linux the extension then shares torch's own libgomp.so.1 (same soname, loaded first).
    flags.append("-fopenmp" if sys.platform.startswith("linux") else "-fopenmp-simd")
    return flags


def _cpu_fingerprint() -> str:
    """A short hash of the CPU's model and feature flags: a native build must not run elsewhere."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        text += platform.processor()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def build_key() -> str:
    """Everything the compiled kernel depends on, one ``name value`` line each.

    A cached build is used only when its key equals this one, so editing the ``.cpp``, changing a
    flag, upgrading torch or Python, or moving to another CPU compiles afresh.
    """
    return (
        f"source sha256:{hashlib.sha256(SOURCE.read_bytes()).hexdigest()}\n"
        f"flags {' '.join(compile_flags())}\n"
        f"torch {torch.__version__}\n"
        f"python {sys.implementation.cache_tag} {platform.python_version()}\n"
        f"cpu {_cpu_fingerprint()}\n"
    )


def cache_dir(key: str) -> Path:
    """The directory holding the build for ``key``.

    Under ``$TORCH_EXTENSIONS_DIR`` when set, else torch's own default for compiled extensions
    (``$XDG_CACHE_HOME/torch_extensions``, normally ``~/.cache/torch_extensions``), then
    ``vllm_fs_paged_attention_cpu/<first 16 hex digits of the key's sha256>``.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache_home, "torch_extensions")
    return Path(root) / EXTENSION_NAME / hashlib.sha256(key.encode()).hexdigest()[:16]


def kernel_path(key: str | None = None) -> Path:
    """The shared object of the build for ``key`` (default: :func:`build_key` of this process)."""
    return cache_dir(key or build_key()) / f"{EXTENSION_NAME}.so"


def is_cached(key: str | None = None) -> bool:
    """Whether a finished build for ``key`` (default: this machine's) is in the cache.

    The stamp holding the key is written only after a build succeeds, so a build that was
    interrupted, or a directory whose name collides, does not count.
    """
    key = key or build_key()
    stamp = cache_dir(key) / STAMP
    return kernel_path(key).is_file() and stamp.is_file() and stamp.read_text() == key


def _build_env() -> dict[str, str] | None:
    """The compiling child's environment: pip's ninja (a pinned requirement) first on PATH.

    ``.venv/bin/python`` run without activating the venv may find no ninja at all; the build
    directory is fresh for every key, so which ninja builds it does not matter otherwise.
    """
    try:
        import ninja
    except ImportError:
        return None
    return dict(os.environ, PATH=os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")]))


def build_cpu_kernel(key: str | None = None) -> Path:
    """Compile the kernel for ``key`` (default: this machine's) into its cache directory.

    Runs ``torch.utils.cpp_extension.load`` in a child process, so this process's environment
    and modules stay as they were, then writes the stamp that :func:`is_cached` checks.

    Returns:
        The path of the shared object.

    Raises:
        RuntimeError: the compiler failed or is missing (the last lines of its output say why).
    """
    key = key or build_key()
    directory = cache_dir(key)
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s into %s (once per machine and source, about 25 s)", SOURCE.name, directory)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, EXTENSION_NAME, str(SOURCE), str(directory), *compile_flags()],
        capture_output=True,
        text=True,
        env=_build_env(),
    )
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]  # the compiler's, then the traceback's
        raise RuntimeError(f"compiling {SOURCE.name} failed: " + " | ".join((errors or lines)[-3:]))
    stamp = directory / STAMP
    partial = stamp.with_name(f"{STAMP}.{os.getpid()}")
    partial.write_text(key)
    os.replace(partial, stamp)
    logger.info("compiled %s in %.1f s", SOURCE.name, time.perf_counter() - start)
    return kernel_path(key)


def _import_extension(path: Path):
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_cpu_kernel():
    """Return the extension module: loaded from the cache, compiled first if no build matches.

    Loading it also registers the torch operator ``torch.ops.vllm_fs_cpu.store_and_attend`` (the
    engine's compiled forward calls it), with a fake implementation for tracing.

    Raises whatever the build raises (no compiler, no Python headers); see
    :func:`cpu_kernel_available` for the forgiving version.
    """
    key = build_key()
    if not is_cached(key):
        build_cpu_kernel(key)
    path = kernel_path(key)
    module = _import_extension(path)
    torch.library.register_fake("vllm_fs_cpu::store_and_attend")(_store_and_attend_fake)
    logger.info("loaded cached kernel %s", path)
    return module


def _store_and_attend_fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


@functools.cache
def cpu_kernel_available() -> bool:
    """Whether the kernel is cached or can be built (False, with one warning, where the build fails).

    Choosing the torch path anyway is the caller's decision: ``backend="torch"`` in
    :func:`attention_backends.paged_attention`.
    """
    try:
        load_cpu_kernel()
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("paged_attention_cpu.cpp could not be built (%s); using the torch path", exc)
        return False
    return True


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel takes these queries: CPU tensors of a float dtype and a compiled head size."""
    return (
        q.device.type == "cpu"
        and q.dim() == 3
        and q.shape[-1] in HEAD_DIMS
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _check_kernel_args(
    q: torch.Tensor,
    rows_name: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    lens_name: str,
) -> None:
    """What the kernels need from the Python side: q they were compiled for, then the torch
    paths' shape and dtype checks (values are checked in the C++)."""
    if not supports(q):
        raise ValueError(
            f"q must be a [{rows_name}, heads, head_dim] CPU float tensor with head_dim in {HEAD_DIMS}, "
            f"got {q.dtype} of shape {tuple(q.shape)} on {q.device}"
        )
    _check_paged_args(q, k_cache, v_cache, block_tables, lens, lens_name)


def paged_attention_decode_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention.paged_attention_decode`, on the compiled kernel.

    Args:
        q: ``[B, Hq, D]`` CPU tensor, ``D`` in :data:`HEAD_DIMS`.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous.
        block_tables: ``[B, max_blocks]`` int, padded past each sequence's blocks.
        context_lens: ``[B]`` int, tokens each sequence attends to (the new one included), >= 1.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    _check_kernel_args(q, "batch", k_cache, v_cache, block_tables, context_lens, "context_lens")
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens must have one entry per query ({q.shape[0]}), got {context_lens.shape[0]}")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return load_cpu_kernel().paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def paged_attention_varlen_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention.paged_attention_varlen` (causal), on the compiled kernel.

    Args:
        q: ``[T, Hq, D]`` CPU tensor, the new tokens of ``B`` sequences back to back.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous, the new tokens stored.
        cu_seqlens_q: ``[B+1]`` int, sequence ``b``'s queries are rows ``cu[b]:cu[b+1]`` of ``q``.
        seq_lens_k: ``[B]`` int, cached + new tokens of each sequence.
        block_tables: ``[B, max_blocks]`` int.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    _check_kernel_args(q, "tokens", k_cache, v_cache, block_tables, seq_lens_k, "seq_lens_k")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens_q must be a 1-D int32/int64 tensor, "
            f"got {cu_seqlens_q.dtype} of shape {tuple(cu_seqlens_q.shape)}"
        )
    return load_cpu_kernel().paged_attention_varlen(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, float(scale)
    )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Build the CPU paged-attention kernel for this machine, or load "
        "it from the cache when the same source, flags, torch, Python and "
        "CPU were built before."
    )
    parser.parse_args()
    cached = is_cached()
    start = time.perf_counter()
    load_cpu_kernel()
    how = "loaded from the cache" if cached else "compiled"
    print(f"paged_attention_cpu kernel ready: {kernel_path()} ({how} in {time.perf_counter() - start:.3f} s)")


if __name__ == "__main__":
    main()
