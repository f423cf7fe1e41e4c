"""Compile the book's Triton kernels for a GPU that is not there (sm_80, sm_90), launching nothing.

Triton's interpreter proves on a CPU that a kernel computes the right numbers, but it runs the
kernel as numpy, so it accepts programs the GPU compiler rejects and says nothing about the
registers, shared memory or spills of the compiled code. Compiling needs no GPU: Triton's front
end, its MLIR passes, LLVM's PTX back end and ``ptxas`` (bundled in the triton wheel) all run on
the host. A kernel launch asks the *active driver* only three things before it compiles: the
target (``get_current_target``), and the device and stream to launch on. :class:`StandInDriver`
answers them for a GPU of a given compute capability, and :func:`compile_only` swaps a module's
kernels for proxies that compile (``run(..., warmup=True)``) instead of launching, so the book's
own wrappers bind their real arguments and Triton specialises them exactly as on that GPU::

    with compile_only(gpu_target(90), paged_attention_triton, "_paged_decode_kernel") as compiled:
        paged_attention_decode_triton(q, k_cache, v_cache, block_tables, lens, scale)  # CPU tensors
    usage = resource_usage(compiled[0])  # {'REG': 40, 'STACK': 0, 'LOCAL': 0, ...}

The process must not be interpreting: under ``TRITON_INTERPRET=1`` every ``@triton.jit``, the
book's and ``triton.language``'s own, became an interpreter function when it was imported and
cannot be compiled. ``tests/test_triton_compile.py`` therefore runs the check in a child process
without that variable. Written against Triton 3.6 (the GPU machines') and 3.9.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from triton_setup import HAS_TRITON, INTERPRETED  # before any other triton import

# The most shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin): what
# Triton checks at the first launch, so a kernel over it compiles here and fails only on the GPU.
MAX_SHARED_BYTES = {80: 166912, 90: 232448}


def gpu_target(capability: int) -> Any:
    """Triton's ``GPUTarget`` for an NVIDIA GPU of compute capability ``capability`` (80: A100,
    90: H100), 32-thread warps."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", capability, 32)


def ptxas_missing(capability: int) -> str | None:
    """Why kernels cannot be compiled to machine code for ``capability`` here, or None if they can.

    Triton picks the ptxas it bundles for the architecture (or ``TRITON_PTXAS_PATH``); a
    platform's wheel without the binaries leaves only the interpreter.
    """
    if not HAS_TRITON:
        return "triton is not installed"
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(capability)
    except RuntimeError as e:  # triton's "Cannot find ptxas"
        return f"{e} (this triton wheel bundles no ptxas for sm_{capability})"
    return None


class StandInDriver:
    """The part of a Triton GPU driver a compile-only launch asks for: target, device, stream.

    It is never a real driver: ``is_active()`` is False, so Triton does not pick it by itself;
    :func:`compile_only` makes it the active one for a while. Anything that would touch a device
    (loading a binary, launching) finds no method and fails loudly.
    """

    def __init__(self, target: Any) -> None:
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class _CompileOnlyKernel:
    """Stands for a ``@triton.jit`` kernel in its module: ``kernel[grid](*args)`` compiles."""

    def __init__(self, kernel: Any, compiled: list) -> None:
        from triton.runtime.jit import JITFunction

        # A fresh JITFunction of the same Python function: a JITFunction remembers the target of
        # its first launch (per device index), so the module's own kernel, perhaps already run on
        # this machine's GPU, would compile for that GPU rather than for the stand-in's target.
        self.kernel = JITFunction(
            kernel.fn,
            version=kernel.version,
            do_not_specialize=kernel.do_not_specialize,
            do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment,
            debug=kernel.debug,
            noinline=kernel.noinline,
        )
        self.compiled = compiled

    def __getitem__(self, grid: Any):
        def compile_with(*args: Any, **kwargs: Any) -> None:
            self.compiled.append(self.kernel.run(*args, grid=grid, warmup=True, **kwargs))

        return compile_with


@contextlib.contextmanager
def compile_only(target: Any, module: ModuleType, *kernel_names: str) -> Iterator[list]:
    """Inside the block, launching ``module``'s kernels ``kernel_names`` compiles them for
    ``target`` and launches nothing; the yielded list collects Triton's ``CompiledKernel``s
    (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata.shared``, ...) in launch order.

    Everything is restored on exit: the module's kernels and Triton's active driver.
    """
    if INTERPRETED:
        raise RuntimeError(
            "TRITON_INTERPRET is set: the kernels were built for Triton's interpreter and cannot be "
            "compiled; run the check in a process without it"
        )
    from triton.runtime.driver import driver

    compiled: list = []
    originals = {name: getattr(module, name) for name in kernel_names}
    # Read the field, not the property: without a GPU the property raises (no active driver).
    previous_driver = driver._active
    driver.set_active(StandInDriver(target))
    try:
        for name, kernel in originals.items():
            setattr(module, name, _CompileOnlyKernel(kernel, compiled))
        yield compiled
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
        driver.set_active(previous_driver)


def resource_usage(kernel: Any) -> dict[str, int]:
    """The compiled kernel's resources as the CUDA toolkit reports them: registers per thread
    (``REG``), stack frame (``STACK``) and local memory (``LOCAL``) per thread, static shared
    memory (``SHARED``), in bytes. Spilled registers live in the stack frame, so a kernel that
    spills has ``STACK > 0``. Read from the cubin with the ``cuobjdump`` Triton bundles.
    """
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        report = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    # "Resource usage:\n REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:412 TEXTURE:0 ..."
    return {name: int(value) for name, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", report)}
