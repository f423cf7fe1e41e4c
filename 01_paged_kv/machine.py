"""What machine a figure came from: the line every benchmark of the book prints beside its table.

The same workload runs several times faster on one CPU than another: bfloat16 is native on a CPU
with AVX-512 BF16 or AMX and emulated (about 7× slower than float32) on one with only AVX2, and
a shared machine's load moves every timing. So a figure without its machine means little. This
module reads only ``/proc/cpuinfo``, the load average and torch's thread count; it imports no
other module of the book, so every chapter's benchmark (and the engine's dtype rule) can use it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

# The CPU features that decide which dtype is fast (bfloat16 in hardware, or emulated).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` line's value in /proc/cpuinfo (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """Which of ``CPU_FLAGS`` this CPU has (all False where /proc/cpuinfo cannot be read)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return {name: name in flags for name in CPU_FLAGS}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    flags = cpu_flags()
    return flags["avx512_bf16"] or flags["amx_bf16"]


def load_average() -> str:
    """The 1, 5 and 15-minute load averages: others' jobs on a shared machine slow every run."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line() -> str:
    """CPU model, cores, the dtype flags and torch's threads, in one line."""
    flags = " ".join(f"{name}{'' if on else ' (no)'}" for name, on in cpu_flags().items())
    return f"{cpu_name()}, {os.cpu_count()} cores; {flags}; torch threads {torch.get_num_threads()}"


# Above this 1-minute load average per core, other jobs share the cores a benchmark times.
QUIET_LOAD_PER_CORE = 0.5


def busy_warning(max_load_per_core: float = QUIET_LOAD_PER_CORE) -> str | None:
    """A warning naming the load when the machine is busier than ``max_load_per_core``, else None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load / cores <= max_load_per_core:
        return None
    return (
        f"the 1-minute load average is {load:.2f} on {cores} cores (above {max_load_per_core} per core): "
        "other jobs share the CPU, so these timings are not a quiet machine's"
    )


def add_quiet_arg(parser: argparse.ArgumentParser) -> None:
    """The ``--refuse-busy`` flag every benchmark of the book takes."""
    parser.add_argument(
        "--refuse-busy",
        action="store_true",
        help=f"exit instead of measuring when the load average is above {QUIET_LOAD_PER_CORE} per core "
        "(without it, a busy machine is warned about and measured anyway)",
    )


def check_quiet(refuse: bool) -> None:
    """Before a benchmark: warn on stderr when the machine is busy, or exit if ``refuse``."""
    warning = busy_warning()
    if warning is None:
        return
    if refuse:
        raise SystemExit(f"refusing to measure: {warning}")
    print(f"warning: {warning}", file=sys.stderr)
