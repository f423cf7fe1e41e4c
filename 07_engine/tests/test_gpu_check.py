"""``07_engine/gpu_check.sh --dry-run`` under a bare machine's conditions: what a lent GPU will
run, checked here first so that its device time goes to measuring.

The bare machine has no editable install and no FastAPI or pydantic. The interpreter runs with
``-S`` (no ``.pth`` file, so the editable install's paths are gone) and site-packages on
PYTHONPATH as a plain directory; FastAPI and pydantic are shadowed by packages that refuse to
import, so a kit that needed them would fail here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import gpu_check
from gpu_check import TEST_DIRS, Step, cuda_test_files, plan, planned_seconds

REPO = Path(__file__).resolve().parents[2]


def bare_env(tmp_path: Path) -> dict[str, str]:
    blocked = tmp_path / "blocked"
    for name in ("fastapi", "pydantic"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not on a bare GPU machine')\n")
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PYTHONNOUSERSITE": "1",
        "PYTHON": f"{sys.executable} -S",
        "PYTHONPATH": os.pathsep.join([str(blocked), *sorted(site)]),
    }


@pytest.mark.slow
def test_the_dry_run_passes_every_step_with_the_kits_path_alone(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "07_engine" / "gpu_check.sh"), "--dry-run", str(out)],
        env=bare_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    statuses = {r["step"]: r["status"] for r in summary["steps"]}
    assert list(statuses) == [s.name for s in plan(out, out / "models", dry_run=True)]
    assert all(status == "ok" for status in statuses.values()), (statuses, done.stdout[-3000:])
    reports = {r["step"]: r.get("report") for r in summary["steps"]}
    # The engine came from this tree through the kit's PYTHONPATH, not from an install.
    assert Path(reports["versions"]["vllm_from_scratch"]).is_relative_to(REPO / "07_engine")
    assert all(case["ok"] for case in reports["kernels"]["cases"])
    assert reports["parity"]["runs"]["float32"]["match"]
    assert {row["system"].split(" (")[0] for name in ("bench_graphs", "bench_eager") for row in reports[name]["rows"]}
    # What comes back from a lent machine: at most 8 files, none in a folder.
    assert sorted(p.name for p in out.iterdir()) == [
        "logs.txt",
        "profile_decode.txt",
        "pytest_cuda.xml",
        "summary.json",
        "summary.md",
    ]
    assert "===== bench_transformers: ok" in (out / "logs.txt").read_text()


def test_a_check_without_the_kits_path_cannot_import_the_engine(tmp_path):
    """The bare environment really is bare: without gpu_check.sh's PYTHONPATH, no engine."""
    env = bare_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import vllm_from_scratch"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "vllm_from_scratch" in done.stderr
    done = subprocess.run([sys.executable, "-S", "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert "not on a bare GPU machine" in done.stderr


def test_one_call_fits_seven_minutes_and_the_quick_one_three():
    """The limits of every step add up to the plan: 7 minutes of a lent machine's call, less
    the interpreter's start and the driver's own seconds; --quick is the short second try."""
    assert planned_seconds(quick=False) <= 7 * 60 - 15
    assert planned_seconds(quick=True) <= 3 * 60 - 5
    full = plan(Path("w"), Path("m"), dry_run=False)
    assert [s.name for s in full] == [
        "versions",
        "checkpoint",
        "pytest_cuda",
        "kernels",
        "parity",
        "decode",
        "bench_graphs",
        "bench_eager",
        "bench_transformers",
    ]


def test_the_cuda_tests_run_are_every_file_with_a_cuda_marked_test():
    """``pytest -m cuda`` collects every GPU case: each file the kit names holds cuda-marked
    tests, and no test gates itself on CUDA with a skipif, which ``-m cuda`` would deselect."""
    files = cuda_test_files()
    assert "07_engine/tests/test_engine_sampler.py" in files and "07_engine/tests/test_kv_sizing.py" in files
    gate = re.compile(r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)")
    for folder in TEST_DIRS:
        for path in (REPO / folder).glob("test_*.py"):
            assert not gate.search(path.read_text()), f"{path.name}: mark GPU cases pytest.mark.cuda instead"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert collected == set(files)


def test_a_step_past_its_limit_is_killed_with_its_children_and_the_rest_still_run(tmp_path, monkeypatch):
    """Results are written as each step ends: a step that hangs is cut off (its child processes
    too), recorded as a timeout, and the next step still runs and is recorded."""
    pid_file = tmp_path / "child.pid"
    hang = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    steps = [
        Step("hangs", ["-c", hang], timeout_s=3),
        Step("passes", ["-c", "print('result: fine')"], timeout_s=30),
    ]
    monkeypatch.setattr(gpu_check, "_plan", lambda *args: steps)
    assert gpu_check.main([str(tmp_path / "out")]) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["step"], r["status"]) for r in summary["steps"]] == [("hangs", "timeout"), ("passes", "ok")]
    assert summary["steps"][1]["note"] == "fine" and summary["planned_s"] == 33
    child = int(pid_file.read_text())
    for _ in range(50):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the hung step's child outlived its time limit")


def test_the_driver_refuses_a_step_not_in_its_plan(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "versions,warp_drive", "unused"])
    assert "warp_drive" in capsys.readouterr().err
