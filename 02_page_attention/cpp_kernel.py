"""A C++ source compiled into a torch extension once per machine, then loaded from a disk cache.

``torch.utils.cpp_extension.load`` compiles when asked and keeps its own build folder, but it
runs ninja (and so needs one on PATH) at every load to find out whether anything changed. Here a
build lives in a folder named by a fingerprint of everything the binary depends on (the source's
bytes, the compile flags, torch's and Python's versions, the CPU: the build is tuned with
``-march=native`` for the machine that compiles it), and a later process that finds a finished
build for its fingerprint imports the shared object directly, in milliseconds, without a build
tool. Only when no build matches is it compiled, by ``cpp_extension.load`` in a child process
(a C++ compiler is needed; ``setup.sh`` does this once so that nothing waits later).

Chapter 02's attention kernels (``paged_attention_cpu.py``) are built this way, and so are the
engine's bfloat16 and float32 GEMMs (``07_engine/vllm_from_scratch/layers/bf16_gemm.py``,
``f32_gemm.py``). Each module asks :meth:`CppKernel.loads` whether its kernel runs here, and
takes its slower path, with one warning, where the build fails.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

STAMP = "build_key.txt"
logger = logging.getLogger(__name__)

# The child process that compiles: cpp_extension.load writes build.ninja and the shared object
# into the given directory (and imports it once, which proves it loads).
_BUILD_SCRIPT = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    "load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], "
    "extra_cflags=sys.argv[4:])\n"
)


def compile_flags() -> list[str]:
    """The C++ flags every kernel is compiled with on this machine (part of the cache key)."""
    flags = ["-O3", "-ffast-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    # at::parallel_for is an inline OpenMP loop: without -fopenmp it would run on one thread.
    # On Linux the extension then shares torch's own libgomp.so.1 (same soname, loaded first).
    flags.append("-fopenmp" if sys.platform.startswith("linux") else "-fopenmp-simd")
    return flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them (``avx512_bf16``, ...); empty
    where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def cpu_fingerprint() -> str:
    """A short hash of the CPU's model and feature flags: a native build must not run elsewhere."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        text += platform.processor()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _build_env() -> dict[str, str] | None:
    """The compiling child's environment: pip's ninja (a pinned requirement) first on PATH.

    ``.venv/bin/python`` run without activating the venv may find no ninja at all; the build
    directory is fresh for every key, so which ninja builds it does not matter otherwise.
    """
    try:
        import ninja
    except ImportError:
        return None
    return dict(os.environ, PATH=os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")]))


@dataclass(frozen=True)
class CppKernel:
    """The C++ file ``source`` built as the extension module ``name``, cached per machine."""

    name: str
    source: Path

    def build_key(self) -> str:
        """Everything the compiled binary depends on, one ``name value`` line each.

        A cached build is used only when its key equals this one, so editing the ``.cpp``,
        changing a flag, upgrading torch or Python, or moving to another CPU compiles afresh.
        """
        return (
            f"source sha256:{hashlib.sha256(self.source.read_bytes()).hexdigest()}\n"
            f"flags {' '.join(compile_flags())}\n"
            f"torch {torch.__version__}\n"
            f"python {sys.implementation.cache_tag} {platform.python_version()}\n"
            f"cpu {cpu_fingerprint()}\n"
        )

    def cache_dir(self, key: str) -> Path:
        """The directory holding the build for ``key``.

        Under ``$TORCH_EXTENSIONS_DIR`` when set, else torch's own default for compiled extensions
        (``$XDG_CACHE_HOME/torch_extensions``, normally ``~/.cache/torch_extensions``), then
        ``<name>/<first 16 hex digits of the key's sha256>``.
        """
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if not root:
            cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            root = os.path.join(cache_home, "torch_extensions")
        return Path(root) / self.name / hashlib.sha256(key.encode()).hexdigest()[:16]

    def kernel_path(self, key: str | None = None) -> Path:
        """The shared object of the build for ``key`` (default: :meth:`build_key` of this process)."""
        return self.cache_dir(key or self.build_key()) / f"{self.name}.so"

    def is_cached(self, key: str | None = None) -> bool:
        """Whether a finished build for ``key`` (default: this machine's) is in the cache.

        The stamp holding the key is written only after a build succeeds, so a build that was
        interrupted, or a directory whose name collides, does not count.
        """
        key = key or self.build_key()
        stamp = self.cache_dir(key) / STAMP
        return self.kernel_path(key).is_file() and stamp.is_file() and stamp.read_text() == key

    def build(self, key: str | None = None) -> Path:
        """Compile the source for ``key`` (default: this machine's) into its cache directory.

        Runs ``torch.utils.cpp_extension.load`` in a child process, so this process's environment
        and modules stay as they were, then writes the stamp that :meth:`is_cached` checks.

        Returns:
            The path of the shared object.

        Raises:
            RuntimeError: the compiler failed or is missing (the last lines of its output say why).
        """
        key = key or self.build_key()
        directory = self.cache_dir(key)
        directory.mkdir(parents=True, exist_ok=True)
        logger.info("compiling %s into %s (once per machine and source, about 25 s)", self.source.name, directory)
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", _BUILD_SCRIPT, self.name, str(self.source), str(directory), *compile_flags()],
            capture_output=True,
            text=True,
            env=_build_env(),
        )
        if result.returncode != 0:
            lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()]  # the compiler's, then the traceback's
            raise RuntimeError(f"compiling {self.source.name} failed: " + " | ".join((errors or lines)[-3:]))
        stamp = directory / STAMP
        partial = stamp.with_name(f"{STAMP}.{os.getpid()}")
        partial.write_text(key)
        os.replace(partial, stamp)
        logger.info("compiled %s in %.1f s", self.source.name, time.perf_counter() - start)
        return self.kernel_path(key)

    def loads(self, load: Callable[[], object], fallback: str) -> bool:
        """Whether ``load`` (the caller's loader: :meth:`load` plus what it registers) succeeds.

        False where the build fails, with one warning that names the source and ``fallback``,
        what the caller does instead: a machine without a C++ compiler still runs, on the
        slower path.
        """
        try:
            load()
        except Exception as exc:  # noqa: BLE001 - any build failure means "take the fallback"
            logger.warning("%s could not be built (%s); %s", self.source.name, exc, fallback)
            return False
        return True

    def load(self) -> ModuleType:
        """The extension module: imported from the cache, compiled first if no build matches.
        Importing it registers the torch operators its source defines.

        Raises whatever :meth:`build` raises (no compiler, no Python headers).
        """
        key = self.build_key()
        if not self.is_cached(key):
            self.build(key)
        path = self.kernel_path(key)
        spec = importlib.util.spec_from_file_location(self.name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        logger.info("loaded cached kernel %s", path)
        return module
