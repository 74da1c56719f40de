"""The ``bench_decoder`` task (an LLM-embedder-shaped benchmark): generated inputs are a function
of the indices (GradCache replays them), keys follow their queries, LoRA trains adapters only."""

import pytest
import torch

from ds_infcl.tasks.base import get_task


def test_batches_towers_and_lora():
    task = get_task("bench_decoder", {"arch": "tiny", "seq_len": 12, "num_negatives": 2,
                                      "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    batch = next(task.batches(rank=1, world_size=2, local_batch_size=3, start_step=2, seed=0))
    assert batch.sample_index.tolist() == [15, 16, 17] and batch.keys_per_query == 3
    assert batch.key_inputs.tolist() == [15, 15, 15, 16, 16, 16, 17, 17, 17]
    towers = task.build_towers().eval()
    q = towers.encode_query(batch.query_inputs)
    k = towers.encode_key(batch.key_inputs)
    assert q.shape == (3, 32) and k.shape == (9, 32)
    assert torch.allclose(q.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.equal(towers.encode_key(batch.key_inputs), k)  # the same inputs again (replay)
    assert not torch.equal(k[0], k[1])  # a query's documents differ
    trainable = [n for n, p in towers.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert task.tokens_per_sample() == 12 * 4
    with pytest.raises(ValueError, match="arch must be one of"):
        get_task("bench_decoder", {"arch": "llama-70b"})


@pytest.mark.parametrize("arch", ["tiny", "tiny-mistral"])
def test_model_flops_formula_matches_torchs_counter(arch):
    # The task's FLOPs (6 N + 12 L H T per token) against 3 x the forward that torch's counter
    # counts on the same towers with eager attention (plain matmuls it can count); tiny-mistral has
    # one key/value head for four query heads and a MistralConfig.
    from torch.utils.flop_counter import FlopCounterMode

    task = get_task("bench_decoder", {"arch": arch, "seq_len": 12, "num_negatives": 2,
                                      "gradient_checkpointing": False, "attn_implementation": "eager"})
    towers = task.build_towers().eval()
    index = torch.tensor([5])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        towers.encode_query(index)
        towers.encode_key(index.repeat_interleave(3))
    assert task.model_flops_per_sample() == 3 * counter.get_total_flops()


# The 7B shapes are built on the meta device only: parameters with shapes and no storage.
SEVEN_B = {
    # arch: (model class, parameters without an LM head, N by hand)
    "qwen2-7b": ("Qwen2Model", 7_070_619_136, 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)),
    "mistral-7b": ("MistralModel", 7_110_660_096, 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)),
}


@pytest.mark.parametrize("arch", sorted(SEVEN_B))
def test_7b_shapes_and_flops(arch):
    from ds_infcl.adapters.decoder_step import decoder_matmul_params
    from ds_infcl.tasks.bench_decoder import build_decoder

    cls, total, n = SEVEN_B[arch]
    model = build_decoder(arch, device="meta")
    assert type(model).__name__ == cls and next(model.parameters()).is_meta
    assert sum(p.numel() for p in model.parameters()) == total  # the published sizes less the LM head
    task = get_task("bench_decoder", {"arch": arch, "seq_len": 256, "num_negatives": 1})
    assert task.matmul_params() == decoder_matmul_params(model) == n
    c = model.config
    assert c.rope_parameters["rope_theta"] == (1e6 if arch == "qwen2-7b" else 1e4)
    assert not c.tie_word_embeddings
    per_token = 6 * n + 12 * c.num_hidden_layers * c.hidden_size * 256  # PaLM: 6 N + 12 L H T
    assert task.model_flops_per_sample() == 3 * 256 * per_token
    assert task.tokens_per_sample() == 768


@pytest.mark.parametrize("arch", sorted(SEVEN_B))
def test_7b_zero3_gather_rule(arch, monkeypatch):
    # What batch.gather_params "auto" chooses for the 7B shapes on an 80 GB H100 (bf16, ZeRO-3,
    # GradCache): full training needs the bf16 parameters (14 GB) and float32 gradient buffers
    # (28 GB) per rank, over the quarter of the device -> ZeRO-3's per-chunk path; LoRA only the
    # bf16 parameters -> gathered once per step.
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from ds_infcl.tasks.bench_decoder import build_decoder
    from ds_infcl.train import zero3_gather

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=81559 * 2**20))
    decide = lambda model: zero3_gather.rule("auto", grad_cache=True, stage=3, fp16=False, nvme_params=False,
                                             model=model, device=torch.device("cuda", 0))
    full = build_decoder(arch, device="meta").to(torch.bfloat16)
    gathered, why = decide(full)
    assert not gathered and "over 25%" in why
    assert zero3_gather.gather_bytes(full) == 6 * SEVEN_B[arch][1]
    lora = get_peft_model(full, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    gathered, why = decide(lora)
    assert gathered and "within 25%" in why
    assert zero3_gather.gather_bytes(lora) < 2.1 * SEVEN_B[arch][1]


def test_init_device_errors():
    with pytest.raises(Exception, match="init_device"):
        get_task("bench_decoder", {"arch": "tiny", "seq_len": 8, "init_device": "tpu"})
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="needs a CUDA device"):
            get_task("bench_decoder", {"arch": "tiny", "seq_len": 8, "init_device": "cuda"})
