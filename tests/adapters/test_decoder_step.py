"""The decoder step (``ds_infcl.adapters.decoder_step``): packing is exact against the padded step
(same loss, same gradients: tiny random Qwen2/Llama decoders, texts of different lengths, left and
right padding, last-token, mean and cls pooling, also through a GradCache step), the FLOPs formula
against a hand computation and the ``bench_decoder`` count, and the errors of the options."""

import json

import pytest
import torch

from ds_infcl.adapters.decoder_step import (
    LayerCheckpointing,
    activation_bytes,
    decoder_flops,
    decoder_matmul_params,
    liger_available,
    pack_texts,
    pool_packed,
    pool_padded,
)
from ds_infcl.adapters.retrieval import RetrievalEncoders, RetrievalLoss, text_ids
from ds_infcl.errors import ConfigError
from ds_infcl.tasks.base import Batch, get_task
from tests.adapters.test_decoder_embedders import make_tiny_decoder_dir
from tests.adapters.test_retrieval_common import random_texts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_step")
    return {arch: make_tiny_decoder_dir(str(root / arch), arch) for arch in ("qwen2", "llama")}


def _mask(lengths, width, side):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, width - n:] = 1
    return mask


# ----------------------------------------------------------------------------------------------
# pack_texts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_layout(side):
    lengths = [5, 1, 9, 3, 9, 7]
    ids = torch.arange(1, 55).view(6, 9)
    mask = _mask(lengths, 9, side)
    p = pack_texts(ids * mask, mask, rows_multiple=3, pad_token_id=-1)
    assert p.input_ids.shape == (6, 9)  # 4 rows of 9 (first-fit decreasing), rounded up to 6
    assert p.num_tokens == sum(lengths) and p.sum_sq_tokens == sum(n * n for n in lengths)
    flat_ids, flat_pos = p.input_ids.reshape(-1), p.position_ids.reshape(-1)
    for i, n in enumerate(lengths):
        s = int(p.starts[i])
        assert flat_ids[s:s + n].tolist() == ids[i][mask[i].bool()].tolist()  # the text, whole, in order
        assert flat_pos[s:s + n].tolist() == list(range(n))  # positions restart per text
        assert s // 9 == (s + n - 1) // 9  # within one row
    assert int((p.input_ids == -1).sum()) == 6 * 9 - sum(lengths)  # pad only in tails and whole rows
    assert (p.position_ids[4:] == torch.arange(9)).all()  # pad rows: one segment from 0


def test_pack_errors():
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="1 of 2 texts have no token"):
        pack_texts(ids, torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="one run of ones per row"):
        pack_texts(ids, torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="row_tokens=3 is shorter than the longest text \\(4 tokens\\)"):
        pack_texts(ids, None, row_tokens=3)


# ----------------------------------------------------------------------------------------------
# Packed == padded (same loss, same gradients)
# ----------------------------------------------------------------------------------------------


def _step(path, *, packing, side, pooling, chunk_size=3, **kwargs):
    enc = RetrievalEncoders(path, padding_side=side, pooling=pooling, chunk_size=chunk_size, packing=packing, **kwargs)
    enc.train()
    texts_q, texts_d = random_texts(5, 3, max_words=9), random_texts(10, 4, max_words=12)
    q = enc.encode_query(enc.tokenize_queries(texts_q))
    k = enc.encode_key(enc.tokenize_documents(texts_d))
    loss = RetrievalLoss()(q, k, torch.arange(5) * 2, key_ids=text_ids(texts_d))
    loss.backward()
    return loss.detach(), q.detach(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls"])
def test_packing_matches_padded_loss_and_gradients(dirs, arch, side, pooling):
    ref_loss, ref_q, ref = _step(dirs[arch], packing=False, side=side, pooling=pooling)
    loss, q, got = _step(dirs[arch], packing=True, side=side, pooling=pooling)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys() and len(ref) > 10
    for name, g in ref.items():
        # float32: left padding shifts the absolute rotary positions (the same relative ones), so the
        # rounding differs by a few 1e-6 on gradients of size ~1
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=2e-5, msg=name)


def test_packing_one_text_and_checkpointed_layers(dirs):
    # b = 1 (nothing to pack beside it) and layer checkpointing on: still the padded values
    ref_loss, _, ref = _step(dirs["qwen2"], packing=False, side="right", pooling="lasttoken", chunk_size=1)
    loss, _, got = _step(dirs["qwen2"], packing=True, side="right", pooling="lasttoken", chunk_size=1,
                         gradient_checkpointing=True, pack_rows_multiple=1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=2e-5, msg=name)


def test_pool_packed_against_padded_hidden_states():
    # the pooling alone, on made-up hidden states laid out both ways
    torch.manual_seed(0)
    lengths = [4, 2, 6]
    mask = _mask(lengths, 6, "left")
    hidden = torch.randn(3, 6, 5, dtype=torch.float64)
    p = pack_texts(torch.arange(18).view(3, 6) * mask, mask)
    packed_hidden = torch.zeros(p.input_ids.numel(), 5, dtype=torch.float64)
    for i, n in enumerate(lengths):
        packed_hidden[int(p.starts[i]):int(p.starts[i]) + n] = hidden[i][mask[i].bool()]
    packed_hidden = packed_hidden.view(*p.input_ids.shape, 5)
    for mode in ("lasttoken", "mean", "cls"):
        torch.testing.assert_close(pool_packed(packed_hidden, p, mode), pool_padded(hidden, mask, mode))


def test_packing_in_a_grad_cache_step(dirs):
    # The whole GradCache step of the engine (pass 1, loss, pass 3 per chunk, RNG replay checked):
    # packed towers give the padded step's loss and parameter gradients.
    from ds_infcl.train.model import ContrastiveModel
    from ds_infcl.train.steps import grad_cache_step
    from tests.train.test_steps import FakeEngine

    texts_q, texts_d = random_texts(6, 5, max_words=9), random_texts(12, 6, max_words=12)
    out = {}
    for packing in (False, True):
        enc = RetrievalEncoders(dirs["qwen2"], padding_side="left", packing=packing)
        model = ContrastiveModel(enc, RetrievalLoss())
        batch = Batch(query_inputs=dict(enc.tokenize_queries(texts_q)), key_inputs=dict(enc.tokenize_documents(texts_d)),
                      sample_index=torch.arange(6), keys_per_query=2,
                      loss_inputs={"key_ids": text_ids(texts_d)})
        engine = FakeEngine(model, gas=3)
        result = grad_cache_step(engine, batch, 2, torch.device("cpu"), verify_replay=True)
        out[packing] = (float(result.loss), engine.step_grads)
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-4, atol=2e-5, msg=name)


def test_bench_decoder_packing_matches_padded():
    out = {}
    for packing in (False, True):
        task = get_task("bench_decoder", {"arch": "tiny", "seq_len": 12, "min_seq_len": 3, "packing": packing,
                                          "gradient_checkpointing": False})
        torch.manual_seed(0)
        towers = task.build_towers().double()
        index = torch.arange(5)
        q, k = towers.encode_query(index), towers.encode_key(index.repeat_interleave(2))
        loss = (20 * q @ k.T).logsumexp(1).sum()
        loss.backward()
        out[packing] = (loss.detach(), [p.grad.clone() for p in towers.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0])
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def test_flops_by_hand_for_a_tiny_grouped_kv_decoder(dirs):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(dirs["qwen2"])  # width 32, 4 heads of 8, 2 kv heads, MLP 64, 2 layers
    # per layer: q 32x32, k 32x16, v 32x16, o 32x32, gate/up/down 3 x 32x64
    n = 2 * (32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64)
    assert n == 18432 and decoder_matmul_params(model) == n
    # texts of 3 and 5 tokens: 3 x (2 N 8 + 2 * 2 * layers * head_dim * heads * (9 + 25))
    assert decoder_flops(model.config, n, 8, 34) == 3 * (2 * 18432 * 8 + 4 * 2 * 8 * 4 * 34) == 910848


def test_flops_bench_decoder_qwen2_1_5b_unchanged():
    task = get_task("bench_decoder", {"arch": "qwen2-1.5b", "seq_len": 256, "num_negatives": 1})
    h, kv, inter, layers, t = 1536, 256, 8960, 28, 256
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    assert task.matmul_params() == n
    assert task.model_flops_per_sample() == 3 * t * (6 * n + 12 * layers * h * t)  # the count before the change
    # varied lengths: the expected value over the uniform lengths 2..4 (mean 3, mean square 29/3)
    small = get_task("bench_decoder", {"arch": "tiny", "seq_len": 4, "min_seq_len": 2, "num_negatives": 0})
    towers = small.build_towers()
    assert small.matmul_params() == decoder_matmul_params(towers.model)
    expected = 3 * (2 * small.matmul_params() * 2 * 3 + 4 * 2 * 32 * 2 * 29 / 3)
    assert small.model_flops_per_sample() == pytest.approx(expected, rel=1e-12)
    assert small.tokens_per_sample() == 6


def test_retrieval_task_counts_llm_flops_on_decoders(tmp_path, dirs):
    data = tmp_path / "pairs.jsonl"
    rows = [{"query": q, "pos": [d], "neg": []} for q, d in zip(random_texts(8, 7), random_texts(8, 8, max_words=11))]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = get_task("retrieval", {"data": str(data), "model_path": dirs["qwen2"], "packing": True})
    batch = next(task.batches(rank=0, world_size=1, local_batch_size=4, start_step=0, seed=0))
    lengths = torch.cat([batch["query_inputs"]["attention_mask"].sum(1), batch["key_inputs"]["attention_mask"].sum(1)])
    expected = decoder_flops(task.build_towers().query_model[0].auto_model.config, 18432, int(lengths.sum()),
                             int((lengths ** 2).sum())) / 4
    assert task.model_flops_per_sample() == pytest.approx(expected)


# ----------------------------------------------------------------------------------------------
# Options: checkpointing, liger, packing on encoders
# ----------------------------------------------------------------------------------------------


def test_layer_checkpointing_auto_and_errors(dirs):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(dirs["qwen2"])
    auto = LayerCheckpointing(model, "auto", log=lambda _: None)
    assert auto.decide(10_000, torch.device("cpu"), torch.float32) is False  # no device memory to budget on CPU
    assert not any(layer.gradient_checkpointing for layer in model.layers)
    assert LayerCheckpointing(model, True).decide(5, torch.device("cpu"), torch.float32) is True
    assert all(layer.gradient_checkpointing for layer in model.layers)
    with pytest.raises(ConfigError, match="gradient_checkpointing: true, false or \"auto\", got 'yes'"):
        LayerCheckpointing(model, "yes")
    # the estimate by the shapes, per token and layer: norms 2 * (8 h + 4 h), q k v 4 (32 + 32),
    # attention output and o input 2 * 4 * 32, MLP 4 * 4 * 64 (float32)
    assert activation_bytes(model.config, 1, torch.float32) == 2 * (2 * 12 * 32 + 4 * 64 + 8 * 32 + 16 * 64)


def test_option_errors(dirs, tmp_path):
    from ds_infcl.adapters.decoder_step import check_decoder_options

    # a sentence-transformers folder may pool otherwise (max, weightedmean): refused packed
    with pytest.raises(ConfigError, match="packing: pooling 'max' is not supported packed"):
        check_decoder_options(packing=True, liger=False, is_decoder=True, pooling="max")
    with pytest.raises(ConfigError, match="pack_rows_multiple: a positive integer, got 0"):
        RetrievalEncoders(dirs["qwen2"], packing=True, pack_rows_multiple=0)
    with pytest.raises(ConfigError, match="min_seq_len: in \\[1, seq_len=8\\], got 9"):
        get_task("bench_decoder", {"arch": "tiny", "seq_len": 8, "min_seq_len": 9})
    with pytest.raises(ConfigError, match="task.args.packing: true or false"):
        get_task("bench_decoder", {"arch": "tiny", "seq_len": 8, "packing": "yes"})


def test_encoder_options_refused():
    from ds_infcl.adapters.retrieval import default_model_path

    with pytest.raises(ConfigError, match="packing: true works with decoder-only models"):
        RetrievalEncoders(default_model_path(), packing=True)
    with pytest.raises(ConfigError, match="\"auto\" estimates decoder activations"):
        RetrievalEncoders(default_model_path(), gradient_checkpointing="auto")


def test_liger_without_the_package_is_a_config_error(dirs):
    if liger_available():  # the GPU image with liger-kernel: tests/gpu/test_decoder_step_gpu.py runs it
        pytest.skip("liger-kernel is installed here: the missing-package error cannot happen")
    with pytest.raises(ConfigError, match="liger: true needs `pip install liger-kernel`"):
        RetrievalEncoders(dirs["qwen2"], liger=True)
    with pytest.raises(ConfigError, match="liger: true needs `pip install liger-kernel`"):
        get_task("bench_decoder", {"arch": "tiny", "seq_len": 8, "liger": True}).build_towers()
