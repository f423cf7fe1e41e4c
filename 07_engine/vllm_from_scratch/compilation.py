"""The model's forward compiled ahead of time by inductor, cached on disk: a CPU engine's default.

On a CPU a forward of a few tokens is mostly overhead: Python and one dispatch per op between
the layers' matmuls, and matrix-vector products that oneDNN reads the weights for more slowly
than a kernel made for them. Compiling removes the first and replaces the second, without a
change to the model's code:

* ``torch.export`` traces the forward once, with every tensor it reads as an input (the KV cache
  too, so the graph holds no copy of it), and the token count, request count, block-table width
  and cache size symbolic. Attention is one opaque operator (``layers/attention.py``,
  :func:`~vllm_from_scratch.layers.attention.unified_attention`); the linear layers are plain
  ``F.linear`` while traced (``layers/prepacked.py``), or the engine's own GEMM operator where the
  CPU runs one for the model's dtype: bfloat16's with AVX-512 BF16 (``layers/bf16_gemm.py``),
  float32's with AVX2 and FMA (``layers/f32_gemm.py``).
* AOTInductor compiles the graph to C++ with the weights frozen (constants), so norms, residual
  adds, RoPE and SiLU·mul fuse into loops between the matmuls, and packs it with its weights into
  one file. Two graphs, split by token count (:data:`SMALL_BATCH_TOKENS`). Where the engine's
  GEMM runs, both call it for every matmul and the LM head stays its one call: it read the
  weights of a one-token step as fast as inductor's own GEMM template or faster on every CPU
  measured (3.2x on a Zen 5 VM, where a one-request step took 8.1 ms against 16.1 through it).
  Elsewhere small batches use the template (``max_autotune`` with its C++ kernels), which reads a
  weight about twice as fast as oneDNN when a matmul has a row or two, larger ones keep oneDNN's
  packed GEMMs, which the template falls far behind from about eight rows, and one more graph is
  the LM head alone for the small graph's rows, with the template (:func:`graph_names`).
* A package is written once under ``$XDG_CACHE_HOME/vllm_from_scratch/compiled/`` (normally
  ``~/.cache``) in a directory named by everything the compiled code depends on
  (:func:`compile_key`); a later process loads it in a fraction of a second.

``python -m vllm_from_scratch.precompile`` compiles the default model's graphs at the engine's
defaults (``setup.sh`` runs it, so that no first start waits); ``EngineConfig.enforce_eager``
turns all of this off.

Why not ``torch.compile`` with inductor's own caches: its FX graph cache refuses a graph whose
frozen weights are oneDNN tensors, and even a cache hit reruns Dynamo, AOTAutograd and freezing
for the whole model at every start. Measured figures: 07_engine/topics/performance.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

import attention_backends
from attention_backends import AttentionMetadata
from block_manager import cdiv
from chunked_prefill import SchedulerInfo, build_batch_inputs
from cpp_kernel import cpu_fingerprint
from paged_attention_cpu import cpu_kernel_available
from vllm_from_scratch import graph_package
from vllm_from_scratch.layers import bf16_gemm, f32_gemm

if TYPE_CHECKING:
    from vllm_from_scratch.config import EngineConfig

log = logging.getLogger(__name__)

# Batches of at most this many tokens run the small graph, larger ones the large graph.
SMALL_BATCH_TOKENS = 4
# The inductor settings of each graph, on top of weight freezing.
GRAPHS: dict[str, dict[str, object]] = {
    "small": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    "large": {},
    "logits": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"},
}
# The graphs whose matmuls are inductor's GEMM template where the engine runs no GEMM of its own.
TEMPLATE_GRAPHS = frozenset({"small", "logits"})
STAMP = "key.txt"
# The code a graph is traced from: the models, their layers, this module, and chapter 02's
# AttentionMetadata, whose field order the graph's inputs follow.
_SOURCES = [
    Path(__file__),
    Path(str(attention_backends.__file__)),
    *sorted(Path(__file__).parent.glob("models/*.py")),
    *sorted(Path(__file__).parent.glob("layers/*.py")),
]


def template_graphs(config: EngineConfig) -> frozenset[str]:
    """The graphs whose matmuls are inductor's template: none where the engine's own GEMM runs for
    the model's dtype on this CPU, :data:`TEMPLATE_GRAPHS` elsewhere (the module docstring says why)."""
    own_gemm = (config.torch_dtype == torch.float32 and f32_gemm.gemm_available()) or (
        config.torch_dtype == torch.bfloat16 and bf16_gemm.gemm_available()
    )
    return frozenset() if own_gemm else TEMPLATE_GRAPHS


def graph_names(config: EngineConfig) -> list[str]:
    """The graphs this configuration compiles and runs: all of :data:`GRAPHS`, but the LM head's
    only where it is a template graph (without the template it is the eager head's one matmul)."""
    return [name for name in GRAPHS if name != "logits" or name in template_graphs(config)]


def _token_range(name: str) -> tuple[int, int | None]:
    """The fewest and most tokens (None: no bound) of a forward through graph ``name``."""
    if name == "small":
        return 1, SMALL_BATCH_TOKENS
    return SMALL_BATCH_TOKENS + 1, None


def graph_for(tokens: int) -> str:
    """The forward graph a batch of ``tokens`` tokens (at least one) runs: the first of
    :data:`GRAPHS` whose token range holds it."""
    for name in GRAPHS:
        fewest, most = _token_range(name)
        if name != "logits" and fewest <= tokens and (most is None or tokens <= most):
            return name
    raise ValueError(f"tokens must be at least 1, got {tokens}")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/vllm_from_scratch/compiled`` (``~/.cache/...`` when the variable is unset)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "vllm_from_scratch" / "compiled"


def compile_key(config: EngineConfig) -> str:
    """Everything a compiled forward depends on, one ``name value`` line each: the traced code,
    the checkpoint (its config and the size and time of each weight file: the weights are frozen
    into the package), the KV layout, the dtype, whether chapter 02's C++ kernels load (the graphs
    then call their operator; asking loads them, which registers it before any graph is loaded),
    the threads (the C++ loops are split for them), whether the engine's GEMMs run (the graphs call
    their operators), torch, Python and the CPU. A package is loaded only when its key equals
    this one."""
    model_dir = Path(config.model_dir).resolve()
    weights = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    source = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()
    checkpoint = hashlib.sha256(json.dumps(config.hf_config.to_dict(), sort_keys=True, default=str).encode())
    for path in weights:
        stat = path.stat()
        checkpoint.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return (
        f"source sha256:{source}\n"
        f"model {model_dir} sha256:{checkpoint.hexdigest()}\n"
        f"dtype {config.torch_dtype} block_size {config.kvcache_block_size} attention {config.attention_backend}"
        f" cpp_kernels {cpu_kernel_available()} bf16_gemm {bf16_gemm.gemm_available()}"
        f" f32_gemm {f32_gemm.gemm_available()}\n"
        f"threads {torch.get_num_threads()}\n"
        f"torch {torch.__version__}\n"
        f"python {sys.implementation.cache_tag} {platform.python_version()}\n"
        f"cpu {cpu_fingerprint()}\n"
    )


class _ForwardWithCache(nn.Module):
    """``model(input_ids, positions, metadata)`` with the metadata's tensors and the whole KV cache
    ``[2, layers, blocks, block_size, kv_heads, head_dim]`` as inputs, for ``torch.export``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens_k: torch.Tensor,
        block_tables: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        # max_seqlen_q is never read when compiling: unified_attention takes the batch's shape.
        md = AttentionMetadata(slot_mapping, cu_seqlens_q, seq_lens_k, block_tables, max_seqlen_q=0, kv_cache=kv_cache)
        return self.model(input_ids, positions, md)


class _Logits(nn.Module):
    """``model.compute_logits(hidden)`` for ``torch.export``: the LM head of the sampled rows."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Every registered model defines compute_logits (models/__init__.py); mypy sees a Module attribute.
        return self.model.compute_logits(hidden)  # type: ignore[operator]


def _example_inputs(num_tokens: int, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """A two-request batch of ``num_tokens`` tokens over a cache shaped like ``kv_cache``, a few
    blocks larger than the first request's table: every symbolic size distinct from the others
    (the tracer must not assume two of them equal)."""
    info = SchedulerInfo()
    width = cdiv(4 * block_size + num_tokens - 1, block_size)  # blocks of the first request
    info.add_row("a", [0] * (num_tokens - 1), 4 * block_size, list(range(width)), samples=True)
    info.add_row("b", [0], 0, [width], samples=True)
    batch = build_batch_inputs(info, block_size, kv_cache.device)
    num_blocks = width + 2 if width + 2 != num_tokens else width + 3
    cache = kv_cache.new_zeros(kv_cache.shape[:2] + (num_blocks,) + kv_cache.shape[3:])
    return (
        batch.input_ids,
        batch.positions,
        *batch.attn_metadata.tensors(),
        cache,
    )


def _compile_graph(model: nn.Module, kv_cache: torch.Tensor, config: EngineConfig, name: str, path: Path) -> None:
    """Export graph ``name`` (the forward for its token range, or the LM head) and compile it into ``path``."""
    if name == "logits":
        rows = torch.export.Dim("rows", min=1, max=SMALL_BATCH_TOKENS)
        hidden = kv_cache.new_zeros(SMALL_BATCH_TOKENS, config.hf_config.hidden_size)
        with torch.inference_mode():
            program = torch.export.export(_Logits(model), (hidden,), dynamic_shapes=({0: rows},), strict=False)
            _package(program, name, path)
        return
    fewest, most = _token_range(name)
    tokens = torch.export.Dim("tokens", min=fewest, max=most) if most else torch.export.Dim("tokens", min=fewest)
    seqs, width, blocks = torch.export.Dim("seqs", min=1), torch.export.Dim("width"), torch.export.Dim("blocks")
    dynamic_shapes = (
        {0: tokens},
        {0: tokens},
        {0: tokens},
        {0: seqs + 1},
        {0: seqs},
        {0: seqs, 1: width},
        {2: blocks},
    )
    # The example's token count is also the row count oneDNN packs the large graph's weights for.
    num_tokens = SMALL_BATCH_TOKENS if name == "small" else 2 * (fewest - 1)
    example = _example_inputs(num_tokens, kv_cache, config.kvcache_block_size)
    with torch.inference_mode():
        program = torch.export.export(_ForwardWithCache(model), example, dynamic_shapes=dynamic_shapes, strict=False)
        _package(program, name, path)


def _package(program: torch.export.ExportedProgram, name: str, path: Path) -> None:
    partial = path.with_name(f"{path.stem}.{os.getpid()}.pt2")
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(partial), inductor_configs={"freezing": True, **GRAPHS[name]}
    )
    os.replace(partial, path)


def _compile_graphs(model: nn.Module, kv_cache: torch.Tensor, config: EngineConfig, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    log.info("compiling the forward into %s (once per model, dtype, thread count and CPU)", directory)
    desc = "compiling the forward, once (enforce_eager=True skips it)"
    for name in tqdm(graph_names(config), desc=desc, unit="graph", dynamic_ncols=True):
        start = time.perf_counter()
        _compile_graph(model, kv_cache, config, name, directory / f"{name}.pt2")
        log.info("compiled the %s graph in %.1f s", name, time.perf_counter() - start)


def _load_package(path: Path) -> Callable[..., Any]:
    """Load one compiled package to run without the GIL (``graph_package.load``), leaving
    nothing behind on disk.

    The loader unzips the package's shared library (the weights are inside it: a few hundred MB
    for the default model) into a fresh directory under ``$TMPDIR`` and never removes it, so every
    engine start would leave the model's size in ``/tmp``. Here it unzips into a directory of our
    own, removed as soon as the library is loaded: the process keeps its mapping of the file."""
    previous = os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix="vllm_fs_aoti_") as scratch:
        os.environ["TMPDIR"] = scratch
        try:
            return graph_package.load(path)
        finally:
            if previous is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = previous


class CompiledForward:
    """The forward of any batch through the compiled graph for its token count.

    Built by :meth:`load_or_compile`; :meth:`run` takes what ``model.forward`` takes (plus the
    KV cache) and returns the same hidden states.
    """

    def __init__(self, graphs: dict[str, Callable[..., Any]]):
        self.graphs = graphs

    @classmethod
    def load_or_compile(cls, config: EngineConfig, model: nn.Module, kv_cache: torch.Tensor) -> CompiledForward | None:
        """Load the graphs cached for this configuration, compiling (and caching) them first if
        there are none: a few minutes for the default model on a 2-core CPU, then a fraction of a
        second at every later start. None, with a warning, where inductor cannot compile here
        (no C++ compiler, a platform it does not support): the engine then runs eagerly."""
        key = compile_key(config)
        directory = cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]
        stamp = directory / STAMP
        if not (stamp.is_file() and stamp.read_text() == key):
            try:
                _compile_graphs(model, kv_cache, config, directory)
            except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager forward
                log.warning(
                    "could not compile the forward (%s); running it eagerly (enforce_eager=True skips trying)", exc
                )
                return None
            partial = stamp.with_name(f"{STAMP}.{os.getpid()}")
            partial.write_text(key)
            os.replace(partial, stamp)
        start = time.perf_counter()
        graphs = {name: _load_package(directory / f"{name}.pt2") for name in graph_names(config)}
        log.info("loaded the compiled forward from %s in %.1f s", directory, time.perf_counter() - start)
        return cls(graphs)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states of every token, as ``model(input_ids, positions, md)`` returns them, the
        batch's K/V written to ``kv_cache``."""
        return self.graphs[graph_for(input_ids.shape[0])](input_ids, positions, *md.tensors(), kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's logits of ``hidden``'s rows through the compiled graph, for 1 to
        :data:`SMALL_BATCH_TOKENS` rows (its GEMM template reads the 28 M weights of the default
        model's head faster than oneDNN does for a row or two); None for any other count, and where
        there is no such graph: where the engine's GEMM runs (:func:`graph_names`)."""
        if "logits" not in self.graphs or not 1 <= hidden.shape[0] <= SMALL_BATCH_TOKENS:
            return None
        return self.graphs["logits"](hidden)
