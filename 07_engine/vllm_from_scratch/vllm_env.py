"""The ``VLLM_*`` environment variables of vLLM's CPU guides, each honoured or refused by name.

A deployment written for vLLM's CPU build sets these; none may be ignored without a word. The
engine honours the ones that mean something here (:data:`HONOURED`): the KV cache's size in GiB,
which cores the compute threads run on, and how many cores to leave to the front end. The others
tune kernels or set-ups this engine does not have (:data:`REFUSED`): set to vLLM's default they
ask for nothing, set to anything else they stop the start with an error naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from vllm_from_scratch.errors import ParameterError

# name -> what it does here (vLLM's meaning, read from vllm/envs.py).
HONOURED = {
    "VLLM_CPU_KVCACHE_SPACE": "KV cache size on a CPU in GiB: the default of cpu_kvcache_space_gib (empty: unset)",
    "VLLM_CPU_OMP_THREADS_BIND": "'auto' (every core this process may use, less the reserved ones, split between "
    "the tensor-parallel ranks), 'nobind' (torch's threads as they are), or core ids such as '0-3,6' for each rank, "
    "'|' between ranks; unset: as 'nobind' unless VLLM_CPU_NUM_OF_RESERVED_CPU is set",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "with 'auto' binding, cores left to the front end (the HTTP server, tokenizing); "
    "unset: none (vLLM reserves one per rank on x86)",
    "VLLM_API_KEY": "the API key when --api-key is not given",
    "VLLM_LOGGING_LEVEL": "the default of --log-level",
    "VLLM_LOG_STATS_INTERVAL": "seconds between the server's stats lines (default 10; off with --disable-log-stats)",
}
# name -> (vLLM's default, why another value cannot be honoured here).
REFUSED = {
    "VLLM_CPU_SGL_KERNEL": ("0", "selects vLLM's SGLang AMX kernels for small batches; this engine has its own"),
    "VLLM_CPU_MOE_PREPACK": ("1", "prepacks mixture-of-experts weights for vLLM's kernels; no MoE model runs here"),
    "VLLM_CPU_ATTN_SPLIT_KV": ("1", "splits the KV of vLLM's CPU attention kernel; chapter 02's kernels are used"),
    "VLLM_CPU_INT4_W4A8": ("1", "selects vLLM's int4 AWQ kernels; quantized checkpoints are not loaded"),
    "VLLM_ZENTORCH_WEIGHT_PREPACK": ("1", "prepacks weights for ZenDNN; the engine runs torch's own kernels"),
    "VLLM_CPU_SIM_MULTI_NUMA": ("0", "simulates several NUMA nodes for vLLM's binding; one process binds here"),
    "VLLM_CPU_CI_ENV": ("0", "switches vLLM's CI-only CPU behaviour; there is none here"),
}
DEFAULT_CPU_KVCACHE_SPACE_GIB = 2.0


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, naming it, any :data:`REFUSED` variable set to something other than vLLM's default,
    and any honoured one whose value does not parse."""
    env = os.environ if environ is None else environ
    for name, (default, why) in REFUSED.items():
        value = env.get(name)
        if value not in (None, "", default):
            raise ParameterError(name, f"={value!r} cannot be honoured: it {why} (unset it, or set it to {default!r})")
    cpu_kvcache_space_gib(env)
    reserved_cpus(env)
    binding = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if binding not in ("", "auto", "nobind"):
        for cores in binding.split("|"):
            parse_core_ids(cores)
    interval = env.get("VLLM_LOG_STATS_INTERVAL", "")
    if interval:
        _number("VLLM_LOG_STATS_INTERVAL", interval, float)


def cpu_kvcache_space_gib(environ: Mapping[str, str] | None = None) -> float:
    """``VLLM_CPU_KVCACHE_SPACE`` in GiB (vLLM's unit), or the book's default of 2 GiB when it is
    unset or empty. Unset, vLLM sizes its cache from the machine's free memory; the book's laptops
    and 2-core machines share theirs with other work, and 2 GiB hold ~90k tokens of the default
    model's cache. 0 is refused, as vLLM fails on it (no memory for the cache)."""
    env = os.environ if environ is None else environ
    text = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    if not text:
        return DEFAULT_CPU_KVCACHE_SPACE_GIB
    value = _number("VLLM_CPU_KVCACHE_SPACE", text, float)
    if value <= 0:
        raise ParameterError("VLLM_CPU_KVCACHE_SPACE", f"must be a size in GiB > 0, got {text!r}")
    return value


def reserved_cpus(environ: Mapping[str, str] | None = None) -> int:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU``; 0 when unset (the engine and the front end share every core)."""
    env = os.environ if environ is None else environ
    text = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "")
    value = int(_number("VLLM_CPU_NUM_OF_RESERVED_CPU", text, int)) if text else 0
    if value < 0:
        raise ParameterError("VLLM_CPU_NUM_OF_RESERVED_CPU", f"must be an int >= 0, got {text!r}")
    return value


def thread_cores(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The cores rank ``rank`` of ``world_size`` runs its compute threads on, as
    ``VLLM_CPU_OMP_THREADS_BIND`` says; None for 'nobind', and where neither binding variable is
    set: torch's threads are then left as the book runs them (one per core, split between ranks)."""
    env = os.environ if environ is None else environ
    spec = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if spec == "nobind" or not (spec or env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")):
        return None
    spec = spec or "auto"
    if spec == "auto":
        usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [*range(os.cpu_count() or 1)]
        reserved = reserved_cpus(env)
        if reserved >= len(usable):
            raise ParameterError(
                "VLLM_CPU_NUM_OF_RESERVED_CPU", f"({reserved}) leaves none of this process's {len(usable)} cores"
            )
        compute = usable[: len(usable) - reserved]
        share = max(1, len(compute) // world_size)
        return compute[rank * share : (rank + 1) * share] or compute[-1:]
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ParameterError(
            "VLLM_CPU_OMP_THREADS_BIND",
            f"={spec!r} gives {len(lists)} core list(s) for {world_size} tensor-parallel rank(s): one per rank, "
            "'|' between them",
        )
    return parse_core_ids(lists[rank])


def parse_core_ids(text: str) -> list[int]:
    """``'0-3,6'`` -> ``[0, 1, 2, 3, 6]``; a :class:`ParameterError` naming the variable otherwise."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ParameterError("VLLM_CPU_OMP_THREADS_BIND", f"{text!r} is not a core list such as '0-3,6'") from None
    if not cores:
        raise ParameterError("VLLM_CPU_OMP_THREADS_BIND", f"{text!r} names no core")
    return cores


def bind_threads(cores: list[int] | None) -> None:
    """Run this process's compute threads on ``cores``: one torch thread per core, and every
    thread of the process (those torch starts later inherit it) allowed on those cores only."""
    if cores is None:
        return
    if hasattr(os, "sched_setaffinity"):
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), cores)
            except OSError as exc:
                raise ParameterError("VLLM_CPU_OMP_THREADS_BIND", f"cannot bind to cores {cores}: {exc}") from None
    torch.set_num_threads(len(cores))


def _number(name: str, text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        raise ParameterError(name, f"must be {'an int' if kind is int else 'a number'}, got {text!r}") from None
