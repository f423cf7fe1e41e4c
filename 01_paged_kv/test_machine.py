"""The machine line every benchmark prints: read from /proc/cpuinfo, and honest where it cannot be."""

from __future__ import annotations

import os

import pytest
import torch

import machine

AVX2_ONLY = "fpu sse sse2 avx avx2 fma"
ZEN4 = "fpu sse sse2 avx avx2 fma avx512f avx512_bf16"
SAPPHIRE_RAPIDS = "fpu sse avx2 avx512f amx_bf16 amx_tile"


def fake_cpuinfo(monkeypatch, fields: dict[str, str] | None) -> None:
    """Stand in for /proc/cpuinfo: ``fields`` are its lines, None makes it unreadable."""
    monkeypatch.setattr(machine, "_cpuinfo_field", lambda name: None if fields is None else fields.get(name))


@pytest.mark.parametrize("flags, native", [(AVX2_ONLY, False), (ZEN4, True), (SAPPHIRE_RAPIDS, True), ("", False)])
def test_native_bfloat16_needs_avx512_bf16_or_amx(monkeypatch, flags, native):
    fake_cpuinfo(monkeypatch, {"flags": flags})
    assert machine.cpu_has_native_bf16() is native


def test_the_line_names_the_cpu_its_dtype_flags_and_threads(monkeypatch):
    fake_cpuinfo(monkeypatch, {"model name": "AMD EPYC 9R14", "flags": ZEN4})
    line = machine.machine_line()
    assert line.startswith(f"AMD EPYC 9R14, {os.cpu_count()} cores; ")
    assert "avx2 avx512f avx512_bf16 amx_bf16 (no)" in line
    assert line.endswith(f"torch threads {torch.get_num_threads()}")


def test_an_unreadable_cpuinfo_claims_no_flag(monkeypatch):
    fake_cpuinfo(monkeypatch, None)
    assert machine.cpu_flags() == dict.fromkeys(machine.CPU_FLAGS, False)
    assert machine.cpu_name()  # the platform module's answer instead


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="/proc/cpuinfo is Linux's")
def test_this_machines_flags_are_read():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert machine.cpu_flags() == {name: name in flags for name in machine.CPU_FLAGS}
    assert len(machine.load_average().split()) == 3
