"""The engine's code reads as the book says it does: the step loop on one screen near the top of
``engine.py``, and no module reaching into another's private state. (The import graph has no
cycle: ``tests/test_import_scheme.py``.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import vllm_from_scratch
from vllm_from_scratch.engine import LLMEngine

PACKAGE = Path(vllm_from_scratch.__file__).parent


def test_the_step_is_one_screen_in_the_first_third_of_engine_py():
    lines, first = inspect.getsourcelines(LLMEngine.step)
    total = len(Path(inspect.getsourcefile(LLMEngine)).read_text(encoding="utf-8").splitlines())
    assert len(lines) <= 15, f"LLMEngine.step is {len(lines)} lines: schedule, execute, update, outputs"
    assert first <= total / 3, f"LLMEngine.step starts at line {first} of {total}: a reader meets it first"
    body = "".join(lines)
    calls = [body.index(call) for call in ("schedule()", "_execute_model(", "update_from_output(", "process_outputs(")]
    assert calls == sorted(calls), "the step reads schedule -> execute -> update -> outputs"


def _private_attributes() -> set[str]:
    """Every ``self._name`` the package assigns: its objects' private state."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and target.attr.startswith("_")
                ):
                    names.add(target.attr)
    return names


def test_no_module_reaches_into_another_objects_private_state():
    """Private state is read through ``self`` only; an executor's runner (the rank-0 model runner
    in this process) is the executor's own: the engine asks the executor (``call``,
    ``call_rank0``) instead."""
    private = _private_attributes()
    assert "_forking" in private  # the walk sees the engine's state
    reaches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or (isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
            if node.attr in private or node.attr == "runner" or (node.attr == "parents" and owner == "engine"):
                reaches.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "\n".join(reaches)
