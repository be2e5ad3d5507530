"""The Axolotl plugin's YAML keys and token counts, without Axolotl: ``midx_<field>`` checked by MidxConfig with the
key named, ``midx`` unset or false doing nothing, and the training targets counted from tokenized datasets as
Axolotl's SFT and TRL's DPO hold them. (Training through Axolotl: test_axolotl_train.py, ``bash .ci/run axolotl``.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("pydantic")
datasets = pytest.importorskip("datasets")

from pydantic import ValidationError  # noqa: E402

from hf_midx import MidxConfig, token_counts  # noqa: E402
from hf_midx.integration.axolotl.args import MidxArgs, midx_config  # noqa: E402
from hf_midx.integration.axolotl.counts import dataset_token_counts  # noqa: E402


def test_every_config_field_is_a_yaml_key_with_its_help():
    fields = MidxArgs.model_fields
    for f in dataclasses.fields(MidxConfig):
        assert fields[f"midx_{f.name}"].description == f.metadata["help"]
    assert set(fields) == {"midx"} | {f"midx_{f.name}" for f in dataclasses.fields(MidxConfig)}


def test_set_keys_make_the_config_and_unset_ones_keep_its_defaults():
    config = midx_config({"midx": True, "midx_num_samples": 64, "midx_sampler": "midx-pq", "midx_seed": None})
    assert config == MidxConfig(num_samples=64, sampler="midx-pq")
    assert midx_config({"midx": True}) == MidxConfig()


@pytest.mark.parametrize("switch", [{}, {"midx": False}, {"midx": None}])
def test_midx_unset_or_false_does_nothing(switch):
    assert midx_config(switch) is None
    with pytest.warns(UserWarning, match="midx_num_samples set but midx is not true"):
        assert midx_config({**switch, "midx_num_samples": 64}) is None


def test_a_refused_value_names_its_key():
    with pytest.raises(ValidationError, match="midx_num_samples: num_samples must be an integer >= 1"):
        MidxArgs(midx=True, midx_num_samples=0)
    with pytest.raises(ValueError, match="midx_sampler: .*midx-rq"):  # MidxConfig lists the samplers
        midx_config({"midx": True, "midx_sampler": "no-such-sampler", "midx_num_samples": 8})
    # Refused only together: both keys named.
    with pytest.raises(ValueError, match=r"midx_negatives, midx_log_probs \(together\): log_probs='exact-forward'"):
        midx_config({"midx": True, "midx_negatives": "shared", "midx_log_probs": "exact-forward"})
    with pytest.warns(UserWarning, match="set but midx is not true"):
        MidxArgs(midx=False, midx_num_samples=0)  # off: not checked, only warned as unused


def test_counts_read_the_targets_of_sft_and_dpo_datasets():
    sft = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 4]], "labels": [[-100, 2, 3], [-100, 4]]})
    assert torch.equal(dataset_token_counts(sft, 6), token_counts([[2, 3], [4]], 6))  # the prompt left out
    dpo = datasets.Dataset.from_dict(
        {"prompt_ids": [[1, 1], [1]], "chosen_ids": [[2], [3, 3]], "rejected_ids": [[5], [5]]}
    )
    assert dataset_token_counts(dpo, 6).tolist() == [0, 0, 1, 2, 0, 2]
    pretraining = datasets.Dataset.from_dict({"input_ids": [[0, 1], [1]]})
    assert dataset_token_counts(pretraining, 3).tolist() == [1, 2, 0]


def test_counts_refuse_what_holds_no_ids():
    with pytest.raises(ValueError, match="the trainer has none"):
        dataset_token_counts(None, 4)
    with pytest.raises(ValueError, match=r"none of the token columns labels or chosen_ids\+rejected_ids or input_ids"):
        dataset_token_counts(datasets.Dataset.from_dict({"text": ["a b"]}), 4)
    with pytest.raises(ValueError, match="streamed dataset"):
        dataset_token_counts([{"input_ids": [1]}], 4)
    with pytest.raises(ValueError, match=r"token id 9 is outside \[0, 4\)"):
        dataset_token_counts(datasets.Dataset.from_dict({"labels": [[9]]}), 4)


def test_the_readme_yaml_names_the_plugin_and_valid_keys():
    yaml = pytest.importorskip("yaml")
    import re

    from _env import REPO

    (block,) = re.findall(r"^```yaml\n(.*?)^```", (REPO / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    config = yaml.safe_load(block)
    # Axolotl imports the module and takes the class from it; the module imports Axolotl, so read it instead.
    (plugin,) = config["plugins"]
    module, name = plugin.rsplit(".", 1)
    source = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    assert f"\nclass {name}(BasePlugin):" in source and f'"{name}"' in source.split("__all__")[-1]
    keys = {key: value for key, value in config.items() if key.startswith("midx")}
    assert MidxArgs(**keys).midx is True and midx_config(keys) == MidxConfig(num_samples=20)
