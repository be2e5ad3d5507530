"""Word-level language-model data for the recipes: text files, the WordLevel tokenizer, token blocks.

The conventions are those of the PyTorch ``word_language_model`` example and AWD-LSTM, which produce
the published WikiText-2 figures (vocabulary 33,278; 2,088,628 / 217,646 / 245,569 tokens):

* every line of a split, blank or not, contributes its whitespace-separated words and one ``<eos>``;
* the tokens of a split are concatenated into one stream of N tokens;
* the stream is cut into blocks of ``seq_len + 1`` tokens that overlap by one token (stride
  ``seq_len``): block i is ``stream[i * seq_len : i * seq_len + seq_len + 1]``. Blocks are used with
  ``labels = input_ids``; a causal LM shifts the labels by one inside its loss, so each block predicts
  its last ``seq_len`` tokens from the tokens before them, and every token of the stream after the first
  is predicted exactly once. The last ``(N - 1) % seq_len`` tokens, which do not fill a block, are
  dropped (fewer than ``seq_len``). All blocks have the same length, so no padding is needed;
* perplexity is exp(sum of token negative log-likelihoods / number of predicted tokens) over all blocks.

The class counts of a stream come from :func:`hf_midx.token_counts` (re-exported here as ``token_counts``,
a plain-PyTorch function); nothing else of hf_midx is used. ``lm_recipe`` builds on this module.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hf_midx.data import token_counts  # noqa: F401  (the recipes' and benchmarks' class counts)

UNK = "<unk>"
EOS = "<eos>"


class DataError(ValueError):
    """Unusable input data; the message is one line that says what to do."""


def read_lines(path: str | os.PathLike, *, what: str = "data file") -> list[str]:
    """The lines of a UTF-8 text file, without line terminators.

    Raises:
        DataError: the file is missing, a directory, unreadable, not UTF-8, or holds no word.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{what} {path!r} does not exist.")
    if os.path.isdir(path):
        raise DataError(f"{what} {path!r} is a directory; give a text file.")
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is not part of a word
            text = f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{what} {path!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    except OSError as err:
        raise DataError(f"{what} {path!r} cannot be read ({err.strerror or err}).") from None
    if not text.split():
        raise DataError(f"{what} {path!r} is empty (no words); give a text file with one or more lines of text.")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the terminator of the last line, not a blank line
    return [line.rstrip("\r") for line in lines]


def build_word_level_tokenizer(lines: Iterable[str]):
    """A word-level ``PreTrainedTokenizerFast`` whose vocabulary is every word of ``lines`` plus ``<eos>``.

    Words are split on whitespace only (``WhitespaceSplit``: "F.C." and "@-@" stay whole), ids are
    ``<unk>`` = 0, ``<eos>`` = 1, then the words by decreasing count (ties alphabetically), so the ids
    are deterministic and dense. Unknown words map to ``<unk>``. ``<eos>`` marks the end of a line in the
    training stream (:func:`encode_lines` puts it there); the tokenizer itself adds nothing, so a prompt
    encodes to its words only and a model generates after them, as with any causal-LM tokenizer.
    ``<eos>`` is also the bos and pad token. Decoding puts a space before every word (:func:`word_level_decoder`).
    ``<unk>`` is a word of the vocabulary (WikiText writes it in its text), not a special token: a generation
    that predicts it shows it ("released in the <unk> .") instead of dropping it, as ``skip_special_tokens``
    (the text-generation pipeline's default) would. The tokenizer's ``unk_token`` is therefore None; the
    WordLevel model still maps unknown words to it. On the full WikiText-2 training split the vocabulary has
    33,278 entries.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts: Counter[str] = Counter()
    for line in lines:
        counts.update(line.split())
    counts.pop(UNK, None)
    counts.pop(EOS, None)
    vocab = {UNK: 0, EOS: 1}
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = word_level_decoder()
    # <eos> is also bos and pad, as in the recipe's model config (GPT-2 does the same with <|endoftext|>): the
    # Trainer then has no special token to align between them. Nothing adds any of them to an encoded text.
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def word_level_decoder():
    """A ``tokenizers`` decoder that writes every word with a space before it (" the city").

    Words split on whitespace carry no space of their own, and text-generation pipelines decode the new
    tokens apart from the prompt and append them to it: with a space in front of each word the
    continuation reads "the city is" rather than "the cityis". (WikiText's lines also begin with a space.)
    """
    from tokenizers import Regex, decoders

    return decoders.Replace(Regex("^"), " ")


def encode_lines(tokenizer, lines: Sequence[str]) -> torch.Tensor:
    """One int64 stream: each line's token ids followed by the tokenizer's end-of-sequence id.

    Works with any ``transformers`` tokenizer; the line's own special tokens are not added, the
    end-of-line id is appended explicitly (none if the tokenizer has no ``eos_token``).
    """
    eos = tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        per_line: Iterable[list[int]] = (e.ids for e in backend.encode_batch(list(lines), add_special_tokens=False))
    else:
        per_line = tokenizer(list(lines), add_special_tokens=False)["input_ids"]
    if eos is None:
        flat = (i for ids in per_line for i in ids)
    else:
        flat = (i for ids in per_line for i in (*ids, eos))
    return torch.from_numpy(np.fromiter(flat, dtype=np.int64))


def num_blocks(num_tokens: int, seq_len: int) -> int:
    """Full blocks of ``seq_len + 1`` tokens (stride ``seq_len``) in a stream of ``num_tokens``."""
    return max(0, (num_tokens - 1) // seq_len)


class TokenBlocks(torch.utils.data.Dataset):
    """Equal-length token blocks as ``{"input_ids": (seq_len + 1,) int64}`` items (see the module doc).

    Build with :meth:`from_stream` (overlapping blocks of one stream) or directly from an
    (n, seq_len + 1) tensor of independent blocks (as the synthetic corpus makes them).

    Args:
        blocks: (n, seq_len + 1) integer tensor, seq_len >= 1.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dim() != 2 or blocks.shape[1] < 2:
            raise ValueError(f"blocks must be (n, seq_len + 1) with seq_len >= 1, got shape {tuple(blocks.shape)}.")
        self.data = blocks.to(torch.int64)
        self.seq_len = blocks.shape[1] - 1

    @classmethod
    def from_stream(cls, stream: torch.Tensor, seq_len: int, limit: int | None = None) -> TokenBlocks:
        """Blocks ``stream[i * seq_len : i * seq_len + seq_len + 1]`` of a 1-D stream (a view, no copy).

        ``limit`` keeps at most that many blocks (the first ones).
        """
        if stream.dim() != 1:
            raise ValueError(f"stream must be 1-D, got shape {tuple(stream.shape)}.")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        count = num_blocks(stream.numel(), seq_len)
        if limit is not None:
            count = min(count, limit)
        stream = stream.to(torch.int64)
        if count == 0:
            return cls(stream.new_zeros((0, seq_len + 1)))
        return cls(stream[: count * seq_len + 1].unfold(0, seq_len + 1, seq_len))

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i]}

    @property
    def num_predicted_tokens(self) -> int:
        """Tokens whose probability the blocks score: ``seq_len`` per block."""
        return len(self) * self.seq_len

    @property
    def num_input_tokens(self) -> int:
        """Tokens the model reads: ``seq_len + 1`` per block."""
        return len(self) * (self.seq_len + 1)


def collate_blocks(features: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length blocks; ``labels`` are the ``input_ids`` (the model shifts them).

    The all-ones ``attention_mask`` says there is no padding (``<eos>`` doubles as the pad token).
    """
    input_ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
