"""A GPU platform on the CPU: the runner's GPU branches (KV sizing from the allocator, decode
graphs) run here through its own constructor, with the hardware probes injected.

``GPUPlatform(StandInMemory(...), cuda_graphs=False)`` makes a CPU :class:`ModelRunner` size its
cache by profiling (the allocator's numbers are the stand-in's) and capture decode graphs that
replay eagerly; only CUDA itself (the capture, the allocator) is left to the ``cuda`` tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vllm_from_scratch.model_runner import GPUPlatform


class StandInMemory:
    """:class:`~vllm_from_scratch.model_runner.MemoryProbes` of a pretend card of ``total`` bytes
    with ``free`` of them free, ``allocated`` in use by this process at rest, and ``peaks``: what
    ``max_memory_allocated`` reads, in turn (the profile reads it after the largest steps, then
    after the largest decode graph's forward). ``calls`` records every probe read, in order."""

    def __init__(self, total: int, free: int, allocated: int, peaks: list[int]):
        self.total, self.free, self.allocated = total, free, allocated
        self.peaks = list(peaks)
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")

    def memory_allocated(self) -> int:
        self.calls.append("memory_allocated")
        return self.allocated

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        return self.peaks.pop(0)

    def mem_get_info(self) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, self.total


def cpu_gpu_platform(memory: StandInMemory) -> GPUPlatform:
    """The GPU platform a CPU can run: ``memory``'s numbers, decode graphs replayed eagerly."""
    return GPUPlatform(memory, cuda_graphs=False)


@contextlib.contextmanager
def recorded_forwards() -> Iterator[list[int]]:
    """The token count of every model forward (a module with ``compute_logits``) run inside the
    block, in order, observed by a global forward hook: nothing of the runner is replaced."""
    tokens: list[int] = []

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if hasattr(module, "compute_logits") and args:
            tokens.append(args[0].numel())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield tokens
    finally:
        handle.remove()
