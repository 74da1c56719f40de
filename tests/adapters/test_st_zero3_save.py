"""``ds_infcl.adapters.st_trainer.SentenceTransformerTrainer`` under DeepSpeed ZeRO-3 (2 gloo ranks
on CPU, the ``deepspeed`` launcher): ``save_model`` called on every rank writes a folder that
``SentenceTransformer(path)`` loads with the trained weights (sentence-transformers' own trainer
writes the ``[0]``-shaped partition placeholders there).

Run by pytest; the same file is the per-rank script (``python thisfile OUT_DIR``).
"""

import os
import re
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _rank_main(out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.adapters.st_deepspeed_run import finish_rank, prepare_rank, tiny_model_and_triplets, training_args

    prepare_rank()
    import deepspeed

    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss
    from ds_infcl.adapters.st_trainer import SentenceTransformerTrainer

    rank, model, data = tiny_model_and_triplets(out_dir)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    args = training_args(out_dir, zero, max_steps=3, learning_rate=1e-3)
    loss = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=4)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    saved = os.path.join(out_dir, "saved")
    trainer.save_model(saved)  # every rank, as a user's script does
    params = dict(trainer.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        trained = {k: p.detach().float().clone() for k, p in params.items()}
    if rank == 0:
        torch.save({"trained": trained, "initial": initial}, os.path.join(out_dir, "weights.pt"))
        try:
            trainer._save(os.path.join(out_dir, "no_gather"), state_dict={})
        except ValueError as e:
            print(f"\nNO_GATHER {e}", flush=True)
    print(f"\nRESULT rank{rank} ok", flush=True)
    finish_rank()


def test_zero3_saved_model_reloads_with_the_trained_weights(tmp_path):
    from tests.adapters.st_deepspeed_run import launch_two_ranks

    out = launch_two_ranks(__file__, str(tmp_path))
    assert set(re.findall(r"RESULT rank(\d) ok", out)) == {"0", "1"}, out[-4000:]
    assert "stage3_gather_16bit_weights_on_model_save" in re.search(r"NO_GATHER (.*)", out).group(1)
    assert not (tmp_path / "no_gather" / "model.safetensors").exists()

    from sentence_transformers import SentenceTransformer

    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    reloaded = dict(SentenceTransformer(str(tmp_path / "saved"), device="cpu").named_parameters())
    assert set(reloaded) == set(weights["trained"])
    for name, trained in weights["trained"].items():
        assert reloaded[name].shape == trained.shape, name
        torch.testing.assert_close(reloaded[name].detach().float(), trained, rtol=0, atol=0, msg=name)
    moved = [n for n, w in weights["trained"].items() if not torch.equal(w, weights["initial"][n].float())]
    assert len(moved) > len(weights["trained"]) // 2  # it trained: the comparison is not of initial weights


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    _rank_main(argv[0])
