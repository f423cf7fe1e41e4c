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


def check_answer_file(answer, docstring_says: str) -> None:
    """An answer file (a catalogued mistake or a hint's answer) defines its exercise's stub
    function, with the reference's parameters and a one-line docstring that ``docstring_says``."""
    plugin = load_script("exercise_plugin")
    assert answer.function_node() is not None, f"{answer.name} defines no {answer.exercise.stub_name}"
    assert answer.summary and "\n" not in answer.summary, f"{answer.name}: a one-line docstring {docstring_says}"
    spec = importlib.util.spec_from_file_location(f"vfs_answer_{answer.path.stem.replace('.', '_')}", answer.path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = getattr(module, answer.exercise.stub_name)
    assert plugin.signature_key(written) == plugin.signature_key(plugin.reference_function(answer.exercise)), (
        f"{answer.name}: parameters differ from {answer.exercise.target}'s"
    )
