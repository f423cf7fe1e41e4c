"""Import Triton the one way every chapter's kernels need.

Triton compiles for a GPU. Without one, its interpreter runs the same kernels on the CPU
(slowly, exactly), but only if ``TRITON_INTERPRET=1`` is set before triton is first imported,
so every kernel module imports triton from here. A machine without triton still runs every
torch path: ``HAS_TRITON`` says which is available.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
