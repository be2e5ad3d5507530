"""The YAML keys of the Axolotl plugin: ``midx`` and ``midx_<field>`` for every :class:`~hf_midx.MidxConfig` field.

Axolotl merges the pydantic model named by a plugin's ``get_input_args`` into its config schema, so these keys sit at
the top level of the YAML file beside Axolotl's own (prefixed: Axolotl has a ``seed`` of its own). The fields are
generated from ``MidxConfig``'s (its help text becomes their description; one place per fact), every one optional:
an unset key keeps ``MidxConfig``'s default. ``MidxConfig`` validates the values when Axolotl validates the config,
before any data or model is loaded, and an error names the YAML key. Imports pydantic (Axolotl's), not Axolotl.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field, create_model, model_validator

from ...config import MidxConfig

#: The prefix of the YAML keys of MidxConfig fields: ``midx_num_samples`` sets ``MidxConfig.num_samples``.
PREFIX = "midx_"
#: The YAML key that switches the plugin on.
SWITCH = "midx"

_MidxConfigKeys = create_model(
    "_MidxConfigKeys",
    **{
        PREFIX + f.name: (Any, Field(default=None, description=f.metadata.get("help")))
        for f in dataclasses.fields(MidxConfig)
    },
)


def midx_config(values: Mapping[str, Any]) -> MidxConfig | None:
    """The :class:`~hf_midx.MidxConfig` an Axolotl config asks for (``values``: the parsed YAML, Axolotl's ``cfg``),
    or None where ``midx`` is unset or false (then the ``midx_`` keys are ignored, with a warning).

    Raises:
        ValueError: a value ``MidxConfig`` refuses, naming its YAML key (or the keys, where only their combination
            is refused).
    """
    given = {f.name: values.get(PREFIX + f.name) for f in dataclasses.fields(MidxConfig)}
    given = {name: value for name, value in given.items() if value is not None}  # null or unset: the default
    if not values.get(SWITCH):
        if given:
            warnings.warn(
                f"{', '.join(PREFIX + name for name in given)} set but {SWITCH} is not true: hf_midx does nothing. "
                f"Set {SWITCH}: true to train the LM head with the MIDX sampled softmax.",
                UserWarning,
                stacklevel=2,
            )
        return None
    try:
        return MidxConfig(**given)
    except (TypeError, ValueError) as err:
        together = err
    for name, value in given.items():  # which key: the first one refused on its own
        try:
            MidxConfig(**{name: value})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{PREFIX}{name}: {err}") from None
    keys = ", ".join(PREFIX + name for name in given)
    raise ValueError(f"{keys} (together): {together}") from None


class MidxArgs(_MidxConfigKeys):
    """The plugin's Axolotl input arguments: ``midx`` (off unless true), one ``midx_<field>`` per MidxConfig field."""

    midx: bool | None = Field(
        default=None,
        description="Train the LM head with hf-midx's MIDX sampled softmax (evaluation and the saved model stay "
        "the full softmax). Unset or false: the plugin does nothing.",
    )

    @model_validator(mode="after")
    def _check_midx_config(self) -> "MidxArgs":
        # Inside Axolotl this model is one base of its whole config schema: read only the plugin's keys.
        midx_config({name: getattr(self, name) for name in type(self).model_fields
                     if name == SWITCH or name.startswith(PREFIX)})
        return self


__all__ = ["MidxArgs", "PREFIX", "SWITCH", "midx_config"]
