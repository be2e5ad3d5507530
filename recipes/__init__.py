"""Recipes and benchmarks built on hf_midx (a package of this repository, not part of the installed ``hf_midx``).

The recipes import ``hf_midx`` (install it: ``pip install -e .``) and their siblings. A recipe runs
either way, with no ``sys.path`` edit:

* as a file, ``python recipes/wikitext2.py`` (also under ``torchrun`` or ``accelerate launch``, from any
  folder): Python puts the script's folder, ``recipes/``, first on ``sys.path``, so the siblings import
  by name (``import lm_recipe``);
* as this package, ``python -m recipes.wikitext2`` from the repository root, or imported by the tests and
  the benchmarks: the siblings import relatively (``from . import lm_recipe``).

Each module that imports a sibling says which with ``if __package__:`` (relative) / ``else:`` (by name),
the same names in both branches, so a process never holds one file under two module names. The helpers:
``lm_data`` (text, tokenizer, token blocks), ``lm_args`` (the command line and the checks made before
anything is written), ``lm_report`` (the model card's results section) and ``lm_recipe`` (build, train,
evaluate, save, report); ``synthetic`` is the large-vocabulary corpus.
"""
