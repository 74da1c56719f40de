"""Question/answer pairs of the PyPI package ``chatterbot-corpus`` as a retrieval task.

The package ships YAML files (``chatterbot_corpus/data/<language>/*.yml``) with
``conversations: [[question, answer, ...], ...]``; a question may appear in several
conversations with different answers. :func:`chatterbot_retrieval_split` groups the pairs by
question, holds out a seeded fraction of the *questions*, and returns

- ``train``: one :class:`RetrievalExample` per training question, ``pos`` = all its answers,
- ``queries`` / ``relevant``: the held-out questions and, for each, the corpus indices of its
  answers,
- ``corpus``: every distinct answer of the whole corpus (training and held-out questions alike),

so held-out questions retrieve their answer among all answers. Conversations that are not a list
of at least two strings are skipped, counted and reported (never silently).
"""

from __future__ import annotations

import glob
import os
import random
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from ds_infcl.data.retrieval import MalformedTally, RetrievalExample

__all__ = ["chatterbot_dir", "load_chatterbot_pairs", "ChatterbotSplit", "chatterbot_retrieval_split"]


def chatterbot_dir(language: str = "english") -> str:
    """The folder of the installed package's YAML files for ``language``."""
    try:
        import chatterbot_corpus
    except ImportError:
        raise ImportError("the chatterbot demo needs `pip install chatterbot-corpus pyyaml`") from None
    path = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", language)
    if not os.path.isdir(path):
        langs = sorted(os.listdir(os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data")))
        raise ValueError(f"no chatterbot corpus for language {language!r}; available: {langs}")
    return path


def load_chatterbot_pairs(
    language: str = "english", tally: Optional[MalformedTally] = None
) -> List[Tuple[str, str]]:
    """``(question, answer)`` pairs: the first two turns of every conversation, whitespace
    stripped, in file order (files sorted by name)."""
    import yaml

    tally = tally if tally is not None else MalformedTally()
    pairs: List[Tuple[str, str]] = []
    for path in sorted(glob.glob(os.path.join(chatterbot_dir(language), "*.yml"))):
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        for n, conv in enumerate(data.get("conversations") or []):
            if (not isinstance(conv, list) or len(conv) < 2 or not all(isinstance(t, str) for t in conv[:2])
                    or not conv[0].strip() or not conv[1].strip()):
                tally.add("not a [question, answer, ...] list of strings", f"{path}:conversation {n}")
                warnings.warn(f"skipping malformed chatterbot conversation {path}:conversation {n}", stacklevel=2)
                continue
            pairs.append((conv[0].strip(), conv[1].strip()))
    return pairs


@dataclass
class ChatterbotSplit:
    train: List[RetrievalExample]
    queries: List[str]
    relevant: List[Set[int]]
    corpus: List[str]
    num_pairs: int
    num_skipped: int


def chatterbot_retrieval_split(
    language: str = "english", heldout_fraction: float = 0.2, seed: int = 0
) -> ChatterbotSplit:
    """Split the pairs by question (see the module docstring)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    tally = MalformedTally()
    pairs = load_chatterbot_pairs(language, tally)
    answers_of: Dict[str, List[str]] = {}
    for q, a in pairs:
        lst = answers_of.setdefault(q, [])
        if a not in lst:
            lst.append(a)
    questions = list(answers_of)
    random.Random(seed).shuffle(questions)
    num_heldout = max(1, int(round(heldout_fraction * len(questions))))
    heldout, train_q = questions[:num_heldout], sorted(questions[num_heldout:])
    corpus = sorted({a for answers in answers_of.values() for a in answers})
    index = {a: i for i, a in enumerate(corpus)}
    train = [RetrievalExample(q, list(answers_of[q]), [], i) for i, q in enumerate(train_q)]
    heldout = sorted(heldout)
    relevant = [{index[a] for a in answers_of[q]} for q in heldout]
    return ChatterbotSplit(train, heldout, relevant, corpus, len(pairs), tally.total)
