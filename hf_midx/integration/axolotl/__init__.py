"""hf-midx as an Axolotl plugin: ``midx: true`` in an Axolotl YAML config trains the LM head with the MIDX softmax.

Name the plugin in the config and switch it on::

    plugins:
      - hf_midx.integration.axolotl.plugin.MidxPlugin
    midx: true
    midx_num_samples: 20        # any MidxConfig field, as midx_<field>

The parts: :mod:`.args` (the YAML keys, checked by :class:`~hf_midx.MidxConfig` when Axolotl validates the config),
:mod:`.counts` (the training-token counts, read from the tokenized dataset the trainer holds) and :mod:`.plugin`
(the hooks: wrap the model and install :class:`~hf_midx.MidxCallback` once the trainer exists). Only :mod:`.plugin`
imports Axolotl (it subclasses ``axolotl.integrations.base.BasePlugin``): this package and the other two modules
import without it.
"""
