"""The sentence-transformers loss inside ``SentenceTransformerTrainer`` in DeepSpeed mode
(ZeRO-2, 2 gloo ranks on CPU, launched by the ``deepspeed`` launcher).

CachedMultipleNegativesRankingLoss stops there with "Gradient computed twice for this
partition" (its GradCache calls backward() once per mini-batch inside the trainer's backward);
ours checkpoints the mini-batches inside one autograd graph, so ZeRO sees one backward. Both
ranks must report the same (global) training loss.

Run by pytest; the same file is the per-rank script (``python thisfile STAGE OUT_DIR``).
"""

import os
import re
import sys

import pytest

pytestmark = pytest.mark.slow


def _rank_main(stage: int, out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.adapters.st_deepspeed_run import finish_rank, prepare_rank, tiny_model_and_triplets, training_args

    prepare_rank()
    from sentence_transformers import SentenceTransformerTrainer

    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    rank, model, data = tiny_model_and_triplets(out_dir)
    args = training_args(out_dir, {"stage": stage}, max_steps=2, learning_rate=1e-4)
    loss = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=4)
    result = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    print(f"\nRESULT rank{rank} loss {result.training_loss:.6f}", flush=True)
    finish_rank()


def test_st_trainer_deepspeed_zero2(tmp_path):
    from tests.adapters.st_deepspeed_run import launch_two_ranks

    out = launch_two_ranks(__file__, "2", str(tmp_path))
    losses = dict(re.findall(r"RESULT rank(\d) loss ([0-9.]+)", out))
    assert set(losses) == {"0", "1"}, out[-4000:]
    assert losses["0"] == losses["1"]  # the global loss on every rank


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    _rank_main(int(argv[0]), argv[1])
