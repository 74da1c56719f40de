"""Shared pieces of the 2-rank sentence-transformers runs under the ``deepspeed`` launcher (gloo on
CPU): the per-rank set-up (tiny model, a 32-triplet dataset, the training arguments) and the
launch from pytest. Used by test_st_loss_deepspeed.py and test_st_zero3_save.py, whose files are
also the per-rank scripts.

The per-rank script puts the repository root on ``sys.path`` before importing this module.
"""

import os
import re
import signal
import socket
import subprocess
import sys


def prepare_rank() -> None:
    """Process set-up every rank does before deepspeed or sentence-transformers is imported."""
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the CPU shm op is not used


def tiny_model_and_triplets(out_dir: str):
    """(rank, model, dataset): this rank's tiny sentence-transformer (its own folder, written before
    torch.distributed starts) and 32 anchor/positive/negative text triplets, the same on every rank."""
    from datasets import Dataset

    from ds_infcl.adapters.retrieval import load_sentence_transformer
    from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

    rank = int(os.environ.get("RANK", 0))
    model_dir = make_tiny_model_dir(os.path.join(out_dir, f"tiny{rank}"))  # before torch.distributed
    model = load_sentence_transformer(model_dir)
    t = random_texts(96, 5)
    data = Dataset.from_dict({"anchor": t[:32], "positive": t[32:64], "negative_1": t[64:]})
    return rank, model, data


def training_args(out_dir: str, zero: dict, *, max_steps: int, learning_rate: float):
    """SentenceTransformerTrainingArguments for a DeepSpeed run on CPU with ``zero`` as the
    ``zero_optimization`` section (batch 8 per rank, torch AdamW, no saving, seed 0)."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    return SentenceTransformerTrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"), per_device_train_batch_size=8, max_steps=max_steps,
        learning_rate=learning_rate, deepspeed=ds_config, use_cpu=True, report_to="none", save_strategy="no",
        dataloader_drop_last=True, seed=0,
    )


def finish_rank() -> None:
    """End the rank as the trainer's entry points do: no gloo teardown at interpreter exit."""
    from ds_infcl.train.dist import exit_process, shutdown

    shutdown()
    exit_process(0)


def launch_two_ranks(script: str, *args: str) -> str:
    """Run ``script args...`` on 2 CPU ranks with the ``deepspeed`` launcher; assert it exited 0
    and that both ranks printed their ``RESULT rank<i>`` line; return the combined output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    # Its own session: on a timeout the whole job (the runner, deepspeed.launcher.launch and both
    # ranks) is killed, not only the runner (a hung rank would otherwise outlive the test).
    proc = subprocess.Popen(
        [launcher, "--num_gpus", "2", "--master_port", str(port), os.path.abspath(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("the 2-rank run did not end within 300 s; its last output:\n" + out[-4000:]) from None
    assert proc.returncode == 0, out[-4000:]
    assert set(re.findall(r"RESULT rank(\d) ", out)) == {"0", "1"}, out[-4000:]
    return out

