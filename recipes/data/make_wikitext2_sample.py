"""Rebuild recipes/data/wikitext2_sample/ from a full word-level WikiText-2 (v1) copy.

    python recipes/data/make_wikitext2_sample.py /path/to/wikitext-2

The source directory holds train.txt, valid.txt and test.txt (one paragraph per line, rare words
already <unk>). The sample keeps the first whole articles of each split (up to the first article
heading at or after line 3,000 of train and 300 of valid/test) and replaces every valid/test word that
does not occur in the sampled train split by <unk>, so the sample is a closed vocabulary like the
original. The result is deterministic.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

LINES = {"train": 3000, "valid": 300, "test": 300}
ARTICLE = re.compile(r"^ = [^=].* = $")  # " = Title = " starts an article; " = = Section = = " does not
UNK = "<unk>"


def first_articles(lines: list[str], at_least: int) -> list[str]:
    """The lines before the first article heading at or after line ``at_least`` (all lines if none)."""
    for i in range(at_least, len(lines)):
        if ARTICLE.match(lines[i]):
            return lines[:i]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="directory with the full train.txt, valid.txt and test.txt")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "wikitext2_sample")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab: set[str] = set()
    for split, at_least in LINES.items():
        lines = (args.source / f"{split}.txt").read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        lines = first_articles(lines, at_least)
        if split == "train":
            vocab = {word for line in lines for word in line.split()}
        else:
            lines = [" ".join(w if not w or w in vocab else UNK for w in line.split(" ")) for line in lines]
        (args.out / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{split}: {len(lines)} lines, {sum(len(line.split()) for line in lines)} words")


if __name__ == "__main__":
    main()
