"""Import Triton the one way every chapter's kernels need.

Triton compiles for a GPU. Without one, its interpreter runs the same kernels on the CPU
(slowly, exactly), but only if ``TRITON_INTERPRET=1`` is in the environment when a kernel is
decorated, i.e. before the kernel module is imported. This module only *reads* it: importing a
library must not change the process's environment, so whoever owns the process decides — the
root ``conftest.py`` for the tests, a demo script at the top of its own file. Every kernel
module imports triton from here, so the two facts below describe the kernels they define:

* ``HAS_TRITON`` — triton is installed (every torch path works without it);
* ``INTERPRETED`` — the kernels were defined for Triton's interpreter, so they run on CPU
  tensors; without it, and without a GPU, only the torch paths run;
* ``KERNEL_DEVICE`` — where the tensors a kernel is launched on must live: ``"cpu"`` when
  interpreted, ``"cuda"`` when compiled (a compiled kernel cannot read CPU memory). Tests and
  demos that call a kernel directly put its inputs there.
"""

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

# The values triton itself reads as true, so this never disagrees with how the kernels were built.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
