"""Every code name the book's walk-throughs mention exists in the code.

The architecture page and the chapter READMEs' walk-through sections name classes, methods and
functions (``SchedulerInfo.from_scheduler_output``, ``scheduler.SchedulerOutput``,
``build_batch_inputs(info, block_size, device)``). A rename in the code leaves such a name behind;
this test finds it. It reads only the files and sections in ``CHECKED``, and in them only:

* in prose, a backticked span that starts with a dotted name (``module.Name``,
  ``Class.method``, ``module.Class.attr``, optionally called), a snake_case call
  (``build_batch_inputs(``), or a CamelCase class name (``PrefixCachingBlockManager``);
* in a fenced block (the ASCII walk-through of 07, the mermaid diagram of the architecture page):
  the dotted names and snake_case calls anywhere in it.

How a name resolves: its head is a module of the book (``docs/hooks/book_pages.py``'s
``book_modules()``, the map the site's import table is built from: ``scheduler``,
``vllm_from_scratch.engine``, ``model_runner``), or a class or function that a module of the book
defines. The module is imported and the rest of the name looked up on it. A lowercase head that is
a module name may also stand for an instance of one of that module's classes (the docs write
``scheduler.schedule()`` for the scheduler object's method). An attribute counts if the class
has it, declares it (dataclass field, annotation, ``__slots__``) or assigns ``self.<name>`` in a
method. Heads that are neither are not the book's names (``torch.cat``, ``self.x``,
``config.json``) and are skipped, except a CamelCase head, which must be the book's, a builtin
(``ValueError``) or listed in ``EXTERNAL``: a renamed class must not pass for a foreign one.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_hook():
    spec = importlib.util.spec_from_file_location("vfs_book_pages_hook", ROOT / "docs" / "hooks" / "book_pages.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HOOK = _load_hook()  # the site's build hook: it already knows the book's modules and fences

# file -> the headings of the sections checked (a section runs to the next heading of its level
# or higher, so its subsections are included); None checks the whole page.
CHECKED: dict[str, list[str] | None] = {
    "docs/architecture.md": None,
    "docs/sources.md": ["nano-vllm ↔ book names"],
    "01_paged_kv/README.md": ["The code"],
    "02_page_attention/README.md": ["The code"],
    "03_prefix_cache/README.md": [
        "1. Chained block hashing",
        "2. The local cache: a block manager subclass",
        "3. The global KV pool",
    ],
    "04_scheduler/README.md": ["The code"],
    "05_spec_decode/README.md": ["The code"],
    "06_chunked_prefill/README.md": ["The code"],
    "07_engine/README.md": ["From `LLM.generate` down", "The parts this chapter adds"],
    "07_engine/topics/serving.md": ["The code"],
    "07_engine/topics/kv_pool.md": ["How a prompt's blocks travel"],
    "07_engine/topics/tensor_parallel.md": [
        "How the weight loaders shard each layer",
        "Starting, calling, stopping (`distributed.py`)",
    ],
    "07_engine/topics/cuda_graphs.md": None,
    "07_engine/topics/adding_a_model.md": None,
}

# CamelCase names and snake_case calls of other projects that the checked text mentions.
EXTERNAL = {
    "OrderedDict",  # collections
    "xxh3_128",  # xxhash
    "exponential_",  # torch
    "set_context",
    "get_context",  # nano-vllm
    "SimpleBlockManager",  # seed 000's, which chapter 04's README says what replaced
    "SequenceStatus",  # nano-vllm's, which docs/sources.md maps to RequestStatus
    "ModelRegistry",  # vLLM's
    "LlamaConfig",  # transformers
    "Phi3ForCausalLM",  # transformers and vLLM
}

FILE_SUFFIXES = {
    "py",
    "md",
    "json",
    "toml",
    "txt",
    "cpp",
    "so",
    "safetensors",
    "gguf",
    "yml",
    "yaml",
    "html",
    "pth",
    "sh",
    "png",
    "svg",
}
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
SPAN_RE = re.compile(r"`([^`\n]+)`")
DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"
SPAN_DOTTED_RE = re.compile(rf"^({DOTTED})(?![\w/-])")
SPAN_CALL_RE = re.compile(r"^([a-z]\w*_\w*)\(")
SPAN_CLASS_RE = re.compile(r"^([A-Z][a-z0-9]+[A-Z]\w*)$")
BLOCK_DOTTED_RE = re.compile(rf"(?<![\w./-])({DOTTED})(?![\w/-])")
BLOCK_CALL_RE = re.compile(r"(?<![\w.])([a-z]\w*_\w*)\(")


@dataclass(frozen=True)
class Name:
    path: str
    line: int
    text: str
    kind: str  # "dotted", "call" or "class"


# ------------------------------------------------------------------------- what the code has
@cache
def book_modules() -> dict[str, str]:
    return HOOK.book_modules()


@cache
def module_file(import_path: str) -> Path | None:
    spec = importlib.util.find_spec(import_path)
    return Path(spec.origin) if spec and spec.origin else None


@cache
def definitions() -> tuple[dict[str, set[str]], set[str]]:
    """Top-level class/function name -> the modules defining it; and every method name."""
    where: dict[str, set[str]] = {}
    methods: set[str] = set()
    for import_path in set(book_modules().values()):
        path = module_file(import_path)
        if path is None or path.suffix != ".py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                where.setdefault(node.name, set()).add(import_path)
            if isinstance(node, ast.ClassDef):
                methods.update(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return where, methods


def _declared_on(cls: type, name: str) -> bool:
    """A dataclass field, an annotation, a slot, or a ``self.<name> = ...`` in a method."""
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        if name in getattr(klass, "__dataclass_fields__", {}) or name in vars(klass).get("__annotations__", {}):
            return True
        if name in (vars(klass).get("__slots__") or ()):
            return True
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr == name
            ):
                return True
    return False


def _walk(obj, parts: list[str]) -> str | None:
    """Follow ``parts`` from ``obj``; None when they all exist, else the first missing part."""
    for part in parts:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and _declared_on(obj, part):
            return None  # an instance attribute: what it holds is not known here
        else:
            return part
    return None


def missing(name: Name) -> str | None:
    """Why ``name`` does not resolve, or None when it does (or is not the book's)."""
    modules = book_modules()
    where, methods = definitions()
    if name.kind == "call":
        fn = name.text
        if fn in where or fn in methods or fn in EXTERNAL:
            return None
        return f"no module or class of the book defines {fn}()"
    if name.kind == "class":
        if name.text in where or name.text in EXTERNAL or hasattr(builtins, name.text):
            return None
        return f"no module of the book defines {name.text}"
    parts = name.text.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    for i in range(len(parts), 0, -1):  # the longest prefix that names a module of the book
        head = ".".join(parts[:i])
        if head not in modules:
            continue
        module = importlib.import_module(modules[head])
        gone = _walk(module, parts[i:])
        if gone is None:
            return None
        if i == 1 and head.islower():  # `scheduler.schedule()`: a method of the module's classes
            classes = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
            if any(_walk(c, parts[1:]) is None for c in classes):
                return None
        return f"{modules[head]} has no {'.'.join(parts[i:])} ({gone} is missing)"
    if parts[0] in where:
        objs = [getattr(importlib.import_module(m), parts[0]) for m in sorted(where[parts[0]])]
        gones = [_walk(obj, parts[1:]) for obj in objs]
        if None in gones:
            return None
        return f"{parts[0]} ({', '.join(sorted(where[parts[0]]))}) has no {'.'.join(parts[1:])}"
    if (
        parts[0][0].isupper()
        and any(c.islower() for c in parts[0])
        and parts[0] not in EXTERNAL
        and not hasattr(builtins, parts[0])
    ):
        return f"no module of the book defines {parts[0]}"
    return None


# --------------------------------------------------------------------------- what the text says
def checked_lines(text: str, headings: list[str] | None) -> list[tuple[int, str]]:
    """(line number, line) of the sections ``headings`` (all lines when None)."""
    lines = text.splitlines()
    if headings is None:
        return list(enumerate(lines, 1))
    out, level, in_code, found = [], None, False, set()
    for number, line in enumerate(lines, 1):
        if HOOK.FENCE_RE.match(line.lstrip()):
            in_code = not in_code
        m = None if in_code else HEADING_RE.match(line)
        if m and level is not None and len(m.group(1)) <= level:
            level = None
        if m and level is None and m.group(2) in headings:
            level = len(m.group(1))
            found.add(m.group(2))
        if level is not None:
            out.append((number, line))
    assert found == set(headings), f"sections not found (renamed?): {sorted(set(headings) - found)}"
    return out


def documented_names(path: str, lines: list[tuple[int, str]]) -> list[Name]:
    names, in_code = [], False
    for number, line in lines:
        if HOOK.FENCE_RE.match(line.lstrip()):
            in_code = not in_code
            continue
        if in_code:
            names += [Name(path, number, m, "dotted") for m in BLOCK_DOTTED_RE.findall(line)]
            names += [Name(path, number, m, "call") for m in BLOCK_CALL_RE.findall(line)]
            continue
        for span in SPAN_RE.findall(line):
            span = span.strip()
            for kind, regex in (("dotted", SPAN_DOTTED_RE), ("call", SPAN_CALL_RE), ("class", SPAN_CLASS_RE)):
                m = regex.match(span)
                if m:
                    names.append(Name(path, number, m.group(1), kind))
                    break
    return names


def problems(path: str, text: str, headings: list[str] | None) -> list[str]:
    return [
        f"{n.path}:{n.line}: `{n.text}`: {why}"
        for n in documented_names(path, checked_lines(text, headings))
        if (why := missing(n))
    ]


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("path", sorted(CHECKED))
def test_every_documented_name_exists(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    assert documented_names(path, checked_lines(text, CHECKED[path])), f"{path}: nothing checked"
    found = problems(path, text, CHECKED[path])
    assert not found, "documented names the code does not have (rename them in the text, or the code):\n" + "\n".join(
        found
    )


FAKE_DOC = """# A page

## The code

`SchedulerInfo.from_scheduler_output(out)` describes the step; `chunked_prefill.SchedulerInfo`,
`build_batch_inputs(info, block_size, device)`, `PrefixCachingBlockManager`,
`scheduler.schedule()`, `Request.spec_token_ids`, `torch.cat`, `config.json`.

```
executor.call("execute_model", scheduler_output) ─► ModelRunner.execute_model
```

## Elsewhere

`NotChecked.at_all`
"""


def test_the_check_passes_real_names_and_skips_foreign_ones():
    assert problems("fake.md", FAKE_DOC, ["The code"]) == []


def test_the_check_catches_a_rename(monkeypatch):
    import chunked_prefill

    monkeypatch.delattr(chunked_prefill.SchedulerInfo, "from_scheduler_output")
    assert problems("fake.md", FAKE_DOC, ["The code"]) == [
        "fake.md:5: `SchedulerInfo.from_scheduler_output`: SchedulerInfo (chunked_prefill) has no from_scheduler_output"
    ]


@pytest.mark.parametrize(
    "line, why",
    [
        ("`chunked_prefill.BatchInfo`", "chunked_prefill has no BatchInfo (BatchInfo is missing)"),
        ("`BatchInfo.from_scheduler_output`", "no module of the book defines BatchInfo"),
        ("`build_batch_input(info)`", "no module or class of the book defines build_batch_input()"),
        ("`PrefixCachingBlockManagr`", "no module of the book defines PrefixCachingBlockManagr"),
        ("`scheduler.schedule_step()`", "scheduler has no schedule_step (schedule_step is missing)"),
        (
            "```\nexecutor ─► ModelRunner.execute_modle\n```",
            "ModelRunner (vllm_from_scratch.model_runner) has no execute_modle",
        ),
    ],
)
def test_the_check_catches_each_kind_of_missing_name(line, why):
    found = problems("fake.md", f"## The code\n\n{line}\n", ["The code"])
    assert len(found) == 1 and found[0].endswith(why), found


def test_a_renamed_section_is_reported():
    with pytest.raises(AssertionError, match="sections not found"):
        checked_lines(FAKE_DOC, ["The codes"])
