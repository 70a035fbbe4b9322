"""Modules that torchtitan's trainer imports by dotted name (``experimental.custom_import``) when
``benchmarks.bench_scale`` runs it: they need torchtitan, which only that benchmark's GPU runs install."""
