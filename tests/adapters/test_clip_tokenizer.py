"""The caption tokenizer: trained with ``tokenizers``, fixed-length rows ending in [EOS],
save/load round trip, loading a plain ``tokenizer.json`` folder."""

import json

import pytest
import torch

from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer

CAPTIONS = ["a handwritten 7", "the digit seven", "a photo of the number 7", "the digit three", "A Handwritten 3"]


@pytest.mark.parametrize("kind", ["wordlevel", "bpe"])
def test_train_encode_save_load_round_trip(tmp_path, kind):
    tok = CaptionTokenizer.train(CAPTIONS, kind=kind, context_length=8, vocab_size=200)
    batch = tok(["a handwritten 7", "the digit seven"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == torch.long
    lengths = mask.sum(dim=1)
    assert (ids[:, 0] == tok.bos_token_id).all()
    assert (ids[torch.arange(2), lengths - 1] == tok.eos_token_id).all()
    assert (ids[mask == 0] == tok.pad_token_id).all()
    assert tok.decode(ids[0].tolist()).replace(" ", "") == "ahandwritten7"

    tok.save(str(tmp_path))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["context_length"] == 8
    loaded = CaptionTokenizer.load(str(tmp_path))
    assert loaded.vocab_size == tok.vocab_size and loaded.context_length == 8
    again = loaded(["a handwritten 7", "the digit seven"])
    assert torch.equal(again["input_ids"], ids) and torch.equal(again["attention_mask"], mask)
    # saving must not drop the padding of the live tokenizer
    assert tok(["seven"])["input_ids"].shape == (1, 8)


def test_wordlevel_lowercases_and_maps_unknown_words():
    tok = CaptionTokenizer.train(CAPTIONS, kind="wordlevel", context_length=8)
    assert torch.equal(tok(["A HANDWRITTEN 7"])["input_ids"], tok(["a handwritten 7"])["input_ids"])
    unk = tok.tokenizer.token_to_id("[UNK]")
    assert tok(["a zebra"])["input_ids"][0, 2].item() == unk


def test_truncation_keeps_eos():
    tok = CaptionTokenizer.train(CAPTIONS, kind="wordlevel", context_length=4)
    row = tok(["a photo of the number 7"])
    assert row["attention_mask"].tolist() == [[1, 1, 1, 1]]
    assert row["input_ids"][0, -1].item() == tok.eos_token_id


def test_load_plain_tokenizer_json_with_context_length(tmp_path):
    tok = CaptionTokenizer.train(CAPTIONS, context_length=8)
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: a foreign folder
    loaded = CaptionTokenizer.load(str(tmp_path), context_length=12)
    assert loaded(["the digit seven"])["input_ids"].shape == (1, 12)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="wordlevel"):
        CaptionTokenizer.train(CAPTIONS, kind="sentencepiece")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        CaptionTokenizer.load(str(tmp_path))
