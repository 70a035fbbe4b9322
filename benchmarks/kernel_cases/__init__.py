"""The kernel benchmark's cases, one module per op family (``benchmarks/kernel_cases/<family>.py``).

``python -m benchmarks.bench_kernels --only FAMILY ...`` imports ``benchmarks.kernel_cases.<FAMILY>`` and calls
its ``run(copy_gbs) -> list[dict]``: one row per (op, shape, impl, pass), timed by
:func:`benchmarks.common.compare_impls` (or, for the optimiser step, :func:`benchmarks.common.timed_pass`).
"""
