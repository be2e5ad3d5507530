"""Benchmark scripts: ``python recipes/benchmarks/<name>.py`` or ``python -m recipes.benchmarks.<name>``.

Each imports ``common`` (the shared runner: command line, variants, timing, rows, Markdown, plots) as
``from . import common`` when run as this package, or ``import common`` when run as a file (Python puts
the script's folder first on ``sys.path``); ``common.import_recipe`` reaches the recipes in both cases.
"""
