"""Benchmark scripts (``python recipes/benchmarks/<name>.py``); they import ``recipes.benchmarks.common``."""
