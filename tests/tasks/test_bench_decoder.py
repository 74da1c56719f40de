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


def test_model_flops_formula_matches_torchs_counter():
    # The task's FLOPs (6 N + 12 L H T per token) against 3 x the forward that torch's counter
    # counts on the same towers with eager attention (plain matmuls it can count).
    from torch.utils.flop_counter import FlopCounterMode

    task = get_task("bench_decoder", {"arch": "tiny", "seq_len": 12, "num_negatives": 2,
                                      "gradient_checkpointing": False, "attn_implementation": "eager"})
    towers = task.build_towers().eval()
    index = torch.tensor([5])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        towers.encode_query(index)
        towers.encode_key(index.repeat_interleave(3))
    assert task.model_flops_per_sample() == 3 * counter.get_total_flops()
