"""``ds_infcl.adapters.st_trainer.SentenceTransformerTrainer`` under DeepSpeed ZeRO-3 (2 gloo ranks
on CPU, the ``deepspeed`` launcher): ``save_model`` called on every rank writes a folder that
``SentenceTransformer(path)`` loads with the trained weights (sentence-transformers' own trainer
writes the ``[0]``-shaped partition placeholders there).

Run by pytest; the same file is the per-rank script (``python thisfile OUT_DIR``).
"""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _rank_main(out_dir: str) -> None:
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the CPU shm op is not used
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import deepspeed
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainingArguments

    from ds_infcl.adapters.retrieval import load_sentence_transformer
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss
    from ds_infcl.adapters.st_trainer import SentenceTransformerTrainer
    from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

    rank = int(os.environ.get("RANK", 0))
    model_dir = make_tiny_model_dir(os.path.join(out_dir, f"tiny{rank}"))  # before torch.distributed
    model = load_sentence_transformer(model_dir)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = random_texts(96, 5)
    data = Dataset.from_dict({"anchor": t[:32], "positive": t[32:64], "negative_1": t[64:]})
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"), per_device_train_batch_size=8, max_steps=3,
        learning_rate=1e-3, deepspeed=ds_config, use_cpu=True, report_to="none", save_strategy="no",
        dataloader_drop_last=True, seed=0,
    )
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
    from ds_infcl.train.dist import exit_process, shutdown

    shutdown()
    exit_process(0)


def test_zero3_saved_model_reloads_with_the_trained_weights(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [launcher, "--num_gpus", "2", "--master_port", str(port), os.path.abspath(__file__), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
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
