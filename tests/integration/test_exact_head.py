"""The head's side of issue 9: class counts for the default proposal, and the exact head.

``hf_midx.wrap(model, MidxConfig())`` without ``class_counts`` must still train, with a warning that
says what the default gives up; with counts, ``exact_head=H`` scores the H most frequent classes exactly
and the sampler never draws them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _models import VOCAB, markov_batches, tiny_model
import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head


def _counts() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (1000.0 / (torch.randperm(VOCAB, generator=g).double() + 1.0)).floor()


def _train_steps(model, steps: int = 3) -> list[float]:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in markov_batches(VOCAB, 4, 12, steps):
        opt.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_default_config_without_counts_warns_and_trains():
    model = tiny_model("gpt2")
    with pytest.warns(UserWarning, match="needs? class_counts"):
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16, exact_head=0))
    head = find_head(model)
    assert head.sampler.mix_weight == 0.0 and head.exact_ids is None  # both need counts
    assert all(torch.isfinite(torch.tensor(_train_steps(model))))


def test_default_config_with_counts_builds_the_unigram_mixture_silently():
    model = tiny_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16), class_counts=_counts())
    head = find_head(model)
    assert head.sampler.mix_static == "unigram" and head.sampler.mix_weight == MidxConfig().mix_weight


def test_all_zero_counts_warn_once_and_say_the_fix():
    """Zero counts (e.g. token_counts of labels that are all -100) tie every class: the exact head and the unigram
    mixture they set mean nothing; wrap says so once (was silent)."""
    model = tiny_model("gpt2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16), class_counts=torch.zeros(VOCAB))
    said = [str(w.message) for w in caught if "class_counts are all zero" in str(w.message)]
    assert len(said) == 1 and f"hf_midx.token_counts(ids, {VOCAB})" in said[0]


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_exact_head_takes_the_most_frequent_classes_out_of_the_proposal(negatives):
    model = tiny_model("llama")
    counts = _counts()
    config = MidxConfig(codebook_size=8, num_samples=16, exact_head=40, negatives=negatives)
    hf_midx.wrap(model, config, class_counts=counts)
    head = find_head(model)
    top = torch.sort(torch.argsort(counts, descending=True, stable=True)[:40]).values
    assert torch.equal(head.exact_ids, top) and torch.equal(head.sampler.excluded, top)
    assert head.sampler.index.num_classes == VOCAB - 40
    losses = _train_steps(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    head.refresh()
    assert torch.equal(head.sampler.excluded, top)


def test_exact_head_without_counts_is_off_with_a_warning():
    model = tiny_model("gpt2")
    with pytest.warns(UserWarning, match="exact_head=40 needs class_counts"):
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16, exact_head=40, mix_weight=0.0))
    head = find_head(model)
    assert head.exact_ids is None and head.sampler.excluded is None
    assert head.config.exact_head == 0  # what midx_config.json and the model card then say


def test_without_counts_the_config_in_use_has_no_head_no_mixture_and_a_uniform_last_stage():
    from hf_midx.integration.model_card import midx_training_facts

    model = tiny_model("gpt2")
    with pytest.warns(UserWarning):
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16, last_stage="frequency"))
    config = find_head(model).config
    assert (config.exact_head, config.mix_weight, config.last_stage) == (0, 0.0, "uniform")
    facts = midx_training_facts(config, num_classes=VOCAB)
    assert (facts["exact_head"], facts["mixture_text"], facts["last_stage"]) == (0, "none", "uniform")


@pytest.mark.parametrize("sampler", ["uniform", "sphere", "lsh", "midx-rq"])
def test_counts_are_checked_for_the_exact_head_whatever_the_sampler(sampler):
    for bad in (torch.full((VOCAB,), float("nan")), -torch.ones(VOCAB), torch.ones(VOCAB // 2, 2)):
        model = tiny_model("gpt2")
        with pytest.raises(ValueError, match="class_counts must"):
            hf_midx.wrap(model, MidxConfig(sampler=sampler, codebook_size=8, exact_head=8), class_counts=bad)
        assert find_head(model) is None


def test_a_verification_that_fails_with_any_error_leaves_the_model_unwrapped(monkeypatch):
    import importlib

    wrap_module = importlib.import_module("hf_midx.integration.wrap")

    def out_of_memory(binding):
        raise RuntimeError("CUDA out of memory")

    model = tiny_model("gpt2")
    with monkeypatch.context() as patch:
        patch.setattr(wrap_module, "_verify", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            wrap_module.wrap(model, MidxConfig(codebook_size=8, num_samples=16))
    assert find_head(model) is None and type(model.get_output_embeddings()) is torch.nn.Linear
    wrap_module.wrap(model, MidxConfig(codebook_size=8, num_samples=16))  # not "already wrapped"
    assert find_head(model) is not None


def test_exact_head_is_at_most_an_eighth_of_the_vocabulary():
    model = tiny_model("gpt2")
    hf_midx.wrap(model, MidxConfig(codebook_size=8, exact_head=VOCAB), class_counts=_counts())
    assert find_head(model).exact_ids.numel() == VOCAB // 8


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_exact_head_and_mixture_add_no_host_sync(negatives):
    from test_hot_path import _count_step

    batch = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _count_step(tiny_model("llama"), batch)
    model = tiny_model("llama")
    config = MidxConfig(codebook_size=8, num_samples=16, exact_head=40, last_stage="frequency", negatives=negatives)
    hf_midx.wrap(model, config, class_counts=_counts())
    extra = _count_step(model, batch) - plain
    assert not extra, dict(extra)


def test_choose_exact_head_takes_the_fewest_classes_holding_the_share_within_its_bounds():
    from hf_midx.losses.exact_head import choose_exact_head

    counts = torch.zeros(80, dtype=torch.float64)
    counts[[7, 3, 50, 1, 2]] = torch.tensor([50.0, 30.0, 10.0, 5.0, 5.0], dtype=torch.float64)
    assert choose_exact_head(counts, 80, share=0.8, most=100) == (2, pytest.approx(0.8))
    assert choose_exact_head(counts, 80, share=0.81, most=100) == (3, pytest.approx(0.9))
    assert choose_exact_head(counts, 80, share=0.99, most=4) == (4, pytest.approx(0.95))  # the cost bound
    assert choose_exact_head(counts[:16], 16, share=0.99, most=100)[0] == 2  # V/8
    assert choose_exact_head(torch.zeros(80), 80, share=0.8, most=100) == (0, 0.0)


def test_auto_exact_head_is_chosen_from_the_counts_logged_once_and_saved(tmp_path, caplog):
    from hf_midx.defaults import EXACT_HEAD_SHARE
    from hf_midx.integration.model_card import midx_training_facts

    model, counts = tiny_model("llama"), _counts()
    with caplog.at_level("INFO", logger="hf_midx"):
        hf_midx.wrap(model, MidxConfig(codebook_size=8, num_samples=16), class_counts=counts)
    head = find_head(model)
    h = head.config.exact_head
    held = torch.sort(counts, descending=True).values.cumsum(0) / counts.sum()
    # The fewest classes holding the share, unless V/8 binds (VOCAB // 8 here).
    assert h == min(int((held < EXACT_HEAD_SHARE).sum()) + 1, VOCAB // 8) and head.exact_ids.numel() == h
    lines = [r.getMessage() for r in caplog.records if "exact_head='auto'" in r.getMessage()]
    assert len(lines) == 1 and f"H = {h} " in lines[0], lines
    head.config.save_pretrained(tmp_path)
    assert MidxConfig.from_pretrained(tmp_path).exact_head == h
    assert midx_training_facts(head.config, num_classes=VOCAB)["exact_head"] == h
