"""A compiled forward's package, run with Python's GIL released (``graph_package.cpp``).

torch's loader (``torch._inductor.aoti_load_package``) holds the GIL while a graph runs. In the
server the engine's thread runs the forward and the event loop's thread reads requests and
streams tokens, so every step froze the event loop for its whole length: on a 2-core AVX2 VM a
thread that only counted got 2 turns a second during a 512-token prefill against 16,800 idle,
and 16,800 with the GIL released. The C++ here loads the same package with the same class and
releases the GIL around the forward alone. Where it cannot be built, :func:`load` falls back to
torch's loader.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cpp_kernel import CppKernel

KERNEL = CppKernel("vllm_fs_graph_package", Path(__file__).resolve().with_suffix(".cpp"))


@functools.cache
def _module() -> ModuleType:
    return KERNEL.load()


@functools.cache
def releases_the_gil() -> bool:
    """Whether this machine builds the loader that releases the GIL (False, with one warning,
    where it cannot: the graphs then run through torch's loader, holding it)."""
    return KERNEL.loads(_module, fallback="compiled forwards hold the GIL (torch's loader)")


class GraphPackage:
    """One compiled graph, called like torch's ``AOTICompiledModel`` with positional tensors,
    returning its outputs as the graph returns them (the pytree of its call spec)."""

    def __init__(self, path: str | Path):
        self.package = _module().GraphPackage(str(path))
        self.out_spec = pytree.treespec_loads(self.package.call_spec()[1])

    def __call__(self, *tensors: torch.Tensor) -> Any:
        return pytree.tree_unflatten(self.package.run(list(tensors)), self.out_spec)


def load(path: str | Path) -> Callable[..., Any]:
    """The package at ``path``: a :class:`GraphPackage` where :func:`releases_the_gil`, else
    torch's own loader's model."""
    if releases_the_gil():
        return GraphPackage(path)
    return torch._inductor.aoti_load_package(str(path))
