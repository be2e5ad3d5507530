"""MidxPlugin: the Axolotl hooks that put hf-midx's head on the model a YAML config trains.

With ``midx: true`` (:mod:`.args`), the plugin

* refuses, before the model loads, what would bypass the head: Cut Cross-Entropy and Liger's fused linear
  cross-entropy (both replace the model's forward), and the RL trainers other than DPO (not tested with TRL 1.9);
* once Axolotl has built the trainer (``post_trainer_create``), counts the training tokens of the tokenized dataset
  the trainer holds (:mod:`.counts`), wraps the trainer's model (:func:`hf_midx.wrap`: the policy, inside its PEFT
  wrapper where LoRA is on, whose modules wrap hooks too; the output layer is still a plain ``nn.Linear``, which
  Axolotl's LoRA leaves out) and
  installs :class:`~hf_midx.MidxCallback` (index refresh, sampler state in checkpoints, ``midx/`` logs);
* after training, writes ``midx_config.json`` beside the saved model, which is a plain transformers model (or a
  plain PEFT adapter).

It wraps at ``post_trainer_create`` rather than ``post_model_build`` because the counts need the tokenized dataset,
which Axolotl hands to no earlier hook, and because ``post_model_build`` also runs for DPO's reference model, which
must stay the plain model. No trainer class is replaced (``get_trainer_cls``: the first plugin to answer wins).
With ``midx`` unset or false every hook returns at once: the plugin may be installed for every run.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from axolotl.integrations.base import BasePlugin
from packaging.version import Version

from ..callback import MidxCallback
from ..head import find_head
from ..wrap import wrap
from ..zero import full_shape
from .args import midx_config
from .counts import dataset_token_counts

logger = logging.getLogger(__name__)

#: The oldest Axolotl the plugin runs with (``bash .ci/run axolotl`` tests it); 0.19.0 is the newest for Python 3.11.
MINIMUM_AXOLOTL = "0.19.0"
#: Axolotl's ``rl`` values the plugin serves: TRL 1.9's DPOTrainer asks the model for full logits, which the wrapped
#: head computes exactly (the unwrapped model's values and cost).
SERVED_RL = ("dpo",)
#: Axolotl keys whose kernels replace the model's forward, so that the MIDX head would never run.
FORWARD_REPLACING_KEYS = ("cut_cross_entropy", "liger_fused_linear_cross_entropy")


class MidxPlugin(BasePlugin):
    """Axolotl plugin: ``plugins: [hf_midx.integration.axolotl.plugin.MidxPlugin]`` and ``midx: true`` in the YAML.

    Attributes:
        callback: the :class:`~hf_midx.MidxCallback` installed on the trainer (None until then, and with ``midx``
            unset or false).
    """

    def __init__(self) -> None:
        super().__init__()
        self.callback: MidxCallback | None = None
        self._should_save = True

    def get_input_args(self) -> str:
        return "hf_midx.integration.axolotl.args.MidxArgs"

    def pre_model_load(self, cfg) -> None:
        """Refuse, before the model loads, an Axolotl too old or a setting the MIDX head cannot serve."""
        if midx_config(cfg) is None:
            return
        found = version("axolotl")
        if Version(found).release < Version(MINIMUM_AXOLOTL).release:
            raise ImportError(f"hf_midx's Axolotl plugin needs axolotl >= {MINIMUM_AXOLOTL} (installed: {found}).")
        bypass = [key for key in FORWARD_REPLACING_KEYS if cfg.get(key)]
        if bypass:
            raise ValueError(
                f"midx: true with {', '.join(f'{key}: true' for key in bypass)}: that kernel replaces the model's "
                "forward and computes the full softmax itself, so the MIDX head would never run. Set one of them."
            )
        rl = cfg.get("rl")
        if rl is not None and str(getattr(rl, "value", rl)) not in SERVED_RL:
            raise ValueError(
                f"midx: true with rl: {getattr(rl, 'value', rl)}: hf_midx's Axolotl plugin is tested with SFT and "
                f"rl: {', '.join(SERVED_RL)} only (TRL {_trl_version()}); the log-probabilities that trainer uses as "
                "exact values are not checked against the unwrapped model there. Drop midx, or train it with TRL "
                "directly (hf_midx's README, 'Post-training with TRL')."
            )

    def post_trainer_create(self, cfg, trainer) -> None:
        """Count the training tokens, wrap the trainer's model and install :class:`~hf_midx.MidxCallback`."""
        config = midx_config(cfg)
        if config is None:
            return
        model = trainer.model
        vocab = int(full_shape(model.get_output_embeddings().weight)[0])  # its rows: often past len(tokenizer)
        counts = dataset_token_counts(trainer.train_dataset, vocab)
        try:
            wrap(model, config, class_counts=counts)
        except ValueError as err:
            raise ValueError(
                f"{err} (Axolotl: keep the output layer out of lora_target_modules and lora_modules_to_save; the "
                "MIDX head trains it itself.)"
            ) from err
        self.callback = MidxCallback.install(trainer, resume_from_checkpoint=cfg.get("resume_from_checkpoint"))
        self._should_save = trainer.args.should_save
        logger.info("hf_midx: %s wrapped with %s.", type(model).__name__, find_head(model).extra_repr())

    def post_train(self, cfg, model) -> None:
        """Write ``midx_config.json`` beside the saved model (Axolotl saves it with ``save_pretrained``)."""
        head = find_head(model)
        if self.callback is None or head is None or not self._should_save:
            return
        head.config.save_pretrained(cfg.output_dir)


def _trl_version() -> str:
    try:
        return version("trl")
    except PackageNotFoundError:
        return "not installed"


__all__ = ["FORWARD_REPLACING_KEYS", "MINIMUM_AXOLOTL", "MidxPlugin", "SERVED_RL"]
