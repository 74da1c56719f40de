"""Evaluation metrics on hand-built embeddings, and ``evaluate_clip`` end to end on a tiny model."""

import pytest
import torch
import torch.nn.functional as F

from ds_infcl.adapters.clip_eval import (
    build_zero_shot_classifier,
    class_prompts,
    evaluate_clip,
    retrieval_recall,
    zero_shot_accuracy,
    zero_shot_classifier,
)

E = torch.eye(4)  # four orthonormal directions


def test_zero_shot_classifier_averages_normalized_prompts():
    # class 0: prompts e0 (norm 1) and 3*e1 (norm 3) weigh equally after normalization
    classifier = zero_shot_classifier([torch.stack([E[0], 3 * E[1]]), E[2:3]])
    torch.testing.assert_close(classifier[0], (E[0] + E[1]) / 2 ** 0.5)
    torch.testing.assert_close(classifier[1], E[2])


def test_class_prompts_with_synonyms():
    assert class_prompts([["7", "seven"], "cat"], ["a {}", "the {}"]) == [
        ["a 7", "the 7", "a seven", "the seven"], ["a cat", "the cat"],
    ]


def test_build_zero_shot_classifier_with_a_fake_text_encoder():
    vocab = {"a 0": E[0], "the 0": E[1], "a 1": E[2], "the 1": E[3]}
    seen = []

    def encode(texts):
        seen.extend(texts)
        return torch.stack([vocab[t] for t in texts])

    classifier = build_zero_shot_classifier(encode, ["0", "1"], ["a {}", "the {}"])
    assert seen == ["a 0", "the 0", "a 1", "the 1"]  # one batched call
    torch.testing.assert_close(classifier, torch.stack([(E[0] + E[1]), (E[2] + E[3])]) / 2 ** 0.5)


def test_zero_shot_accuracy_hand_built():
    classifier = E[:3]  # 3 classes along e0, e1, e2
    images = torch.tensor([
        [1.0, 0.2, 0.1, 0],  # class 0, rank 1
        [0.5, 1.0, 0.0, 0],  # class 1, rank 1
        [1.0, 0.0, 0.5, 0],  # class 2, rank 2
        [0.1, 1.0, 0.5, 0],  # class 0, rank 3
    ])
    labels = torch.tensor([0, 1, 2, 0])
    acc = zero_shot_accuracy(images, classifier, labels, topk=(1, 2, 5))
    assert acc == {"top1": 0.5, "top2": 0.75, "top5": 1.0}
    # scale does not matter (cosine)
    assert zero_shot_accuracy(7 * images, classifier, labels, topk=(1,))["top1"] == 0.5


def test_retrieval_recall_hand_built():
    images = E[:3]
    # text 0 -> image 0 (exact), text 1 -> image 1 but closer to image 2, text 2 -> image 2
    texts = torch.stack([E[0], 0.6 * E[1] + 0.8 * E[2], E[2] + 0.1 * E[1]])
    r = retrieval_recall(images, texts, ks=(1, 2, 3))
    # image->text: image 0 -> text 0 first; image 1: texts by score 1 (0.6), 2 (0.0995) -> rank 1;
    # image 2: text 2 (0.995) then text 1 (0.8) -> rank 1
    assert r["image_to_text_R@1"] == pytest.approx(1.0)
    # text->image: text 0 ok; text 1 prefers image 2 (0.8 > 0.6): rank 2; text 2 ok
    assert r["text_to_image_R@1"] == pytest.approx(2 / 3)
    assert r["text_to_image_R@2"] == pytest.approx(1.0)


def test_retrieval_recall_several_captions_per_image():
    images = E[:2]
    texts = torch.stack([E[1], E[0], E[0] + E[1]])  # texts 0 and 1 describe image 0
    text_to_image = torch.tensor([0, 0, 1])
    r = retrieval_recall(images, texts, text_to_image, ks=(1, 2))
    # image 0: its best text (text 1, cosine 1) is first; image 1: text 0 (1.0) beats text 2 (0.71)
    assert r["image_to_text_R@1"] == 0.5 and r["image_to_text_R@2"] == 1.0
    # text 0 is closer to image 1; text 1 hits; text 2 ties both images (a tie counts as a miss)
    assert r["text_to_image_R@1"] == pytest.approx(1 / 3) and r["text_to_image_R@2"] == 1.0


def test_retrieval_recall_ties_count_against_the_positive():
    same = torch.ones(5, 4)
    r = retrieval_recall(same, same, ks=(1, 5))
    assert r["image_to_text_R@1"] == 0.0 and r["text_to_image_R@1"] == 0.0
    assert r["image_to_text_R@5"] == 1.0  # 4 negatives tie: rank 4 < 5


def test_retrieval_recall_with_a_positive_mask_and_chunks():
    torch.manual_seed(0)
    images, texts = torch.randn(37, 8), torch.randn(41, 8)
    labels_i, labels_t = torch.randint(0, 4, (37,)), torch.randint(0, 4, (41,))
    positives = labels_i.view(-1, 1) == labels_t.view(1, -1)
    a = retrieval_recall(images, texts, positives=positives, ks=(1, 3))
    b = retrieval_recall(images, texts, positives=positives, ks=(1, 3), chunk_size=5)
    assert a == b
    # brute force with argsort for R@1
    sims = F.normalize(images, dim=1) @ F.normalize(texts, dim=1).T
    assert a["image_to_text_R@1"] == pytest.approx(positives[torch.arange(37), sims.argmax(1)].float().mean().item())
    assert a["text_to_image_R@1"] == pytest.approx(positives[sims.argmax(0), torch.arange(41)].float().mean().item())


def test_retrieval_recall_errors():
    with pytest.raises(ValueError, match="text_to_image"):
        retrieval_recall(torch.randn(3, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="indices"):
        retrieval_recall(torch.randn(3, 4), torch.randn(2, 4), torch.tensor([0, 3]))


def test_evaluate_clip_end_to_end():
    from ds_infcl.adapters.clip import ClipModel
    from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer

    captions = ["a handwritten 0", "a handwritten 1", "the digit zero", "the digit one"]
    tok = CaptionTokenizer.train(captions, context_length=16)
    torch.manual_seed(0)
    model = ClipModel.from_architecture("tiny", tok)
    model.train()
    batches = [
        {"image": torch.randn(3, 3, 32, 32), "text": captions[:3], "label": torch.tensor([0, 1, 0])},
        {"image": torch.randn(1, 3, 32, 32), "text": captions[3:], "label": torch.tensor([1])},
    ]
    m = evaluate_clip(model, batches, tok, class_names=[["0", "zero"], ["1", "one"]],
                      templates=["a handwritten {}", "the digit {}"])
    assert model.training  # restored
    assert m["num_images"] == 4
    for key in ("zero_shot_top1", "image_to_text_R@1", "text_to_image_R@10", "label_image_to_text_R@1"):
        assert 0.0 <= m[key] <= 1.0
    assert m["image_to_text_R@10"] == 1.0  # 4 texts
