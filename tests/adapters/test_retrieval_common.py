"""Shared helpers of the retrieval tests: a tiny random BERT folder and toy texts.

The model is built from a config (2 layers, hidden 32) with a WordPiece vocabulary written at
test time, so nothing is downloaded and a forward costs milliseconds.
"""

import os
import random

import torch

WORDS = (
    "what is the a an of to in how do you are i my your why where when who which can time "
    "cat dog bird fish tree car road city house book music song film game food water fire "
    "red blue green big small old new fast slow good bad happy sad day night sun moon star "
    "play read write eat drink run walk sleep think know love like want need make take give"
).split()


def make_tiny_model_dir(path: str, *, dropout: float = 0.0, seed: int = 0) -> str:
    """A plain transformers folder (BertModel + tokenizer) with random weights."""
    from transformers import BertConfig, BertModel, BertTokenizer

    os.makedirs(path, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += list("abcdefghijklmnopqrstuvwxyz0123456789?.,!'")
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(path)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    BertModel(cfg).save_pretrained(path)
    return path


def random_texts(n: int, seed: int, min_words: int = 2, max_words: int = 7):
    """``n`` distinct random sentences over the tiny vocabulary."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        t = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def test_tiny_model_encodes(tmp_path):
    from ds_infcl.adapters.retrieval import load_sentence_transformer

    model = load_sentence_transformer(make_tiny_model_dir(str(tmp_path / "m")))
    assert model.tokenize(["the cat"])["input_ids"].tolist() == [[2, 5 + WORDS.index("the"), 5 + WORDS.index("cat"), 3]]
    emb = model.encode(["a cat", "the red car is fast"], convert_to_tensor=True)
    assert emb.shape == (2, 32)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(2))
