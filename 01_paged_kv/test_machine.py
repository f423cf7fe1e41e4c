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


def fake_load(monkeypatch, one_minute: float, cores: int = 2) -> None:
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (one_minute, 0.0, 0.0))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: cores)


def test_a_quiet_machine_is_measured_without_a_word(monkeypatch, capsys):
    fake_load(monkeypatch, 0.9)  # 0.45 per core
    machine.check_quiet(refuse=True)
    assert capsys.readouterr().err == ""


def test_a_busy_machine_is_warned_about_or_refused(monkeypatch, capsys):
    fake_load(monkeypatch, 1.5)  # 0.75 per core
    machine.check_quiet(refuse=False)
    assert "load average is 1.50 on 2 cores" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="refusing to measure"):
        machine.check_quiet(refuse=True)


def test_every_benchmark_checks_the_load_before_it_measures():
    from pathlib import Path

    root = Path(machine.__file__).resolve().parents[1]
    scripts = [
        root / "02_page_attention" / "demo.py",
        *root.glob("0*/bench*.py"),
        *root.glob("07_engine/benchmarks/bench*.py"),
    ]
    unchecked = [str(s.relative_to(root)) for s in scripts if "check_quiet(" not in s.read_text()]
    assert len(scripts) > 8 and not unchecked, f"benchmarks that time a busy machine silently: {unchecked}"
