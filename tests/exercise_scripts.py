"""The scripts of ``exercises/`` (the plugin, make_stubs, grade, mistakes), loaded by path for the tests.

``exercises/`` is not on sys.path (its stub files must never shadow a book module), so a test loads
a script under a private name, once, and also under its plain name, which is how the scripts
import each other.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"


def load_script(stem: str) -> ModuleType:
    """``exercises/<stem>.py`` as a module (the same object on every call)."""
    # The plugin's private name is the one the root conftest.py loads it under: one module, one state.
    name = f"vfs_exercise_{stem.removeprefix('exercise_')}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXERCISES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules.setdefault(stem, sys.modules[name])
