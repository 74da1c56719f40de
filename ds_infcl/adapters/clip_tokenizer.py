"""Caption tokenizer for the text tower: trained on captions or loaded from disk, never a hub.

A thin wrapper around a ``tokenizers.Tokenizer`` (the fast tokenizer library of Hugging Face)
that adds the CLIP conventions: ``[BOS] tokens [EOS]``, truncation that keeps ``[EOS]``, padding
to ``context_length``, and the ids the text tower needs (``pad_token_id``, ``eos_token_id``).

Example::

    tok = CaptionTokenizer.train(captions, kind="wordlevel", context_length=16)
    batch = tok(["a handwritten 7", "the digit seven"])   # input_ids, attention_mask [2, 16]
    tok.save("runs/clip")                                  # tokenizer.json + tokenizer_config.json
    tok = CaptionTokenizer.load("runs/clip")

``load`` also reads the ``tokenizer.json`` of a local Hugging Face checkpoint folder (CLIP's own
BPE tokenizer included); give the special tokens if they are not the defaults.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Optional, Sequence

import torch

__all__ = ["CaptionTokenizer", "TOKENIZER_KINDS"]

TOKENIZER_KINDS = ("wordlevel", "bpe")
CONFIG_NAME = "tokenizer_config.json"
TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}
# Special-token names of CLIP's own tokenizer, tried when loading a checkpoint folder.
_CLIP_SPECIAL_TOKENS = {"pad": "<|endoftext|>", "unk": "<|endoftext|>", "bos": "<|startoftext|>", "eos": "<|endoftext|>"}


class CaptionTokenizer:
    """Tokenizes captions into fixed-length ``input_ids`` and ``attention_mask``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` whose post-processor adds ``[BOS]`` and ``[EOS]``.
        context_length: length of every output row (truncated or padded).
        special_tokens: ``{"pad", "unk", "bos", "eos"} -> token string``.

    Call: ``tok(texts) -> {"input_ids": int64 [n, L], "attention_mask": int64 [n, L]}``.
    """

    def __init__(self, tokenizer, context_length: int, special_tokens: Optional[Dict[str, str]] = None):
        if context_length < 3:
            raise ValueError(f"context_length must be >= 3 (bos, a token, eos), got {context_length}")
        self.tokenizer = tokenizer
        self.context_length = int(context_length)
        self.special_tokens = dict(special_tokens or SPECIAL_TOKENS)
        ids = {}
        for name, token in self.special_tokens.items():
            ids[name] = tokenizer.token_to_id(token)
            if ids[name] is None:
                raise ValueError(f"special token {name}={token!r} is not in the vocabulary")
        self.pad_token_id, self.eos_token_id, self.bos_token_id = ids["pad"], ids["eos"], ids["bos"]
        tokenizer.enable_truncation(max_length=self.context_length)
        tokenizer.enable_padding(
            length=self.context_length, pad_id=self.pad_token_id, pad_token=self.special_tokens["pad"]
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, texts: Sequence[str]) -> Dict[str, torch.Tensor]:
        if isinstance(texts, str):
            texts = [texts]
        encodings = self.tokenizer.encode_batch(list(texts))
        input_ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)
        attention_mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)
        # Truncation can cut the [EOS] that the text tower pools at: put it back.
        last = attention_mask.sum(dim=1) - 1
        rows = torch.arange(len(encodings))
        input_ids[rows, last] = self.eos_token_id
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- building ---------------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        kind: str = "wordlevel",
        context_length: int = 77,
        vocab_size: int = 8192,
        min_frequency: int = 1,
        lowercase: bool = True,
    ) -> "CaptionTokenizer":
        """Train a tokenizer on ``texts`` with the ``tokenizers`` library.

        Args:
            kind: ``"wordlevel"`` (whole words and punctuation; right for a small closed
                vocabulary) or ``"bpe"`` (byte-pair merges over words).
            context_length: tokens per caption including ``[BOS]`` and ``[EOS]``.
            vocab_size: maximum vocabulary size, special tokens included.
            min_frequency: a word or merge seen fewer times is left out.
            lowercase: lowercase and strip accents before splitting.
        """
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

        if kind not in TOKENIZER_KINDS:
            raise ValueError(f"kind must be one of {TOKENIZER_KINDS}, got {kind!r}")
        specials = [SPECIAL_TOKENS[k] for k in ("pad", "unk", "bos", "eos")]
        if kind == "wordlevel":
            tokenizer = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS["unk"]))
            trainer = trainers.WordLevelTrainer(
                vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials
            )
        else:
            tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk"]))
            trainer = trainers.BpeTrainer(
                vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials
            )
        steps = [normalizers.NFD(), normalizers.StripAccents()]
        if lowercase:
            steps.insert(0, normalizers.Lowercase())
        tokenizer.normalizer = normalizers.Sequence(steps)
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.train_from_iterator(list(texts), trainer=trainer)
        bos, eos = SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}",
            special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))],
        )
        return cls(tokenizer, context_length)

    # -- disk -------------------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (context length, special tokens)."""
        os.makedirs(folder, exist_ok=True)
        tok = self.tokenizer
        # Save without the fixed padding/truncation: they live in our config.
        tok.no_padding()
        tok.no_truncation()
        try:
            tok.save(os.path.join(folder, TOKENIZER_NAME))
        finally:
            tok.enable_truncation(max_length=self.context_length)
            tok.enable_padding(
                length=self.context_length, pad_id=self.pad_token_id, pad_token=self.special_tokens["pad"]
            )
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            json.dump(
                {"context_length": self.context_length, "special_tokens": self.special_tokens,
                 "ds_infcl": "CaptionTokenizer"},
                f, indent=1,
            )

    @classmethod
    def load(
        cls,
        folder: str,
        *,
        context_length: Optional[int] = None,
        special_tokens: Optional[Dict[str, str]] = None,
    ) -> "CaptionTokenizer":
        """Load from a folder with ``tokenizer.json`` (ours or a Hugging Face checkpoint's).

        Our ``tokenizer_config.json`` gives the context length and special tokens; for another
        checkpoint, ``context_length`` defaults to its ``model_max_length`` (else 77) and the
        special tokens to ours if present in the vocabulary, else CLIP's.
        """
        from tokenizers import Tokenizer

        path = os.path.join(folder, TOKENIZER_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no {TOKENIZER_NAME} in {folder!r}")
        tokenizer = Tokenizer.from_file(path)
        config = {}
        config_path = os.path.join(folder, CONFIG_NAME)
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        if special_tokens is None:
            special_tokens = config.get("special_tokens") if isinstance(config.get("special_tokens"), dict) else None
        if special_tokens is None:
            vocab = tokenizer.get_vocab(with_added_tokens=True)
            special_tokens = SPECIAL_TOKENS if SPECIAL_TOKENS["eos"] in vocab else _CLIP_SPECIAL_TOKENS
        if context_length is None:
            context_length = config.get("context_length") or min(int(config.get("model_max_length", 77)), 77)
        return cls(tokenizer, context_length, special_tokens)

    def __repr__(self) -> str:
        return f"CaptionTokenizer(vocab_size={self.vocab_size}, context_length={self.context_length})"
