"""MidxConfig: defaults, validation messages, JSON round trip and error handling."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from hf_midx import MidxConfig, MidxIndex, build_sampler, sampled_softmax_loss  # noqa: E402
from hf_midx.config import CONFIG_NAME  # noqa: E402
from hf_midx.samplers import SAMPLER_OPTIONS, SAMPLERS  # noqa: E402
from hf_midx.version import __version__  # noqa: E402


def test_defaults_are_valid_and_documented():
    config = MidxConfig()
    assert config.sampler == "midx-rq" and config.num_samples == 20 and config.codebook_size == 32
    assert config.negatives == "per-query" and config.codebooks == "kmeans"
    assert config.refresh_every_steps == "auto" and config.refresh_every_epoch is True
    assert (config.refresh_budget, config.refresh_min_steps, config.refresh_max_steps) == (0.03, 10, 1000)
    assert config.kmeans_iters == 20 and config.kmeans_backend == "torch"
    assert config.remove_accidental_hits is None and config.seed == 0 and config.sampler_options == {}
    assert config.codebook_learning_rate == 1e-3 and config.kl_weight == 1.0 and config.kl_queries == 64
    assert config.log_kl is True
    assert config.estimator == "corrected-positive" and config.exact_head == "auto"
    assert config.mix_weight == 0.5 and config.mix_static == "unigram" and config.last_stage == "centered"
    for f in dataclasses.fields(MidxConfig):
        assert f.metadata.get("help"), f"field {f.name} has no help"
    assert CONFIG_NAME == "midx_config.json"


def test_the_docstring_lists_every_field_with_its_default_and_help():
    doc = MidxConfig.__doc__
    for f in dataclasses.fields(MidxConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f"``{f.name}`` = ``{default!r}``" in doc, f.name
        assert " ".join(f.metadata["help"].split()[:4]) in " ".join(doc.split()), f.name


def test_config_imports_no_sampler_loss_or_quantizer():
    """config.py stays low in the import graph: names and option tables from hf_midx.registry, defaults and
    choices from hf_midx.defaults; each sampler checks its own options."""
    import hf_midx.config

    tree = ast.parse(open(hf_midx.config.__file__, encoding="utf-8").read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is None for a in n.names}
    assert imported and not imported & {"loss", "quantizers", "samplers", "head", "index"}, imported


def test_the_low_level_builders_take_the_config_defaults():
    """One source of defaults: build_sampler("midx-rq", w) is MidxConfig()'s sampler (the same K, mixture and
    last stage, the same draws), and the loss's default estimator and negatives are the config's."""
    w = torch.randn(300, 16, generator=torch.Generator().manual_seed(0))
    counts = torch.arange(300) % 11
    q = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    config = MidxConfig()
    bare = build_sampler("midx-rq", w, class_counts=counts)
    configured = build_sampler(config.sampler, w, class_counts=counts, **config.sampler_kwargs())
    for s in (bare, configured):
        assert s.name == config.sampler and s.index.codebook_size == config.codebook_size == 32
        assert (s.mix_weight, s.mix_static, s.last_stage) == (config.mix_weight, config.mix_static, config.last_stage)
    assert bare.mix_weight == 0.5
    assert torch.equal(bare.sample(q, 50)[0], configured.sample(q, 50)[0])
    loss = inspect.signature(sampled_softmax_loss).parameters
    assert loss["estimator"].default == config.estimator == "corrected-positive"
    assert loss["negatives"].default == config.negatives
    index = inspect.signature(MidxIndex.build).parameters
    assert index["codebook_size"].default == config.codebook_size
    assert index["kmeans_iters"].default == config.kmeans_iters
    # Without class counts both give up the unigram component alike, and say so.
    for kwargs in ({}, config.sampler_kwargs()):
        with pytest.warns(UserWarning, match="mix_static='unigram' needs? class_counts"):
            assert build_sampler("midx-rq", w, **kwargs).mix_weight == 0.0


def test_the_wrapped_models_sampler_is_build_samplers():
    """hf_midx.wrap(model) with MidxConfig() builds build_sampler("midx-rq", w)'s sampler (with the exact head
    excluded): the same K, mixture and last stage, the same draws; its loss uses the config's estimator."""
    import hf_midx
    from hf_midx.integration.head import find_head
    from _models import VOCAB, tiny_model  # not tests._models: another distribution may install a tests package

    counts = torch.arange(VOCAB) % 13 + 1
    head, config = find_head(hf_midx.wrap(tiny_model("gpt2"), class_counts=counts)), MidxConfig()
    bare = build_sampler("midx-rq", head.weight.detach(), class_counts=counts, exclude=head.exact_ids)
    for s in (head.sampler, bare):
        assert s.name == config.sampler and s.index.codebook_size == config.codebook_size
        assert (s.mix_weight, s.mix_static, s.last_stage) == (config.mix_weight, config.mix_static, config.last_stage)
    q = torch.randn(6, head.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.sampler.sample(q, 50)[0], bare.sample(q, 50)[0])
    loss_default = inspect.signature(sampled_softmax_loss).parameters["estimator"].default
    assert head.config.estimator == config.estimator == loss_default

def test_num_samples_defaults_to_the_negatives_modes_own(tmp_path):
    """Unset, M is 20 per token but the shared pool, which serves a whole batch, is 1024; replace() moves a
    mode's default along with the mode and keeps a value set by hand; the saved file holds the number."""
    assert MidxConfig().num_samples == 20 and MidxConfig(num_samples=None).num_samples == 20
    shared = MidxConfig(negatives="shared")
    assert shared.num_samples == 1024
    assert MidxConfig().replace(negatives="shared").num_samples == 1024
    assert shared.replace(negatives="per-query").num_samples == 20
    assert MidxConfig(num_samples=50).replace(negatives="shared").num_samples == 50
    assert MidxConfig().replace(negatives="shared", num_samples=300).num_samples == 300
    assert MidxConfig(negatives="shared", num_samples=64).num_samples == 64
    shared.save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["num_samples"] == 1024
    assert MidxConfig.from_pretrained(tmp_path).num_samples == 1024


def test_sampler_options_default_is_not_shared():
    a, b = MidxConfig(), MidxConfig()
    a.sampler_options["sphere_alpha"] = 3.0
    assert b.sampler_options == {}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_registered_sampler_is_accepted(name):
    assert MidxConfig(sampler=name).sampler == name


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(sampler="softmax"), "Unknown sampler 'softmax'; choose one of: .*midx-rq"),
        (dict(num_samples=0), "num_samples must be an integer >= 1"),
        (dict(num_samples=2.5), "num_samples must be an integer"),
        (dict(num_samples=True), "num_samples must be an integer"),
        (dict(codebook_size=0), "codebook_size"),
        (dict(negatives="pooled"), "negatives must be one of"),
        (dict(codebooks="random"), "codebooks must be one of"),
        (dict(sampler="uniform", codebooks="learned"), "codebooks='learned' needs a MIDX sampler"),
        (dict(refresh_every_steps=-1), "refresh_every_steps must be an integer >= 0"),
        (dict(refresh_every_steps="often"), "refresh_every_steps must be 'auto' or an integer >= 0"),
        (dict(refresh_budget=0.0), "refresh_budget must be a finite number > 0"),
        (dict(refresh_budget=1.5), r"refresh_budget is a share of training time in \(0, 1\)"),
        (dict(refresh_min_steps=0), "refresh_min_steps must be an integer >= 1"),
        (dict(refresh_min_steps=100, refresh_max_steps=10), "refresh_max_steps must be an integer >= 100"),
        (dict(refresh_every_epoch="yes"), "refresh_every_epoch must be True or False"),
        (dict(kmeans_iters=-1), "kmeans_iters"),
        (dict(kmeans_backend="sklearn"), "kmeans_backend must be one of"),
        (dict(remove_accidental_hits=1), "remove_accidental_hits must be True, False or None"),
        (dict(seed=-1), "seed must be an integer >= 0"),
        (dict(sampler_options=["lsh_bits"]), "sampler_options must be a dict"),
        (dict(sampler_options={"lsh_bitz": 4}), r"Unknown sampler option\(s\) \['lsh_bitz'\]; known options: "),
        (dict(sampler_options={"kmeans_iters": 3}), "Set kmeans_iters as MidxConfig field"),
        (dict(codebook_learning_rate=0.0), "codebook_learning_rate must be a finite number > 0"),
        (dict(codebook_learning_rate=float("nan")), "codebook_learning_rate"),
        (dict(kl_weight=-1.0), "kl_weight must be a finite number >= 0"),
        (dict(kl_queries=0), "kl_queries must be an integer >= 1"),
        (dict(log_kl=None), "log_kl must be True or False"),
        (dict(sampler_options={"rff_temperature": 2}), r"\['rff_temperature'\] do not apply to sampler 'midx-rq' "
         r"\('rff_temperature' belongs to rff\)"),
        (dict(sampler_options={"quantizer": "pq"}), "'quantizer' belongs to midx-exact"),
        (dict(sampler="unigram", sampler_options={"lsh_bits": 3}), "'lsh_bits' belongs to lsh"),
        (dict(sampler_options={"mix_weight": 0.1}), "Set mix_weight as MidxConfig field"),
        (dict(estimator="biased"), "estimator must be one of"),
        (dict(exact_head=-1), "exact_head must be an integer >= 0"),
        (dict(exact_head="max"), "exact_head must be 'auto' or an integer >= 0"),
        (dict(mix_weight=1.0), r"mix_weight must be a number in \[0, 1\)"),
        (dict(mix_weight="half"), "mix_weight must be a number"),
        (dict(mix_static="zipf"), "mix_static must be one of"),
        (dict(last_stage="softmax"), "last_stage must be one of"),
        # Saved in midx_config.json: a NumPy float32 would fail at the first checkpoint, NaN later as a NaN loss.
        (dict(sampler="unigram", sampler_options={"unigram_power": np.float32(0.75)}),
         r"sampler_options\['unigram_power'\] must be a finite number or a string, got .*float32"),
        (dict(sampler="unigram", sampler_options={"unigram_power": float("nan")}),
         r"sampler_options\['unigram_power'\] must be a finite number"),
    ],
)
def test_invalid_values_raise_value_error(changes, message):
    with pytest.raises(ValueError, match=message):
        MidxConfig(**changes)


def test_learned_codebooks_with_midx_samplers():
    for name in SAMPLERS:
        if name.startswith("midx"):
            assert MidxConfig(sampler=name, codebooks="learned").codebooks == "learned"


def test_integer_floats_are_accepted():
    config = MidxConfig(codebook_learning_rate=1, kl_weight=0)
    assert isinstance(config.codebook_learning_rate, float) and isinstance(config.kl_weight, float)


def test_replace_validates_and_names_unknown_fields():
    config = MidxConfig()
    assert config.replace(num_samples=7).num_samples == 7 and config.num_samples == 20
    with pytest.raises(ValueError, match=r"Unknown MidxConfig field\(s\) \['num_sample'\]"):
        config.replace(num_sample=7)
    with pytest.raises(ValueError, match="num_samples"):
        config.replace(num_samples=0)


def test_sampler_kwargs_build_a_sampler():
    config = MidxConfig(
        sampler="midx-exact", codebook_size=4, kmeans_iters=3, seed=5, sampler_options={"quantizer": "pq"}
    )
    kwargs = config.sampler_kwargs()
    assert kwargs == {"codebook_size": 4, "seed": 5, "kmeans_iters": 3, "kmeans_backend": "torch", "quantizer": "pq"}
    assert set(kwargs) - {"codebook_size", "seed"} <= set(SAMPLER_OPTIONS)
    sampler = build_sampler("midx-exact", torch.randn(50, 8), **kwargs)
    assert sampler.quantizer == "pq" and sampler.index.codebook_size == 4


def test_sampler_kwargs_pass_each_sampler_only_its_own_options():
    """The option fields reach only the samplers whose option table lists them; every registered sampler
    builds from a default config's kwargs (no option of another sampler is passed)."""
    midx = MidxConfig(mix_weight=0.25, mix_static="uniform", last_stage="frequency").sampler_kwargs()
    assert midx["mix_weight"] == 0.25 and midx["mix_static"] == "uniform" and midx["last_stage"] == "frequency"
    counts = torch.arange(50) % 7
    for name in SAMPLERS:
        kwargs = MidxConfig(sampler=name, codebook_size=4).sampler_kwargs()
        assert set(kwargs) - {"codebook_size", "seed"} <= set(SAMPLERS[name].options)
        build_sampler(name, torch.randn(50, 8), class_counts=counts, **kwargs)
    assert "mix_weight" not in MidxConfig(sampler="unigram").sampler_kwargs()


def test_dict_round_trip():
    config = MidxConfig(sampler="lsh", num_samples=10, negatives="shared", sampler_options={"lsh_bits": 3}, seed=4)
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert MidxConfig.from_dict(data) == config
    data["sampler_options"]["lsh_bits"] = 5  # a copy, not the config's own dict
    assert config.sampler_options == {"lsh_bits": 3}


def test_from_dict_warns_about_unknown_keys():
    with pytest.warns(UserWarning, match=r"unknown MidxConfig key\(s\) \['future_option'\]"):
        config = MidxConfig.from_dict({"num_samples": 5, "future_option": 1, "hf_midx_version": "9.9"})
    assert config.num_samples == 5
    with pytest.raises(ValueError, match="from a dict"):
        MidxConfig.from_dict([("num_samples", 5)])


def test_json_file_round_trip(tmp_path):
    config = MidxConfig(sampler="midx-pq", num_samples=33, codebooks="learned", kl_queries=8, log_kl=False)
    path = config.save_pretrained(tmp_path / "run")
    assert path == os.path.join(str(tmp_path / "run"), CONFIG_NAME)
    assert sorted(os.listdir(tmp_path / "run")) == [CONFIG_NAME]  # no temporary file left behind
    with open(path) as f:
        data = json.load(f)
    assert data["hf_midx_version"] == __version__ and data["num_samples"] == 33
    assert MidxConfig.from_pretrained(tmp_path / "run") == config
    assert MidxConfig.from_pretrained(path) == config  # the file itself
    # overwriting replaces the file
    MidxConfig(num_samples=9).save_pretrained(tmp_path / "run")
    assert MidxConfig.from_pretrained(tmp_path / "run").num_samples == 9


def test_saved_config_records_what_auto_became_and_loads_as_auto(tmp_path):
    """``chosen`` (what training made of the "auto" fields) is written beside the fields, for the reader; loading
    leaves it out: a run from the saved config chooses again."""
    config = MidxConfig(num_samples=7)
    config.save_pretrained(tmp_path, chosen={"refresh_every_steps": 50})
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["chosen"] == {"refresh_every_steps": 50} and data["refresh_every_steps"] == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MidxConfig.from_pretrained(tmp_path) == config
    config.save_pretrained(tmp_path)
    assert "chosen" not in json.loads((tmp_path / CONFIG_NAME).read_text())
    for chosen in ({"refresh_every_steps": 2.5}, {"num_samples": 3}, {"no_such_field": 1}):
        with pytest.raises(ValueError, match="chosen maps fields set to 'auto'"):
            config.save_pretrained(tmp_path / "bad", chosen=chosen)
    with pytest.raises(ValueError, match="chosen maps"):
        MidxConfig(refresh_every_steps=100).save_pretrained(tmp_path / "bad", chosen={"refresh_every_steps": 50})
    assert not (tmp_path / "bad").exists()  # refused before anything is written


def test_save_pretrained_refuses_a_file(tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("x")
    with pytest.raises(ValueError, match="needs a directory"):
        MidxConfig().save_pretrained(file)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ValueError, match=f"No {CONFIG_NAME} in"):
        MidxConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither a local directory"):
        MidxConfig.from_pretrained(tmp_path / "does-not-exist")
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        MidxConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="Cannot read|not valid JSON"):
        MidxConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        MidxConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_samples": -4}))
    with pytest.raises(ValueError, match="Invalid MidxConfig in .*num_samples must be an integer >= 1"):
        MidxConfig.from_pretrained(tmp_path)


def test_lazy_export():
    import hf_midx

    assert hf_midx.MidxConfig is MidxConfig


def test_for_vocabulary_lowers_exact_head_to_a_eighth_of_v_and_warns_for_a_set_value():
    import warnings

    assert MidxConfig().for_vocabulary(100_000) == MidxConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MidxConfig().for_vocabulary(300).exact_head == "auto"  # chosen within V/8 by the head, from counts
    with pytest.warns(UserWarning, match=r"exact_head=2048 is more than V/8 = 37"):  # today's old default, by hand
        assert MidxConfig(exact_head=2048).for_vocabulary(300).exact_head == 37
    with pytest.warns(UserWarning, match=r"exact_head=999999 is more than V/8 = 125 .*using exact_head=125"):
        used = MidxConfig(exact_head=999999).for_vocabulary(1000)
    assert used.exact_head == 125 and used.replace(exact_head=999999) == MidxConfig(exact_head=999999)
    with pytest.raises(ValueError, match="num_classes"):
        MidxConfig().for_vocabulary(0)


def test_model_card_shows_the_exact_head_in_use():
    from hf_midx.integration.model_card import midx_training_facts

    assert midx_training_facts(MidxConfig(exact_head=999999), num_classes=1000)["exact_head"] == 125
    assert midx_training_facts(MidxConfig(exact_head=64), num_classes=1000)["exact_head"] == 64


def test_model_card_shows_what_each_sampler_uses():
    """midx-exact draws from the exact softmax: no mixture, no last stage, and its own quantizer option."""
    from hf_midx.integration.model_card import midx_training_facts

    exact = midx_training_facts(MidxConfig(sampler="midx-exact", sampler_options={"quantizer": "pq"}))
    assert (exact["mixture_text"], exact["quantizer"], exact["last_stage"]) == ("none", "product (pq)",
                                                                                "exact (Theorem 1)")  # fmt: skip
    default = midx_training_facts(MidxConfig())
    assert (default["mixture_text"], default["quantizer"], default["last_stage"]) == (
        "0.5 x unigram + 0.5 x MIDX", "residual (rq)", "centered")
    assert midx_training_facts(MidxConfig(), [{"eval_loss": float("nan")}])["eval_perplexity"] == "nan"  # not "inf"


def test_log_probs_is_checked_and_exact_forward_needs_per_query_negatives():
    with pytest.raises(ValueError, match="log_probs must be one of"):
        MidxConfig(log_probs="estimated")
    with pytest.raises(ValueError, match="negatives='per-query'"):
        MidxConfig(log_probs="exact-forward", negatives="shared")
    assert MidxConfig(log_probs="exact-forward").num_samples == 20


def test_the_papers_text_estimator_without_an_exact_head_warns_once_at_the_caller():
    """Issue 73: estimator="exact-positive" with exact_head=0 (the paper's text, not its code) trains markedly worse:
    warned, naming the fix, at the line that builds the config; with an exact head (or the default estimator) not."""
    with pytest.warns(UserWarning, match="corrected-positive") as caught:
        MidxConfig(estimator="exact-positive", exact_head=0)
    assert len(caught) == 1 and caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MidxConfig(estimator="exact-positive", exact_head=64)
        MidxConfig(exact_head=0)
