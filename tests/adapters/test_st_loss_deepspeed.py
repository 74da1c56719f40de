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
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _rank_main(stage: int, out_dir: str) -> None:
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the CPU shm op is not used
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from ds_infcl.adapters.retrieval import load_sentence_transformer
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss
    from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

    rank = int(os.environ.get("RANK", 0))
    model_dir = make_tiny_model_dir(os.path.join(out_dir, f"tiny{rank}"))  # before torch.distributed
    model = load_sentence_transformer(model_dir)
    t = random_texts(96, 5)
    data = Dataset.from_dict({"anchor": t[:32], "positive": t[32:64], "negative_1": t[64:]})
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"), per_device_train_batch_size=8, max_steps=2,
        learning_rate=1e-4, deepspeed=ds_config, use_cpu=True, report_to="none", save_strategy="no",
        dataloader_drop_last=True, seed=0,
    )
    loss = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=4)
    result = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
    print(f"\nRESULT rank{rank} loss {result.training_loss:.6f}", flush=True)
    from ds_infcl.train.dist import exit_process, shutdown

    shutdown()  # as the trainer's entry points: no gloo teardown at interpreter exit
    exit_process(0)


def test_st_trainer_deepspeed_zero2(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [launcher, "--num_gpus", "2", "--master_port", str(port), os.path.abspath(__file__), "2", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = dict(re.findall(r"RESULT rank(\d) loss ([0-9.]+)", out))
    assert set(losses) == {"0", "1"}, out[-4000:]
    assert losses["0"] == losses["1"]  # the global loss on every rank


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    _rank_main(int(argv[0]), argv[1])
