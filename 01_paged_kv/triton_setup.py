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


def _index_loop_bounds_under_numpy_2_4() -> None:
    """Let Triton's interpreter before 3.8 run a loop to a loaded bound under numpy >= 2.4.

    A kernel's ``range(0, n, BLOCK)`` with ``n`` loaded from memory calls the interpreter's
    ``__index__`` on a one-element array, which those versions convert with ``int(array)``; numpy
    2.4 refuses that for arrays of one dimension ("only 0-dimensional arrays can be converted").
    Triton 3.8 converts ``int(array.squeeze())``, which this does for the older interpreters too
    (Triton 3.6 is what the lent GPU machines have, with numpy 2.5, for a CPU dry run there).
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index


if INTERPRETED and HAS_TRITON and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8):
    _index_loop_bounds_under_numpy_2_4()
