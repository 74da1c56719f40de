"""``bench_decoder``: an LLM-embedder-sized retrieval task for throughput and memory benchmarks.

A random-initialized decoder built from a config (no download): ``qwen2-1.5b`` has the shape of
Qwen2-1.5B (28 layers, width 1536, 12 heads with 2 key/value heads, vocabulary 151,936), ``tiny``
a few-kB version for CPU tests. Each example is a query and ``1 + num_negatives`` documents of
``seq_len`` generated token ids (no padding), embedded by last-token pooling and L2-normalized, as
E5-Mistral / GTE-Qwen embedders are; the loss is one-directional InfoNCE with a fixed scale of 20.

As in ``bench_clip``, the token ids are generated on the device from the global sample indices
(a host batch is ``[b]`` int64 indices), deterministically, so GradCache's replay sees the same
inputs. ``lora`` trains LoRA adapters only (peft); ``gradient_checkpointing`` recomputes each
layer in the backward (non-reentrant, exact under GradCache's replay).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn

from ds_infcl.tasks.base import Batch, Task

__all__ = ["BenchDecoderTask", "DECODER_ARCHS"]

DECODER_ARCHS: Dict[str, Dict[str, Any]] = {
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=128),
}


class _GeneratedDecoderTowers(nn.Module):
    """One decoder shared by queries and documents (as the embedders are trained)."""

    def __init__(self, arch: str, seq_len: int, num_keys: int, lora: Optional[Dict[str, Any]],
                 gradient_checkpointing: bool, attn_implementation: str):
        super().__init__()
        from transformers import AutoModel, Qwen2Config

        config = Qwen2Config(**DECODER_ARCHS[arch])
        config._attn_implementation = attn_implementation
        model = AutoModel.from_config(config)
        if gradient_checkpointing:  # transformers >= 5 renamed it; older versions have the old name only
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=int(lora.get("r", 16)), lora_alpha=int(lora.get("alpha", 2 * int(lora.get("r", 16)))),
                lora_dropout=float(lora.get("dropout", 0.0)),
                target_modules=list(lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])),
            ))
        self.model = model
        self.seq_len = seq_len
        self.num_keys = num_keys
        self.vocab = config.vocab_size

    def _ids(self, index: torch.Tensor, salt: int) -> torch.Tensor:
        g = torch.Generator(device=index.device)
        g.manual_seed((int(index[0]) * 2654435761 + salt) % (2**61))
        ids = torch.randint(0, self.vocab - 1, (len(index), self.seq_len), generator=g, device=index.device)
        ids[:, -1] = self.vocab - 1  # an end-of-text token last: the pooled position
        return ids

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids).last_hidden_state
        return nn.functional.normalize(hidden[:, -1].float(), dim=-1).to(hidden.dtype)

    def encode_query(self, index: torch.Tensor) -> torch.Tensor:
        return self._embed(self._ids(index, 0))

    def encode_key(self, index: torch.Tensor) -> torch.Tensor:
        # ``index`` holds each query's index repeated once per key; a key's ids depend on its position.
        keys = index * self.num_keys + torch.arange(len(index), device=index.device) % self.num_keys
        return self._embed(self._ids(keys, 1))


class BenchDecoderTask(Task):
    """Random-init decoder embedder on generated token ids (see the module docstring).

    Args:
        arch: ``"qwen2-1.5b"`` or ``"tiny"``.
        seq_len: tokens per text (queries and documents).
        num_negatives: hard negatives per query (keys per query: ``1 + num_negatives``).
        lora: ``{"r", "alpha", "dropout", "target_modules"}`` to train LoRA adapters only.
        gradient_checkpointing: recompute each layer in the backward.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
    """

    name = "bench_decoder"

    def __init__(self, arch: str = "qwen2-1.5b", seq_len: int = 256, num_negatives: int = 1,
                 lora: Optional[Dict[str, Any]] = None, gradient_checkpointing: bool = True,
                 attn_implementation: str = "sdpa"):
        if arch not in DECODER_ARCHS:
            raise ValueError(f"arch must be one of {sorted(DECODER_ARCHS)}, got {arch!r}")
        if seq_len < 1 or seq_len > DECODER_ARCHS[arch]["max_position_embeddings"]:
            raise ValueError(f"seq_len must be in [1, {DECODER_ARCHS[arch]['max_position_embeddings']}], got {seq_len}")
        if num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
        self.arch, self.seq_len, self.num_negatives = arch, seq_len, num_negatives
        self.lora, self.gradient_checkpointing = lora, gradient_checkpointing
        self.attn_implementation = attn_implementation

    def build_towers(self) -> nn.Module:
        return _GeneratedDecoderTowers(self.arch, self.seq_len, 1 + self.num_negatives, self.lora,
                                       self.gradient_checkpointing, self.attn_implementation)

    def loss_defaults(self) -> Dict[str, Any]:
        return {"symmetric": False, "init_logit_scale": math.log(20.0), "learnable_scale": False}

    def model_flops_per_sample(self) -> float:
        """Training FLOPs of one example by the usual LLM formula (PaLM, appendix B): per token
        ``6 N + 12 L H T`` with ``N`` the non-embedding parameters, ``L`` layers, ``H`` width and
        ``T`` the sequence length (the attention scores counted in full). It is the full model's
        figure with LoRA too (which skips the weight gradients: about 4 N of work per token).
        torch's FLOP counter cannot count SDPA with grouped key/value heads on every version."""
        a = DECODER_ARCHS[self.arch]
        h, layers, inter = a["hidden_size"], a["num_hidden_layers"], a["intermediate_size"]
        kv = h * a["num_key_value_heads"] // a["num_attention_heads"]
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o; k, v; gate, up, down
        n = layers * per_layer
        return float(self.tokens_per_sample() * (6 * n + 12 * layers * h * self.seq_len))

    def recomputed_forward_fraction(self) -> float:
        """Gradient checkpointing recomputes every decoder layer's forward in the backward (the
        embeddings and the final norm, a small share of the FLOPs, are not)."""
        return 1.0 if self.gradient_checkpointing else 0.0

    def tokens_per_sample(self) -> int:
        """Tokens one example puts through the model (its query and its documents)."""
        return self.seq_len * (2 + self.num_negatives)

    def batches(self, *, rank, world_size, local_batch_size, start_step, seed) -> Iterator[Batch]:
        kpq = 1 + self.num_negatives
        step = start_step
        while True:
            start = step * local_batch_size * world_size + rank * local_batch_size
            index = torch.arange(start, start + local_batch_size, dtype=torch.long)
            yield Batch(query_inputs=index, key_inputs=index.repeat_interleave(kpq), sample_index=index,
                        keys_per_query=kpq)
            step += 1
