"""The GPU benchmarks of ligermodels and the report that turns their results into docs/performance.md.

Layout, one naming scheme:

* ``bench_<name>.py``: an entry point, ``python -m benchmarks.bench_<name> ...`` (its docstring says what it
  measures and writes); ``report.py``: ``python -m benchmarks.report``, the tables generated from ``results/``.
  Entry points import shared code from :mod:`benchmarks.common` only, never from one another.
* ``common.py``: every helper more than one module uses (paths, results files, timing, model shapes, the
  end-to-end training step, inputs and child processes of the training benchmarks).
* ``kernel_cases/<family>.py``: the cases ``bench_kernels`` runs for one kernel family.
* ``titan/``: modules torchtitan's trainer imports for ``bench_scale`` (its model flavors).
* ``results/``: the JSON files, profiles and experiments the docs cite; ``*.sh``: GPU-machine helpers.
"""
