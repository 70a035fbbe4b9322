"""Triton kernels of ligermodels, one op family per module.

Every public op runs its Triton kernels on CUDA tensors, and on CPU tensors runs the pure-PyTorch
reference, or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``
(see :mod:`kernels._common`). Every op is a ``torch.library`` custom op, so it composes with
``torch.compile`` without graph breaks. Inputs are never modified.
"""

from kernels._common import INTERPRET, use_triton
from kernels.glu import geglu, swiglu

__all__ = ["INTERPRET", "use_triton", "swiglu", "geglu"]
