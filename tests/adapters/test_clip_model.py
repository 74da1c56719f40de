"""The CLIP model: tower output shapes for named sizes and for ViT/BERT towers, the loss against
a materialized reference, locking (LiT), save/load, and the round trip through
``transformers.CLIPModel``."""

import math

import pytest
import torch
import torch.nn.functional as F

from ds_infcl.adapters.clip import ClipModel, load_clip
from ds_infcl.adapters.clip_configs import CLIP_ARCHITECTURES, get_architecture
from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer

CAPTIONS = ["a handwritten 7", "the digit seven", "a photo of the number 7", "the digit three", "a blurry 3"]


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer.train(CAPTIONS, context_length=16)


def _inputs(tokenizer, b=5, image_size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(b, 3, image_size, image_size, generator=g)
    tokens = tokenizer(CAPTIONS[:b])
    return images, tokens["input_ids"], tokens["attention_mask"]


def _reference_loss(img, txt, scale):
    logits = scale * img @ txt.T
    labels = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


@pytest.mark.parametrize("arch", ["tiny", "digits-tiny"])
def test_tower_shapes_unit_norm_and_loss(tokenizer, arch):
    torch.manual_seed(0)
    model = ClipModel.from_architecture(arch, tokenizer)
    spec = CLIP_ARCHITECTURES[arch]
    images, ids, mask = _inputs(tokenizer, image_size=spec["vision"]["image_size"])
    out = model(images, ids, mask)
    d = spec["embed_dim"]
    assert out["image_features"].shape == (5, d) and out["text_features"].shape == (5, d)
    torch.testing.assert_close(out["image_features"].norm(dim=1), torch.ones(5))
    torch.testing.assert_close(out["text_features"].norm(dim=1), torch.ones(5))
    assert out["logit_scale"].item() == pytest.approx(math.log(1 / 0.07))
    ref = _reference_loss(out["image_features"], out["text_features"], model.loss.scale)
    torch.testing.assert_close(out["loss"], ref)
    out["loss"].backward()
    for name, p in model.named_parameters():
        if name.startswith(("visual_projection", "text_projection", "loss")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.vision_model.embeddings.patch_embedding.weight.grad.abs().sum() > 0
    assert model.text_model.embeddings.token_embedding.weight.grad.abs().sum() > 0


def test_padding_does_not_change_text_features(tokenizer):
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tokenizer).eval()
    short = CaptionTokenizer.train(CAPTIONS, context_length=8)
    a = tokenizer(["the digit seven"])
    b = short(["the digit seven"])
    fa = model.encode_text(a["input_ids"], a["attention_mask"])
    fb = model.encode_text(b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(fa, fb, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["small", "ViT-B-16", "ViT-L-14"])
def test_named_architectures_resolve(arch, tokenizer):
    spec = get_architecture(arch)
    assert spec["embed_dim"] > 0 and spec["vision"]["image_size"] % spec["vision"]["patch_size"] == 0


def test_unknown_architecture_lists_the_names(tokenizer):
    with pytest.raises(ValueError, match="ViT-B-16"):
        ClipModel.from_architecture("ViT-H-99", tokenizer)


def test_architecture_from_json_file(tmp_path, tokenizer):
    import json

    path = tmp_path / "mine.json"
    path.write_text(json.dumps(get_architecture("tiny") | {"embed_dim": 24}))
    model = ClipModel.from_architecture(str(path), tokenizer)
    images, ids, mask = _inputs(tokenizer, b=2)
    assert model.encode_image(images).shape == (2, 24)


def test_lock_image_tower(tokenizer):
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tokenizer, lock_image=True)
    model.train()
    assert not model.vision_model.training and model.text_model.training
    frozen = list(model.vision_model.parameters()) + list(model.visual_projection.parameters())
    assert all(not p.requires_grad for p in frozen)
    images, ids, mask = _inputs(tokenizer)
    image_features = model.encode_image(images)
    assert not image_features.requires_grad and image_features.grad_fn is None  # no graph built
    out = model(images, ids, mask)
    out["loss"].backward()
    assert all(p.grad is None for p in frozen)
    assert model.text_projection.weight.grad is not None and model.loss.logit_scale.grad is not None


def test_lock_text_tower(tokenizer):
    model = ClipModel.from_architecture("tiny", tokenizer, lock_text=True)
    images, ids, mask = _inputs(tokenizer)
    assert model.encode_text(ids, mask).grad_fn is None
    model(images, ids, mask)["loss"].backward()
    assert all(p.grad is None for p in model.text_model.parameters())
    assert model.visual_projection.weight.grad is not None


def test_save_load_round_trip(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tokenizer, lock_image=True).eval()
    with torch.no_grad():
        model.loss.logit_scale.fill_(3.0)
    model.save(str(tmp_path), tokenizer=tokenizer)
    loaded, tok = load_clip(str(tmp_path))
    loaded.eval()
    images, ids, mask = _inputs(tokenizer)
    a, b = model(images, ids, mask), loaded(*_inputs(tok))
    for key in ("loss", "image_features", "text_features"):
        torch.testing.assert_close(a[key], b[key])
    assert loaded.image_locked and loaded.loss.logit_scale.item() == 3.0
    assert ClipModel.load(str(tmp_path), loss_impl="vanilla").loss.impl == "vanilla"


def test_hf_clip_export_and_import_match(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tokenizer).eval()
    images, ids, mask = _inputs(tokenizer)
    hf = model.to_hf_clip().eval()
    with torch.no_grad():
        hf_img = F.normalize(hf.get_image_features(pixel_values=images).pooler_output, dim=-1)
        hf_txt = F.normalize(hf.get_text_features(input_ids=ids, attention_mask=mask).pooler_output, dim=-1)
        torch.testing.assert_close(model.encode_image(images), hf_img)
        torch.testing.assert_close(model.encode_text(ids, mask), hf_txt)
    hf.save_pretrained(str(tmp_path))
    again = ClipModel.from_hf_clip(str(tmp_path), lock_image=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again.encode_image(images), hf_img)
        torch.testing.assert_close(again.encode_text(ids, mask), hf_txt)
    assert again.image_locked
    assert again.loss.logit_scale.item() == pytest.approx(model.loss.logit_scale.item())


def test_vit_and_bert_towers(tmp_path, tokenizer):
    from transformers import BertConfig, BertModel, ViTConfig, ViTModel

    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    image_size=16, patch_size=8)
    bert = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=24, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=48, max_position_embeddings=16)
    model = ClipModel(vit, bert, embed_dim=20)
    images, ids, mask = _inputs(tokenizer, image_size=16)
    out = model(images, ids, mask)
    assert out["image_features"].shape == (5, 20) and out["text_features"].shape == (5, 20)
    assert model.text_pooling == "cls"
    # from two local pretrained folders, as in LiT
    ViTModel(vit).save_pretrained(str(tmp_path / "vit"))
    BertModel(bert).save_pretrained(str(tmp_path / "bert"))
    lit = ClipModel.from_towers(str(tmp_path / "vit"), str(tmp_path / "bert"), embed_dim=16, lock_image=True)
    assert lit.encode_image(images).shape == (5, 16) and lit.image_locked
    lit.save(str(tmp_path / "lit"))
    again = ClipModel.load(str(tmp_path / "lit")).eval()
    torch.testing.assert_close(again.encode_text(ids, mask), lit.eval().encode_text(ids, mask))


def test_towers_only_for_a_trainer_that_owns_the_loss(tmp_path, tokenizer):
    torch.manual_seed(0)
    towers = ClipModel.from_architecture("tiny", tokenizer, with_loss=False)
    assert towers.loss is None and not any("logit_scale" in n for n, _ in towers.named_parameters())
    images, ids, mask = _inputs(tokenizer)
    torch.testing.assert_close(towers.encode_query(images), towers.encode_image(images))
    torch.testing.assert_close(towers.encode_key({"input_ids": ids, "attention_mask": mask}),
                               towers.encode_text(ids, mask))
    with pytest.raises(ValueError, match="with_loss=False"):
        towers(images, ids, mask)
    towers.save(str(tmp_path), tokenizer=tokenizer, logit_scale=torch.tensor([2.5]))
    full = ClipModel.load(str(tmp_path))
    assert full.loss.logit_scale.item() == 2.5
    torch.testing.assert_close(full.encode_image(images), towers.encode_image(images))
    assert ClipModel.load(str(tmp_path), with_loss=False).loss is None


def test_mean_vision_pooling(tokenizer):
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tokenizer, vision_pooling="mean")
    images, ids, mask = _inputs(tokenizer)
    hidden = model.vision_model(pixel_values=images).last_hidden_state
    expected = F.normalize(model.visual_projection(model.vision_model.post_layernorm(hidden[:, 1:].mean(1))), dim=-1)
    torch.testing.assert_close(model.encode_image(images), expected)
    with pytest.raises(ValueError, match="pooling"):
        model.to_hf_clip()
    with pytest.raises(ValueError, match="vision_pooling must be one of"):
        ClipModel.from_architecture("tiny", tokenizer, vision_pooling="max")


def test_uint8_pixels_are_normalized_like_the_float_transform(tokenizer):
    # uint8 batches (the data pipeline's default) must give the features of the float32 transform.
    from PIL import Image

    from ds_infcl.data import ImageTransform

    model = ClipModel.from_architecture("tiny", tokenizer, image_mean=(0.5, 0.4, 0.3), image_std=(0.2, 0.25, 0.3)).eval()
    rng = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (3, 40, 48, 3), dtype=torch.uint8, generator=rng).numpy()
    images = [Image.fromarray(p) for p in pixels]
    as_float = ImageTransform(model.image_size, model.image_mean, model.image_std)
    as_uint8 = ImageTransform(model.image_size, model.image_mean, model.image_std, output="uint8")
    x_float = torch.stack([as_float(im) for im in images])
    x_uint8 = torch.stack([as_uint8(im) for im in images])
    assert x_uint8.dtype == torch.uint8 and x_float.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(x_uint8), model.encode_image(x_float), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model.encode_image(x_float), model.encode_image(x_float.mul(1.5)), atol=1e-3)
    with pytest.raises(ValueError, match="output must be"):
        ImageTransform(32, output="int8")
