"""Recipes and benchmarks built on hf_midx (not part of the installed package).

The scripts run as files (``python recipes/wikitext2.py``, ``accelerate launch recipes/large_vocab.py``)
and import their helpers (``lm_data``, ``lm_recipe``, ``synthetic``) as top-level modules from this
directory. ``synthetic`` and ``lm_data`` import nothing else from here, so benchmarks can also use them
as ``recipes.synthetic`` / ``recipes.lm_data`` from the repository root.
"""
