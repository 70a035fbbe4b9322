"""torchtitan model flavors for ``benchmarks.bench_scale``: Llama-3.1-8B's shape with fewer layers.

torchtitan picks a model by ``--model.flavor`` from ``torchtitan.models.llama3.llama3_args`` and has no
flag for the layer count, so a run on fewer layers (``bench_scale --layers N``, e.g. a one-GPU smoke
test that an 8B model would not fit) needs its own flavor. torchtitan imports this module in its
trainer process (``--experimental.custom_import benchmarks.titan.flavors``, set by bench_scale); it
adds ``8B_layers{N}`` (SDPA, causal over the whole row) and ``8B_flex_layers{N}`` (FlexAttention,
causal within documents) for N = 1..32, each torchtitan's ``8B`` / ``8B_flex`` with ``n_layers = N``.

Benchmark-only: it imports torchtitan, which is never a dependency of ligermodels.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3 import llama3_args

from benchmarks.common import titan_flavor

for _n in range(1, 33):
    for _attention, _base in (("causal", "8B"), ("documents", "8B_flex")):
        llama3_args.setdefault(titan_flavor(_n, _attention), dataclasses.replace(llama3_args[_base], n_layers=_n))
