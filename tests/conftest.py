"""Test setup: with no GPU, run the Triton kernels through the interpreter on the CPU.

TRITON_INTERPRET must be set before triton compiles anything, so it is set here, before any
test module imports ``kernels``. On a CUDA machine the same tests run natively on the GPU.

The interpreter (triton 3.6-3.9) converts fp32 to bf16 by truncating the mantissa, whereas the
GPU rounds to nearest-even. Left alone, every bf16 result on the CPU would carry about twice the
rounding error it has on the GPU, and the "no worse than eager bf16" checks would measure the
simulator rather than the kernels. So, in the interpreter only, fp32->bf16 conversion is made to
round to nearest-even (through torch), as the hardware does.
"""

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _truncating_convert = getattr(_interp, "_convert_float", None)

    def _convert_float_rne(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return _truncating_convert(data, src, dst, rounding_mode)

    if _truncating_convert is not None:
        _interp._convert_float = _convert_float_rne
