"""hf-midx through Axolotl's own entry (``axolotl train config.yml``), as a user runs it: the plugin named in the YAML.

Runs only where Axolotl is installed (``bash .ci/run axolotl``: a virtualenv with axolotl 0.19.0 and its pins), and
is skipped by the default suite. Each training is a child process on a tiny random Llama (V = 256) built with
``from_config``, a word-level tokenizer and a few dozen lines of local JSONL, all in a temporary folder; about 45 s
a run on a CPU, nearly all of it Axolotl's start-up. The runs are shared by the tests (module fixtures):

* SFT, full fine-tuning, ``midx: true``: the sampled loss trains, the index is rebuilt on schedule, the checkpoints
  hold the sampler state, the saved model reloads as a plain transformers model whose loss on the evaluation split is
  the ``eval_loss`` Axolotl logged for it;
* the same run resumed from its middle checkpoint repeats the uninterrupted one;
* SFT with LoRA, ``midx: true``: trains, the adapter reloads onto the base model with the logged ``eval_loss``;
* SFT with ``midx: false``: the plugin leaves the model alone (no ``midx/`` logs, no MIDX files), and its first
  loss is the exact loss the ``midx: true`` run measured on the same batch and weights;
* DPO with ``midx: true`` logs what DPO with ``midx: false`` logs (TRL 1.9 asks the model for full logits: exact);
* settings the plugin cannot serve are refused before the model loads, naming the YAML key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("axolotl") is None or importlib.util.find_spec("axolotl.integrations") is None:
    pytest.skip("Axolotl is not installed (bash .ci/run axolotl installs it)", allow_module_level=True)

# Axolotl's telemetry (on by default) would post to the network from this process and its children.
os.environ["AXOLOTL_DO_NOT_TRACK"] = "1"

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from _env import offline_env  # noqa: E402
from _models import tiny_model  # noqa: E402

VOCAB = 256
NUM_SAMPLES = 16
PLUGIN = "hf_midx.integration.axolotl.plugin.MidxPlugin"


# ------------------------------------------------------------------------------------------------ the runs
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny Llama and its tokenizer (``model/``), SFT and DPO data (``sft.jsonl``, ``dpo.jsonl``)."""
    root = tmp_path_factory.mktemp("axolotl")
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<pad>")
    tokenizer.save_pretrained(root / "model")
    model = tiny_model("llama", VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=128)
    model.save_pretrained(root / "model")
    rng = random.Random(0)
    step = [rng.randrange(3, VOCAB) for _ in range(VOCAB)]  # a Markov chain over the words: learnable in a few steps

    def sentence(length: int) -> str:
        ids = [rng.randrange(3, VOCAB)]
        for _ in range(length - 1):
            ids.append(step[ids[-1]] if rng.random() < 0.9 else rng.randrange(3, VOCAB))
        return " ".join(words[i] for i in ids)

    (root / "sft.jsonl").write_text("".join(json.dumps({"text": sentence(24)}) + "\n" for _ in range(72)))
    (root / "dpo.jsonl").write_text("".join(
        json.dumps({"prompt": sentence(8), "chosen": " w5 w6 w7", "rejected": " w200 w201"}) + "\n" for _ in range(32)
    ))
    return root


def _config(root: Path, name: str, **overrides) -> Path:
    """Write ``<name>.yml`` (JSON, which YAML reads) for a run into ``<root>/<name>``; returns its path."""
    config = {
        "base_model": str(root / "model"),
        "datasets": [{"path": str(root / "sft.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(root / "prepared"),
        "val_set_size": 0.1,
        "sequence_len": 32,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 6,
        "learning_rate": 0.01,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "output_dir": str(root / name),
        "bf16": False, "fp16": False, "tf32": False,
        "logging_steps": 1,
        "save_steps": 3,
        "eval_steps": 6,
        "seed": 0,
        "plugins": [PLUGIN],
        "midx": True,
        "midx_num_samples": NUM_SAMPLES,
        "midx_refresh_every_steps": 2,
    }
    config.update(overrides)
    path = root / f"{name}.yml"
    path.write_text(json.dumps(config, indent=1))
    return path


def _axolotl(config: Path, *, check: bool = True) -> subprocess.CompletedProcess:
    """``axolotl train <config>`` (it launches ``accelerate`` from PATH: this interpreter's)."""
    bin_dir = os.path.dirname(sys.executable)
    env = offline_env(PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), OMP_NUM_THREADS="1")
    done = subprocess.run([os.path.join(bin_dir, "axolotl"), "train", str(config)], env=env, cwd=config.parent,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, f"axolotl train {config.name}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done


def _history(output_dir: Path) -> list[dict]:
    """The log history of the run's last checkpoint."""
    last = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((last / "trainer_state.json").read_text())["log_history"]


def _series(history: list[dict], key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in history if key in entry}


@pytest.fixture(scope="module")
def sft(root) -> Path:
    _axolotl(_config(root, "sft"))
    return root / "sft"


@pytest.fixture(scope="module")
def eval_rows(root, sft) -> list[dict]:
    """The evaluation split Axolotl built for the SFT runs, from its public loader (the prepared cache)."""
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets

    return list(load_datasets(cfg=load_cfg(str(root / "sft.yml"))).eval_dataset)


def _eval_loss(model, rows: list[dict], batch_size: int = 4) -> float:
    """The Trainer's ``eval_loss``: each batch's mean token loss, averaged with the batch sizes as weights."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            ids = torch.tensor([row["input_ids"] for row in batch])  # one length: "completion" rows of 24 words
            labels = torch.tensor([row["labels"] for row in batch])
            total += float(model(input_ids=ids, labels=labels).loss) * len(batch)
    return total / len(rows)


# ------------------------------------------------------------------------------------------------ SFT
def test_sft_trains_the_sampled_loss_and_refreshes_the_index(sft):
    history = _history(sft)
    exact = _series(history, "midx/train_loss_exact")  # the exact loss of each step's batch, before its update
    assert sorted(exact) == [1, 2, 3, 4, 5, 6]
    assert exact[6] < exact[1] - 0.3, exact  # 5.55 nats at the start (log 256): the chain's transitions are learnt
    refreshed = _series(history, "midx/refresh_seconds")
    assert sorted(refreshed) == [2, 4, 6], history  # midx_refresh_every_steps: 2
    assert (sft / "checkpoint-3" / "midx_state.safetensors").is_file()
    saved = json.loads((sft / "midx_config.json").read_text())
    assert saved["num_samples"] == NUM_SAMPLES and saved["refresh_every_steps"] == 2


def test_sft_saves_a_plain_model_with_the_evaluated_loss(sft, eval_rows):
    model = AutoModelForCausalLM.from_pretrained(sft)
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    eval_loss = _series(_history(sft), "eval_loss")[6]
    assert abs(_eval_loss(model, eval_rows) - eval_loss) < 1e-5


def test_resume_from_an_axolotl_checkpoint_repeats_the_run(root, sft):
    shutil.copytree(sft / "checkpoint-3", root / "resumed" / "checkpoint-3")
    _axolotl(_config(root, "resumed", resume_from_checkpoint=str(root / "resumed" / "checkpoint-3")))
    for key in ("loss", "midx/train_loss_exact", "eval_loss"):
        whole, resumed = _series(_history(sft), key), _series(_history(root / "resumed"), key)
        late = {step: value for step, value in whole.items() if step > 3}
        assert late and resumed.keys() >= late.keys(), (key, whole, resumed)
        for step, value in late.items():
            assert abs(resumed[step] - value) < 1e-6, (key, step, value, resumed[step])


def test_lora_trains_and_its_adapter_reloads(root, eval_rows):
    from peft import PeftModel

    out = root / "lora"
    # Axolotl's fused LoRA kernels (on by default) are CUDA-only: off on a CPU. They patch the MLP and attention,
    # not the output layer, so on a GPU the head runs as it does here.
    kernels = dict(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    done = _axolotl(_config(root, "lora", adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0,
                            lora_target_linear=True, learning_rate=0.05, **kernels))
    # peft 0.20's tuner runs the model's forward past its hooks; the binding hooks the tuner too (else: full logits).
    assert "loss was computed from full logits" not in done.stdout + done.stderr
    history = _history(out)
    exact = _series(history, "midx/train_loss_exact")
    assert exact[6] < exact[1] - 0.05, exact
    assert _series(history, "midx/refresh_seconds") == {}  # LoRA freezes the output layer: its index stays as built
    assert (out / "adapter_model.safetensors").is_file() and (out / "midx_config.json").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), out)
    assert abs(_eval_loss(model, eval_rows) - _series(history, "eval_loss")[6]) < 1e-5


def test_midx_false_leaves_the_model_alone(root, sft):
    out = root / "off"
    _axolotl(_config(root, "off", midx=False, max_steps=3))  # midx_num_samples stays set: ignored, with a warning
    history = _history(out)
    assert not [key for entry in history for key in entry if key.startswith("midx/")]
    assert not list(out.rglob("midx_*"))
    # The full softmax's first loss is the exact loss the MIDX run measured on the same batch and initial weights.
    assert abs(_series(history, "loss")[1] - _series(_history(sft), "midx/train_loss_exact")[1]) < 1e-5


# ------------------------------------------------------------------------------------------------ DPO
def _dpo(root: Path, name: str, midx: bool) -> Path:
    dataset = {"path": str(root / "dpo.jsonl"), "ds_type": "json", "split": "train", "type": "passthrough"}
    _axolotl(_config(root, name, rl="dpo", datasets=[dataset], val_set_size=0, max_steps=3, save_steps=3,
                     eval_steps=None, midx=midx))
    return root / name


def test_dpo_logs_what_it_logs_without_midx(root):
    wrapped, plain = _dpo(root, "dpo", True), _dpo(root, "dpo_off", False)
    assert (wrapped / "midx_config.json").is_file() and not (plain / "midx_config.json").exists()
    keys = ("loss", "rewards/margins", "logps/chosen", "logps/rejected")
    for key in keys:
        got, want = _series(_history(wrapped), key), _series(_history(plain), key)
        assert sorted(want) == [1, 2, 3] and got.keys() == want.keys(), key
        for step in want:
            assert abs(got[step] - want[step]) < 1e-5 * max(1.0, abs(want[step])), (key, step, got, want)
    assert _series(_history(plain), "rewards/margins")[3] > 0  # it trained: the chosen completion gained


# ------------------------------------------------------------------------------------------------ refusals
def test_a_bad_value_is_refused_naming_its_yaml_key(root):
    done = _axolotl(_config(root, "bad", midx_num_samples=-1), check=False)
    assert done.returncode != 0
    assert "midx_num_samples: num_samples must be an integer >= 1" in done.stdout + done.stderr
    assert not (root / "bad").exists()  # refused while Axolotl validated the config, before anything was written


@pytest.mark.parametrize(
    "setting, message",
    [({"rl": "kto"}, "rl: kto"), ({"cut_cross_entropy": True}, "cut_cross_entropy: true"),
     ({"liger_fused_linear_cross_entropy": True}, "liger_fused_linear_cross_entropy: true")],
)
def test_what_would_bypass_the_head_is_refused_before_the_model_loads(setting, message):
    from axolotl.utils.dict import DictDefault

    from hf_midx.integration.axolotl.plugin import MidxPlugin

    with pytest.raises(ValueError, match=message):
        MidxPlugin().pre_model_load(DictDefault({"midx": True, **setting}))
    MidxPlugin().pre_model_load(DictDefault({"midx": False, **setting}))  # off: nothing is checked, nothing refused
