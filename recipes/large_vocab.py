#!/usr/bin/env python
"""Train on a synthetic large-vocabulary corpus whose optimal perplexity is known, with MIDX or the full softmax.

    python recipes/large_vocab.py --output_dir runs/large_vocab --vocab_size 100000
    accelerate launch recipes/large_vocab.py --vocab_size 262144 --max_steps 2000

The corpus comes from a first-order Markov chain over ``--vocab_size`` words with Zipfian word
frequencies and clustered next-word structure (synthetic.py). The chain's entropy rate H is computed
exactly, so exp(H), the best perplexity any model can reach, is reported beside the achieved one, with
the chain's own perplexity on the test blocks (should be close to exp(H)) and the best context-free
(unigram) perplexity. Every block is an independent stationary run of seq_len + 1 words. The model and
Trainer flags are those of wikitext2.py; the MIDX settings are the library's defaults (MidxConfig()): the index
is rebuilt when the measured cost allows (``refresh_every_steps="auto"``), so the one epoch of a default run does
not keep the index of the random initial weights.

The defaults make a learning curve that fits a 2-core CPU: 16,000,000 fresh training tokens seen once each
(10,000 steps of 32 x 50 tokens; a corpus of 500k tokens overfits after about 900 steps at V = 100,000),
the paper's GPT-2 narrowed to n_embd 128 and n_inner 512 when training from scratch, validation on 10,000
tokens every 500 steps, and a test split of 100,000 tokens scored once at the end. At V = 100,000 a default
run (M = 20, K = 32) takes about 40 minutes on one core of this 2-core CPU and reaches about 1.3x the optimal
perplexity; by then the adaptive proposal trains better than unigram sampling with the same exact head, which
it ties at half the length (README, "Performance"). The full softmax runs about 6x slower per token (on a
GPU: recipes/benchmarks/gpu_large_vocab.sh).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hf_midx import token_counts

if __package__:  # python -m recipes.large_vocab, or imported (the tests, the benchmarks)
    from . import lm_args, lm_data, lm_recipe, synthetic
else:  # python / torchrun / accelerate launch recipes/large_vocab.py: this folder is first on sys.path
    import lm_args
    import lm_data
    import lm_recipe
    import synthetic


#: From-scratch model of the recipe (GPT-2 overrides; without --config_overrides or --model_name_or_path).
SYNTHETIC_MODEL = "n_embd=128,n_inner=512"


@dataclass
class SyntheticArguments:
    """The synthetic corpus (see synthetic.py) and its blocks."""

    vocab_size: int = field(default=100_000, metadata={"help": "V, the number of words (e.g. 100000 to 1000000)."})
    zipf_exponent: float = field(default=1.0, metadata={"help": "s of the word frequencies, proportional to rank^-s."})
    num_clusters: int | None = field(
        default=None, metadata={"help": "Word clusters that decide the next word's cluster (default: round(sqrt(V)))."}
    )
    successors: int = field(default=8, metadata={"help": "Random links per cluster in the cluster transition graph."})
    corpus_seed: int = field(default=0, metadata={"help": "Seed of the chain and of the sampled text."})
    seq_len: int = field(default=50, metadata={"help": "Tokens predicted per block (blocks hold seq_len + 1 words)."})
    train_tokens: int = field(
        default=16_000_000,
        metadata={"help": "Predicted tokens in the training blocks (the default run sees each once)."},
    )
    eval_tokens: int = field(
        default=10_000, metadata={"help": "Predicted tokens in the validation blocks (scored at every evaluation)."}
    )
    test_tokens: int = field(
        default=100_000,
        metadata={
            "help": "Predicted tokens in the test blocks (scored once, at the end). 10,000 could not tell apart "
            "runs a few tenths of a percent apart (a difference moved by 0.4 points between two test samples); "
            "100,000 give a paired difference to about 0.2 points either way (95 percent interval)."
        },
    )


def word_tokenizer(vocab_size: int):
    """A tokenizer for the synthetic words ``w0 .. w{V-1}`` (id = frequency rank), saved with the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = lm_data.word_level_decoder()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def main(argv: Sequence[str] | None = None) -> dict:
    started = time.perf_counter()
    MidxArguments = lm_args.midx_arguments()  # the library's defaults
    defaults = {
        **lm_args.recipe_training_defaults("runs/large_vocab"),
        "max_steps": 10_000,
        "logging_steps": 250,
        "eval_strategy": "steps",
        "eval_steps": 500,
        "save_strategy": "steps",
        "save_steps": 500,
    }
    model_args, syn, midx_args, output_args, training_args = lm_args.parse_arguments(
        [lm_recipe.ModelArguments, SyntheticArguments, MidxArguments, lm_args.OutputArguments],
        defaults,
        argv,
        doc=__doc__,
    )
    lm_args.setup_logging(training_args)
    lm_args.warn_single_process_launch()
    if model_args.model_name_or_path is None and model_args.config_overrides is None:
        model_args.config_overrides = SYNTHETIC_MODEL
    lm_args.check_model_arguments(model_args)
    for name in ("seq_len", "train_tokens", "eval_tokens", "test_tokens"):
        if getattr(syn, name) < 1:
            raise lm_args.RecipeError(f"--{name} must be >= 1, got {getattr(syn, name)}.")
    try:
        chain = synthetic.ZipfMarkovChain(
            syn.vocab_size, syn.zipf_exponent, syn.num_clusters, syn.successors, syn.corpus_seed
        )
    except ValueError as err:
        raise lm_args.RecipeError(str(err)) from None
    midx_config = lm_args.midx_config_from(midx_args, training_args.seed)
    resume = lm_args.check_output_and_resume(training_args, overwrite=output_args.overwrite_output_dir)
    lm_args.check_push(training_args)
    lm_args.check_reporting(training_args)

    length = syn.seq_len + 1
    splits = {}
    for i, (name, tokens) in enumerate(
        (("train", syn.train_tokens), ("valid", syn.eval_tokens), ("test", syn.test_tokens))
    ):
        blocks = chain.sample_blocks(math.ceil(tokens / syn.seq_len), length, seed=[syn.corpus_seed, i])
        splits[name] = lm_data.TokenBlocks(torch.from_numpy(blocks))
    entropy_rate = chain.entropy_rate()
    oracle_nll = float(-chain.log_prob(splits["test"].data.numpy()).mean())
    counts = token_counts(splits["train"].data, syn.vocab_size)
    facts = {
        "vocab_size": syn.vocab_size,
        "zipf_exponent": syn.zipf_exponent,
        "num_clusters": chain.num_clusters,
        "successors": syn.successors,
        "corpus_seed": syn.corpus_seed,
        "entropy_rate_nats": entropy_rate,
        "entropy_rate_perplexity": math.exp(entropy_rate),
        "oracle_test_perplexity": math.exp(oracle_nll),
        "unigram_perplexity": math.exp(chain.unigram_entropy()),
        "distinct_train_words": int((counts > 0).sum()),
    }
    data = lm_recipe.PreparedData(
        train=splits["train"],
        valid=splits["valid"],
        test=splits["test"],
        vocab_size=syn.vocab_size,
        class_counts=counts,
        tokenizer=word_tokenizer(syn.vocab_size),
        description=(
            f"synthetic Zipf-Markov corpus (V={syn.vocab_size}, s={syn.zipf_exponent}, {chain.num_clusters} clusters, "
            f"optimal perplexity {math.exp(entropy_rate):.2f})"
        ),
        card={
            "dataset": f"synthetic Zipf-Markov corpus, V={syn.vocab_size}",
            "tags": ["synthetic", "large-vocabulary"],
        },
        extra={"synthetic": facts, "optimal_perplexity": math.exp(entropy_rate)},
    )
    results = lm_recipe.train_and_report(
        "large_vocab",
        model_args,
        midx_config,
        training_args,
        data,
        seq_len=syn.seq_len,
        resume=resume,
        overwrite=output_args.overwrite_output_dir,
        started=started,
        argv=argv,
    )
    if training_args.process_index == 0:
        lm_recipe.logger.info(
            "large_vocab: optimal (entropy-rate) perplexity %.3f, true chain on the test blocks %.3f, achieved test "
            "perplexity %.3f, best context-free (unigram) %.1f",
            facts["entropy_rate_perplexity"],
            facts["oracle_test_perplexity"],
            results["test_perplexity"],
            facts["unigram_perplexity"],
        )
    return results


if __name__ == "__main__":
    lm_recipe.run(main)
