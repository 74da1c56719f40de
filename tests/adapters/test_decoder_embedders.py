"""Decoder embedders (E5-Mistral / GTE-Qwen style) and LoRA in RetrievalEncoders.

Tiny random decoders (Qwen2, Llama, Mistral configs: 2 layers, hidden 32) with a byte-level BPE
tokenizer trained at test time on the toy vocabulary. References are independent of the code
under test: each text run alone (no padding) through a float64 copy of the model, LoRA merges
done by hand in float64 (W + alpha / r * B @ A), dropout masks replayed against a run without
checkpointing.
"""

import json
import os

import pytest
import torch

from ds_infcl.adapters.retrieval import (
    RetrievalEncoders,
    RetrievalLoss,
    configure_decoder_tokenizer,
    render_template,
    text_ids,
)
from tests.adapters.test_retrieval_common import WORDS, random_texts

EOS = "<|endoftext|>"
PAD = "<pad>"
TEMPLATE = "Instruct: {task}\nQuery: {text}"
TASK = "Given a question, retrieve the answer"


def _bpe_tokenizer(eos_in_template: bool = False, with_eos: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` over the toy words (no EOS appended unless
    ``eos_in_template``: GTE-Qwen's tokenizer appends it, E5-Mistral's does not)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i : i + 6]) for i in range(len(WORDS))] + [TEMPLATE, TASK], trainer)
    if eos_in_template:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS if with_eos else None)


def make_tiny_decoder_dir(path: str, arch: str = "qwen2", *, dropout: float = 0.0, seed: int = 0,
                          eos_in_template: bool = False) -> str:
    """A plain transformers folder: a random 2-layer decoder and its tokenizer. Qwen2 gets its own
    pad token; Llama and Mistral get none (as their released tokenizers)."""
    from transformers import AutoModel, LlamaConfig, MistralConfig, Qwen2Config

    os.makedirs(path, exist_ok=True)
    tokenizer = _bpe_tokenizer(eos_in_template)
    if arch == "qwen2":
        tokenizer.pad_token = PAD
    tokenizer.save_pretrained(path)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}[arch]
    config = config_cls(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        attention_dropout=dropout)
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def decoder_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {arch: make_tiny_decoder_dir(str(root / arch), arch) for arch in ("qwen2", "llama", "mistral")}


@pytest.fixture(scope="module")
def qwen_dir(decoder_dirs):
    return decoder_dirs["qwen2"]


def _unpadded_last_states(enc, texts, side="query"):
    """float64 reference: each tokenized text alone through a float64 copy of the transformer;
    the hidden state of its last token. Also returns the unpadded token ids."""
    import copy

    hf = copy.deepcopy(enc.query_model[0].auto_model).double().eval()
    tokenize = enc.tokenize_queries if side == "query" else enc.tokenize_documents
    out, ids = [], []
    with torch.no_grad():
        for t in texts:
            row = tokenize([t])["input_ids"]
            assert row.shape[0] == 1
            out.append(hf(input_ids=row).last_hidden_state[0, -1])
            ids.append(row[0].tolist())
    return torch.stack(out), ids


# ----------------------------------------------------------------------------------------------
# Last-token pooling under left and right padding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_last_token_pooling_matches_unpadded_rows(decoder_dirs, arch, side):
    enc = RetrievalEncoders(decoder_dirs[arch], padding_side=side, normalize=False, chunk_size=2)
    assert enc.is_decoder and enc.query_model[1].pooling_mode == "lasttoken"
    texts = ["dog", "the red car is fast and the old dog can run", "what is a cat", "sun"]
    feats = enc.tokenize_queries(texts)
    mask = feats["attention_mask"]
    assert (mask.sum(1) < mask.shape[1]).any()  # the batch really is padded ...
    pad_col = 0 if side == "left" else -1
    assert (mask[:, pad_col] == 0).any() and (mask[:, -1 - pad_col] == 1).all()  # ... on that side
    ref, ids = _unpadded_last_states(enc, texts)
    eos_id = enc.query_model.tokenizer.eos_token_id
    assert all(row[-1] == eos_id and row.count(eos_id) == 1 for row in ids)  # EOS appended once
    # evaluation path (length-sorted batches) and the training path (chunks of 2, with gradients)
    torch.testing.assert_close(enc.embed_queries(texts).double(), ref, rtol=1e-5, atol=1e-5)
    enc.train()
    trained = enc.encode_query(feats)
    torch.testing.assert_close(trained.detach().double(), ref, rtol=1e-5, atol=1e-5)
    single = enc.embed_queries(texts[1:2])  # b = 1: no padding at all
    torch.testing.assert_close(single.double(), ref[1:2], rtol=1e-5, atol=1e-5)


def test_left_and_right_padding_give_the_same_gradients(qwen_dir):
    """Padded positions never leak into the loss or its gradients (no NaN from fully masked rows)."""
    texts_q, texts_d = random_texts(5, 3, max_words=9), random_texts(10, 4, max_words=9)
    grads = {}
    for side in ("left", "right"):
        enc = RetrievalEncoders(qwen_dir, padding_side=side, chunk_size=3)
        enc.train()
        q = enc.encode_query(enc.tokenize_queries(texts_q))
        k = enc.encode_key(enc.tokenize_documents(texts_d))
        RetrievalLoss()(q, k, torch.arange(5) * 2, key_ids=text_ids(texts_d)).backward()
        grads[side] = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    assert grads["left"].keys() == grads["right"].keys() and len(grads["left"]) > 10
    for name, g in grads["left"].items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, grads["right"][name], rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------------
# EOS appending, pad token, templates, dtype
# ----------------------------------------------------------------------------------------------


def test_eos_appending_options(tmp_path, decoder_dirs):
    texts = ["the cat", "a big old dog can run fast"]
    # default on for decoders: exactly one EOS closes every row, truncation keeps room for it
    enc = RetrievalEncoders(decoder_dirs["qwen2"], max_seq_length=5)
    assert enc.tokenizer_changes["eos_appended_by"] == "ds_infcl"
    tok = enc.query_model.tokenizer
    feats = enc.tokenize_queries(texts)
    assert feats["input_ids"].shape[1] == 5
    for row, mask in zip(feats["input_ids"], feats["attention_mask"]):
        real = row[mask.bool()].tolist()
        assert real[-1] == tok.eos_token_id and real.count(tok.eos_token_id) == 1
    assert tok.pad_token == PAD  # Qwen2 keeps its own pad token
    # off: the tokenizer's own ids
    off = RetrievalEncoders(decoder_dirs["qwen2"], append_eos=False).tokenize_queries(["the cat"])["input_ids"][0]
    assert off.tolist() == tok("the cat", add_special_tokens=False)["input_ids"]
    # a tokenizer that appends EOS itself (GTE-Qwen): nothing added, still exactly one EOS
    own = RetrievalEncoders(make_tiny_decoder_dir(str(tmp_path / "own"), eos_in_template=True))
    assert own.tokenizer_changes["eos_appended_by"] == "tokenizer"
    ids = own.tokenize_queries(["the cat"])["input_ids"][0].tolist()
    assert ids == off.tolist() + [tok.eos_token_id]
    # Llama / Mistral tokenizers without a pad token pad with EOS
    llama = RetrievalEncoders(decoder_dirs["llama"])
    assert llama.tokenizer_changes["pad_token_set"] and llama.query_model.tokenizer.pad_token == EOS


def test_eos_survives_save_and_reload(tmp_path, qwen_dir):
    """Both ways of appending EOS reload from the saved tokenizer: the extended post-processor
    (tokenizer.json) and the add_eos_token flag (tokenizers loaded with pinned flags)."""
    from transformers import AutoTokenizer

    for name, kwargs in (("post_processor", {}), ("flag", {"add_eos_token": False, "add_bos_token": False})):
        tok = AutoTokenizer.from_pretrained(qwen_dir, **kwargs)
        plain = tok("the cat")["input_ids"]
        assert plain[-1] != tok.eos_token_id
        assert configure_decoder_tokenizer(tok)["eos_appended_by"] == "ds_infcl"
        assert tok("the cat")["input_ids"] == plain + [tok.eos_token_id], name
        tok.save_pretrained(str(tmp_path / name))
        again = AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert again("the cat")["input_ids"] == plain + [tok.eos_token_id], name
        assert configure_decoder_tokenizer(again)["eos_appended_by"] == "tokenizer", name


def test_tokenizer_errors():
    tok = _bpe_tokenizer(with_eos=False)
    with pytest.raises(ValueError, match="neither a pad token nor an EOS"):
        configure_decoder_tokenizer(tok)
    tok.pad_token = PAD
    with pytest.raises(ValueError, match="has no eos_token; pass append_eos=False"):
        configure_decoder_tokenizer(tok)
    assert configure_decoder_tokenizer(tok, append_eos=False)["eos_appended_by"] is None
    with pytest.raises(ValueError, match="padding_side must be"):
        configure_decoder_tokenizer(tok, padding_side="middle")


def test_templates(tmp_path, qwen_dir):
    from sentence_transformers import SentenceTransformer

    enc = RetrievalEncoders(qwen_dir, query_template=TEMPLATE, task_description=TASK)
    tok = enc.query_model.tokenizer
    instructed = f"Instruct: {TASK}\nQuery: what is the cat"
    assert enc.query_prefix == f"Instruct: {TASK}\nQuery: "
    assert enc.tokenize_queries(["what is the cat"])["input_ids"][0].tolist() == tok(instructed)["input_ids"]
    assert enc.tokenize_documents(["what is the cat"])["input_ids"][0].tolist() == tok("what is the cat")["input_ids"]
    # the saved folder carries the template as the query prompt (documents get none)
    out = str(tmp_path / "saved")
    enc.save(out, batch_size=8)
    loaded = SentenceTransformer(out, device="cpu")
    texts = ["what is the cat", "the dog can run"]
    torch.testing.assert_close(loaded.encode(texts, prompt_name="query", convert_to_tensor=True),
                               enc.embed_queries(texts), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded.encode(texts, convert_to_tensor=True), enc.embed_documents(texts),
                               rtol=1e-5, atol=1e-5)
    info = json.load(open(os.path.join(out, "ds_infcl_training.json")))
    assert info["query_template"] == TEMPLATE and info["task_description"] == TASK and info["append_eos"]
    # the existing prefix options keep working on decoders
    pre = RetrievalEncoders(qwen_dir, query_prefix="query: ", document_prefix="passage: ")
    assert pre.tokenize_queries(["the cat"])["input_ids"][0].tolist() == tok("query: the cat")["input_ids"]
    assert pre.tokenize_documents(["the cat"])["input_ids"][0].tolist() == tok("passage: the cat")["input_ids"]


def test_template_errors(qwen_dir):
    assert render_template("{{x}} {text}", None) == "{x} "
    assert render_template("query: {text}", None) == "query: "
    bad = [
        (dict(query_template="Query: {text} end"), "exactly once, at its end"),
        (dict(query_template="Query: {txt}"), "unknown fields"),
        (dict(query_template="{text} {text}"), "exactly once"),
        (dict(query_template=TEMPLATE), "pass task_description"),
        (dict(query_template="Query: {text}", query_prefix="q: "), "either query_prefix or query_template"),
        (dict(task_description=TASK), "no template uses {task}"),
        (dict(query_template="Query: {text"), "not a valid format string"),
        (dict(padding_side="top"), "padding_side must be"),
        (dict(dtype="float8"), "dtype must be"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            RetrievalEncoders(qwen_dir, **kwargs)


def test_bf16_loading(qwen_dir):
    texts = ["the cat", "a red car is fast"]
    ref = RetrievalEncoders(qwen_dir).embed_queries(texts)
    enc = RetrievalEncoders(qwen_dir, dtype="bfloat16")
    assert {p.dtype for p in enc.parameters()} == {torch.bfloat16}
    emb = enc.embed_queries(texts)
    assert emb.dtype == torch.bfloat16
    torch.testing.assert_close(emb.float(), ref, rtol=0, atol=0.05)
    lora = RetrievalEncoders(qwen_dir, dtype=torch.bfloat16, lora={"r": 2})
    trainable = {p.dtype for p in lora.parameters() if p.requires_grad}
    assert trainable == {torch.float32}  # peft keeps the adapters in float32 over a bf16 base


# ----------------------------------------------------------------------------------------------
# Gradient checkpointing inside GradCache chunks
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory):
    return make_tiny_decoder_dir(str(tmp_path_factory.mktemp("dropout")), dropout=0.3, seed=1)


def _chunked_step(path, checkpointing, seed, chunk_size=3):
    texts_q, texts_d = random_texts(7, 11, max_words=9), random_texts(14, 12, max_words=9)
    enc = RetrievalEncoders(path, chunk_size=chunk_size, gradient_checkpointing=checkpointing, padding_side="left")
    enc.train()
    calls = []
    # counts the first layer's MLP runs, recomputations included (a forward hook would miss those)
    mlp = enc.query_model[0].auto_model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    torch.manual_seed(seed)
    q = enc.encode_query(enc.tokenize_queries(texts_q))
    k = enc.encode_key(enc.tokenize_documents(texts_d))
    loss = RetrievalLoss()(q, k, torch.arange(7) * 2, key_ids=text_ids(texts_d))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls), enc


def test_gradient_checkpointing_is_exact_under_chunks(dropout_dir):
    loss_off, grads_off, calls_off, _ = _chunked_step(dropout_dir, False, seed=5)
    loss_on, grads_on, calls_on, enc = _chunked_step(dropout_dir, True, seed=5)
    assert enc.query_model[0].auto_model.is_activation_checkpointing
    # 3 query chunks + 5 document chunks: forward + chunk replay, and with checkpointing the
    # layer's own recompute inside each replay (the checkpoints nest)
    assert calls_off == 2 * 8 and calls_on == 3 * 8
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=0)
    assert grads_on.keys() == grads_off.keys()
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-6, atol=1e-7, msg=name)
    # the trainer's GradCache (ds_infcl.train.steps): a no-grad pass, then a replay with grad from
    # the saved RNG state gives the same features, dropout and checkpointed layers included
    feats = enc.tokenize_queries(random_texts(5, 13, max_words=9))
    state = torch.get_rng_state()
    with torch.no_grad():
        first = enc.encode_query(feats)
    torch.set_rng_state(state)
    replay = enc.encode_query(feats)
    assert replay.requires_grad and torch.equal(replay.detach(), first)
    # the dropout is live: another seed draws other masks and another loss
    loss_other, _, _, _ = _chunked_step(dropout_dir, True, seed=6)
    assert abs(float(loss_other) - float(loss_off)) > 1e-4
    # and without chunks (one checkpoint-free forward) checkpointing is exact too
    whole_off = _chunked_step(dropout_dir, False, seed=5, chunk_size=None)
    whole_on = _chunked_step(dropout_dir, True, seed=5, chunk_size=None)
    torch.testing.assert_close(whole_on[0], whole_off[0], rtol=0, atol=0)
    for name, g in whole_off[1].items():
        torch.testing.assert_close(whole_on[1][name], g, rtol=1e-6, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _train_steps(enc, num_steps=3, seed=0):
    opt = torch.optim.Adam([p for p in enc.parameters() if p.requires_grad], lr=2e-2)
    texts_q, texts_d = random_texts(6, 20 + seed), random_texts(6, 40 + seed)
    enc.train()
    for _ in range(num_steps):
        q = enc.encode_query(enc.tokenize_queries(texts_q))
        k = enc.encode_key(enc.tokenize_documents(texts_d))
        RetrievalLoss()(q, k).backward()
        opt.step()
        opt.zero_grad()


def test_lora_trains_adapters_only_and_exports(tmp_path, qwen_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    enc = RetrievalEncoders(qwen_dir, lora=LORA, query_template=TEMPLATE, task_description=TASK, chunk_size=4,
                            padding_side="left", gradient_checkpointing=True)
    trainable = {n: p for n, p in enc.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in enc.named_parameters() if not p.requires_grad}
    adapters_before = {n: p.detach().clone() for n, p in trainable.items()}
    assert all(float(p.abs().max()) == 0 for n, p in adapters_before.items() if ".lora_B." in n)

    _train_steps(enc)
    for n, p in enc.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
        else:
            assert not torch.equal(p, adapters_before[n]), n

    out = str(tmp_path / "lora")
    assert enc.save(out, batch_size=6) == [out]
    # (a) the merged folder: a plain model, SentenceTransformer loads it and embeds as the encoder
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in saved)
    peft_model = enc.query_model[0].auto_model
    base = peft_model.get_base_model()
    for i in range(2):  # the merge by hand in float64: W + alpha / r * B @ A
        proj = base.layers[i].self_attn.q_proj
        want = proj.base_layer.weight.double() + (LORA["alpha"] / LORA["r"]) * (
            proj.lora_B["default"].weight.double() @ proj.lora_A["default"].weight.double())
        torch.testing.assert_close(saved[f"layers.{i}.self_attn.q_proj.weight"].double(), want, rtol=1e-6, atol=1e-7)
        assert torch.equal(saved[f"layers.{i}.self_attn.k_proj.weight"], base.layers[i].self_attn.k_proj.weight)
    loaded = SentenceTransformer(out, device="cpu")
    texts = ["what is the cat", "the dog can run fast", "sun"]
    mine_q, mine_d = enc.embed_queries(texts), enc.embed_documents(texts)
    torch.testing.assert_close(loaded.encode(texts, prompt_name="query", convert_to_tensor=True), mine_q,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded.encode(texts, convert_to_tensor=True), mine_d, rtol=1e-5, atol=1e-5)
    untrained = RetrievalEncoders(qwen_dir, query_template=TEMPLATE, task_description=TASK).embed_queries(texts)
    assert (untrained - mine_q).abs().max() > 1e-3  # the export holds the trained adapters
    # (b) the adapter alone loads onto the base model with peft
    adapted = PeftModel.from_pretrained(AutoModel.from_pretrained(qwen_dir), os.path.join(out, "adapter")).eval()
    feats = enc.tokenize_queries(texts)
    with torch.no_grad():
        hidden = adapted(input_ids=feats["input_ids"], attention_mask=feats["attention_mask"]).last_hidden_state
    torch.testing.assert_close(torch.nn.functional.normalize(hidden[:, -1], dim=-1), mine_q, rtol=1e-5, atol=1e-5)
    info = json.load(open(os.path.join(out, "ds_infcl_training.json")))
    assert info["lora"] == LORA and info["adapter"].startswith("adapter/")
    # the trained encoder is unchanged by the export (no merge left behind)
    assert isinstance(enc.query_model[0].auto_model, PeftModel)
    torch.testing.assert_close(enc.embed_queries(texts), mine_q, rtol=0, atol=0)


def test_lora_separate_towers(tmp_path, qwen_dir):
    from sentence_transformers import SentenceTransformer

    enc = RetrievalEncoders(qwen_dir, separate=True, lora={"r": 2, "target_modules": "v_proj"})
    names = [n for n, p in enc.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 2 * 2 and {n.split(".")[0] for n in names} == {"query_model", "document_model"}
    _train_steps(enc, num_steps=2, seed=1)
    paths = enc.save(str(tmp_path / "two"))
    texts = ["a cat", "the old tree"]
    for path, mine in zip(paths, (enc.embed_queries(texts), enc.embed_documents(texts))):
        assert os.path.isfile(os.path.join(path, "adapter", "adapter_config.json"))
        torch.testing.assert_close(SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True), mine,
                                   rtol=1e-5, atol=1e-5)


def test_lora_errors(qwen_dir):
    bad = [
        ({"r": 8, "rank": 4}, "unknown keys \\['rank'\\]"),
        ({"alpha": 16}, "positive integer"),
        ({"r": 0}, "positive integer"),
        ({"r": 4, "alpha": -1}, "positive number"),
        ({"r": 4, "dropout": 1.0}, "in \\[0, 1\\)"),
        ({"r": 4, "target_modules": []}, "non-empty list"),
        ([8], "must be a dict"),
    ]
    for lora, match in bad:
        with pytest.raises(ValueError, match=match):
            RetrievalEncoders(qwen_dir, lora=lora)
    with pytest.raises(ValueError, match="linear layers are named .*'q_proj'"):
        RetrievalEncoders(qwen_dir, lora={"r": 4, "target_modules": ["query_proj"]})
