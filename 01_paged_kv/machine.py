"""What machine a figure came from: the line every benchmark of the book prints beside its table.

The same workload runs several times faster on one CPU than another: bfloat16 is native on a CPU
with AVX-512 BF16 or AMX and emulated (about 7× slower than float32) on one with only AVX2, and
a shared machine's load moves every timing. So a figure without its machine means little. This
module reads only ``/proc/cpuinfo``, the load average and torch's thread count; it imports no
other module of the book, so every chapter's benchmark (and the engine's dtype rule) can use it.
"""

from __future__ import annotations

import os
import platform

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
