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
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gpu_check import plan

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
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    statuses = {f"{r['phase']}:{r['step']}": r["status"] for r in summary["steps"]}
    expected = {f"{s.phase}:{s.name}" for s in plan(out, out / "models", dry_run=True)}
    assert set(statuses) == expected
    assert all(status == "ok" for status in statuses.values()), (statuses, done.stdout[-3000:])
    versions = json.loads((out / "versions.json").read_text())
    # The engine came from this tree through the kit's PYTHONPATH, not from an install.
    assert Path(versions["vllm_from_scratch"]).is_relative_to(REPO / "07_engine")
    for name in (
        "kernels.json",
        "parity.json",
        "decode.json",
        "profile_decode.txt",
        "pytest_cuda.xml",
        "bench.json",
        "summary.md",
    ):
        assert (out / name).exists(), name


def test_a_check_without_the_kits_path_cannot_import_the_engine(tmp_path):
    """The bare environment really is bare: without gpu_check.sh's PYTHONPATH, no engine."""
    env = bare_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import vllm_from_scratch"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "vllm_from_scratch" in done.stderr
    done = subprocess.run([sys.executable, "-S", "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert "not on a bare GPU machine" in done.stderr


def test_the_driver_refuses_a_bad_budget(capsys):
    from gpu_check import main

    with pytest.raises(SystemExit, match="budget-s"):
        main(["--budget-s", "0", "unused"])
