"""Recipes and benchmarks built on hf_midx (a package of this repository, not part of the installed ``hf_midx``).

The recipes import each other as this package (``from recipes.lm_data import TokenBlocks``). Run them
from a checkout as files, ``python recipes/wikitext2.py`` (also under ``torchrun`` or ``accelerate
launch``): a script run as a file puts the repository root on ``sys.path`` first, so ``recipes`` imports
from the checkout it sits in. ``python -m recipes.wikitext2`` from the repository root works too.
``synthetic`` and ``lm_data`` import nothing else from here.
"""
