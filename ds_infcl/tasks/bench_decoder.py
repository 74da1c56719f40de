"""``bench_decoder``: an LLM-embedder-sized retrieval task for throughput and memory benchmarks.

A random-initialized decoder built from a config (no download): ``qwen2-1.5b`` has the shape of
Qwen2-1.5B (28 layers, width 1536, 12 heads with 2 key/value heads, vocabulary 151,936),
``qwen2-7b`` of Qwen2-7B (28 layers, width 3584, 28 heads with 4 key/value heads, MLP 18,944,
vocabulary 152,064, untied embeddings), ``mistral-7b`` of Mistral-7B-v0.1 (32 layers, width 4096,
32 heads with 8 key/value heads, MLP 14,336, vocabulary 32,000, rope theta 10,000); ``tiny``
(Qwen2) and ``tiny-mistral`` are few-kB versions for CPU tests. Each arch names its transformers
model type (``decoder_config``). ``init_device: "cuda"`` builds the decoder on the rank's GPU (a
7B model's random initialization takes minutes on a CPU). Each example is a query and ``1 + num_negatives`` documents of
``seq_len`` generated token ids (no padding), embedded by last-token pooling and L2-normalized, as
E5-Mistral / GTE-Qwen embedders are; the loss is one-directional InfoNCE with a fixed scale of 20.

As in ``bench_clip``, the token ids are generated on the device from the global sample indices
(a host batch is ``[b]`` int64 indices), deterministically, so GradCache's replay sees the same
inputs. ``lora`` trains LoRA adapters only (peft); ``gradient_checkpointing`` recomputes each
layer in the backward (non-reentrant, exact under GradCache's replay), ``"auto"`` only where a
forward's activations would not fit.

The decoder step's options (``ds_infcl.adapters.decoder_step``) switch on one at a time for a
"what each change gave" table: ``min_seq_len`` gives texts of varied lengths (right-padded),
``packing`` packs them into rows without padding, ``liger`` patches in Liger-Kernel's fused
RMSNorm, SwiGLU and RoPE; the run config's ``model.compile`` compiles the decoder layers. The
model FLOPs count real tokens only (``decoder_step.decoder_flops``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import nn

from ds_infcl.adapters.decoder_step import LayerCheckpointing, apply_liger, decoder_flops, pack_texts, pool_packed, pool_padded
from ds_infcl.errors import ConfigError
from ds_infcl.tasks.base import Batch, Task
from ds_infcl.tasks.bench import hashed_ints

__all__ = ["BenchDecoderTask", "DECODER_ARCHS", "decoder_config", "build_decoder"]

# Each arch: its transformers ``model_type`` and the config's arguments (``decoder_config``).
DECODER_ARCHS: Dict[str, Dict[str, Any]] = {
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                     rope_theta=1000000.0, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                       rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False),
    "tiny": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=128),
    "tiny-mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, vocab_size=300, max_position_embeddings=128,
                         sliding_window=4096, tie_word_embeddings=False),
}


def decoder_config(arch: str):
    """The transformers config of ``DECODER_ARCHS[arch]`` (``AutoConfig.for_model`` of its model
    type: ``Qwen2Config``, ``MistralConfig``); no download."""
    from transformers import AutoConfig

    args = dict(DECODER_ARCHS[arch])
    return AutoConfig.for_model(args.pop("model_type"), **args)


def build_decoder(arch: str, attn_implementation: str = "sdpa", device: Optional[str] = None):
    """A random-initialized ``AutoModel`` (no LM head) of ``arch``, built on ``device`` (default:
    torch's default device; ``"cuda"``: the current GPU, where a 7B model initializes in seconds)."""
    from transformers import AutoModel

    config = decoder_config(arch)
    config._attn_implementation = attn_implementation
    if device is None:
        return AutoModel.from_config(config)
    with torch.device(device):
        return AutoModel.from_config(config)


class _GeneratedDecoderTowers(nn.Module):
    """One decoder shared by queries and documents (as the embedders are trained)."""

    def __init__(self, task: "BenchDecoderTask"):
        super().__init__()
        model = build_decoder(task.arch, task.attn_implementation, None if task.init_device == "cpu" else task.init_device)
        config = model.config
        if task.liger:
            apply_liger(model)
        self.checkpointing = LayerCheckpointing(model, task.gradient_checkpointing) \
            if task.gradient_checkpointing is not False else None
        lora = task.lora
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=int(lora.get("r", 16)), lora_alpha=int(lora.get("alpha", 2 * int(lora.get("r", 16)))),
                lora_dropout=float(lora.get("dropout", 0.0)),
                target_modules=list(lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])),
            ))
        self.model = model
        self.seq_len, self.min_seq_len = task.seq_len, task.min_seq_len
        self.num_keys = 1 + task.num_negatives
        self.vocab = config.vocab_size
        self.packing, self.pack_rows_multiple = task.packing, task.pack_rows_multiple

    def _ids(self, index: torch.Tensor, salt: int):
        """``[n, seq_len]`` ids, right-padded with 0 past each text's length, the length's last
        token an end-of-text id (the pooled position), and the ``[n, seq_len]`` attention mask
        (``None`` when every text has ``seq_len`` tokens)."""
        ids = hashed_ints(index, self.seq_len, self.vocab - 1, salt=2 * salt)  # no host read (tasks/bench.py)
        if self.min_seq_len == self.seq_len:
            ids[:, -1] = self.vocab - 1
            return ids, None
        lengths = self.min_seq_len + hashed_ints(index, 1, self.seq_len - self.min_seq_len + 1, salt=2 * salt + 1)[:, 0]
        cols = torch.arange(self.seq_len, device=index.device)
        mask = (cols[None, :] < lengths[:, None]).long()
        ids = torch.where(cols[None, :] == lengths[:, None] - 1, self.vocab - 1, ids * mask)
        return ids, mask

    def _embed(self, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        if self.packing:
            packed = pack_texts(ids, mask, row_tokens=self.seq_len, rows_multiple=self.pack_rows_multiple)
            if self.checkpointing is not None:
                self.checkpointing.decide(packed.input_ids.numel(), ids.device, dtype)
            hidden = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                use_cache=False).last_hidden_state
            pooled = pool_packed(hidden, packed, "lasttoken")
        else:
            if self.checkpointing is not None:
                self.checkpointing.decide(ids.numel(), ids.device, dtype)
            hidden = self.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            pooled = pool_padded(hidden, mask, "lasttoken")
        return nn.functional.normalize(pooled.float(), dim=-1).to(hidden.dtype)

    def encode_query(self, index: torch.Tensor) -> torch.Tensor:
        return self._embed(*self._ids(index, 0))

    def encode_key(self, index: torch.Tensor) -> torch.Tensor:
        # ``index`` holds each query's index repeated once per key; a key's ids depend on its position.
        keys = index * self.num_keys + torch.arange(len(index), device=index.device) % self.num_keys
        return self._embed(*self._ids(keys, 1))


class BenchDecoderTask(Task):
    """Random-init decoder embedder on generated token ids (see the module docstring).

    Args:
        arch: a key of ``DECODER_ARCHS``: ``"qwen2-1.5b"``, ``"qwen2-7b"``, ``"mistral-7b"``,
            ``"tiny"``, ``"tiny-mistral"``.
        seq_len: tokens per text (queries and documents); the longest text with ``min_seq_len``.
        min_seq_len: shortest text (default ``seq_len``: every text has ``seq_len`` tokens, no
            padding). Below ``seq_len``, each text's length is drawn uniformly from ``[min_seq_len,
            seq_len]`` (from its index, so replays see it again) and the batch is right-padded: the
            padding that ``packing`` removes.
        num_negatives: hard negatives per query (keys per query: ``1 + num_negatives``).
        lora: ``{"r", "alpha", "dropout", "target_modules"}`` to train LoRA adapters only.
        gradient_checkpointing: ``True`` (default): recompute each layer in the backward; ``False``;
            ``"auto"``: only in the forwards whose activations would not fit the free device memory
            (``ds_infcl.adapters.decoder_step.LayerCheckpointing``, logged).
        attn_implementation: ``"sdpa"`` (default), ``"eager"`` or ``"flash_attention_2"`` (needs the
            flash-attn package).
        packing: pack each chunk's texts into rows of ``seq_len`` tokens without padding
            (``decoder_step.pack_texts``); ``pack_rows_multiple`` rounds the rows up (default 8).
        liger: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (``pip install liger-kernel``, CUDA).
        init_device: ``"cpu"`` (default) or ``"cuda"``: where the decoder is built and randomly
            initialized (the same seed gives every rank the same weights either way; DeepSpeed
            also broadcasts rank 0's).
    """

    name = "bench_decoder"

    def __init__(self, arch: str = "qwen2-1.5b", seq_len: int = 256, num_negatives: int = 1,
                 lora: Optional[Dict[str, Any]] = None, gradient_checkpointing: Union[bool, str] = True,
                 attn_implementation: str = "sdpa", min_seq_len: Optional[int] = None, packing: bool = False,
                 pack_rows_multiple: int = 8, liger: bool = False, init_device: str = "cpu"):
        if arch not in DECODER_ARCHS:
            raise ValueError(f"arch must be one of {sorted(DECODER_ARCHS)}, got {arch!r}")
        if seq_len < 1 or seq_len > DECODER_ARCHS[arch]["max_position_embeddings"]:
            raise ValueError(f"seq_len must be in [1, {DECODER_ARCHS[arch]['max_position_embeddings']}], got {seq_len}")
        if num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
        min_seq_len = seq_len if min_seq_len is None else min_seq_len
        if not 1 <= min_seq_len <= seq_len:
            raise ConfigError(f"task.args.min_seq_len: in [1, seq_len={seq_len}], got {min_seq_len}")
        if gradient_checkpointing not in (True, False, "auto"):
            raise ConfigError(f"task.args.gradient_checkpointing: true, false or \"auto\", got {gradient_checkpointing!r}")
        for key, value in (("packing", packing), ("liger", liger)):
            if not isinstance(value, bool):
                raise ConfigError(f"task.args.{key}: true or false, got {value!r}")
        if init_device not in ("cpu", "cuda"):
            raise ConfigError(f"task.args.init_device: \"cpu\" or \"cuda\", got {init_device!r}")
        if init_device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("task.args.init_device: \"cuda\" needs a CUDA device; none is visible (use \"cpu\")")
        self.init_device = init_device
        self.arch, self.seq_len, self.min_seq_len, self.num_negatives = arch, seq_len, min_seq_len, num_negatives
        self.lora, self.gradient_checkpointing = lora, gradient_checkpointing
        self.attn_implementation = attn_implementation
        self.packing, self.pack_rows_multiple, self.liger = packing, int(pack_rows_multiple), liger

    def build_towers(self) -> nn.Module:
        return _GeneratedDecoderTowers(self)

    def loss_defaults(self) -> Dict[str, Any]:
        return {"symmetric": False, "init_logit_scale": math.log(20.0), "learnable_scale": False}

    def matmul_params(self) -> int:
        """``N``: the weights of the decoder blocks' linear layers (q, o: width x the heads' width;
        k, v: width x the key/value heads' width; the gated MLP's three). Embeddings, norms and
        biases are not counted (``decoder_step.decoder_matmul_params`` counts a built model)."""
        c = decoder_config(self.arch)
        h, inter = c.hidden_size, c.intermediate_size
        head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        return c.num_hidden_layers * (h * q * 2 + h * kv * 2 + 3 * h * inter)

    def model_flops_per_sample(self) -> float:
        """Training FLOPs of one example by the LLM formula (``decoder_step.decoder_flops``; with
        every text ``seq_len`` long, ``6 N + 12 L H T`` per token as in PaLM's appendix B): the
        expected value over the uniform lengths when ``min_seq_len < seq_len``, real tokens only. It
        is the full model's figure with LoRA too (which skips the weight gradients: about 4 N of work
        per token). torch's FLOP counter cannot count SDPA with grouped key/value heads on every
        version."""
        lo, hi = self.min_seq_len, self.seq_len
        mean = (lo + hi) / 2
        mean_sq = mean * mean + ((hi - lo + 1) ** 2 - 1) / 12  # E[l^2] of the uniform integers lo..hi
        texts = 2 + self.num_negatives
        return decoder_flops(decoder_config(self.arch), self.matmul_params(), texts * mean, texts * mean_sq)

    def tokens_per_sample(self) -> float:
        """Real tokens one example puts through the model (its query and its documents), expected."""
        return (self.seq_len + self.min_seq_len) / 2 * (2 + self.num_negatives)

    def recomputed_forward_fraction(self) -> float:
        """Layer checkpointing recomputes every decoder layer's forward in the backward (the
        embeddings and the final norm, a small share of the FLOPs, are not). With ``"auto"`` the
        choice is made per forward, so HFU counts no recompute there (a lower bound)."""
        return 1.0 if self.gradient_checkpointing is True else 0.0

    def batches(self, *, rank, world_size, local_batch_size, start_step, seed) -> Iterator[Batch]:
        kpq = 1 + self.num_negatives
        step = start_step
        while True:
            start = step * local_batch_size * world_size + rank * local_batch_size
            index = torch.arange(start, start + local_batch_size, dtype=torch.long)
            yield Batch(query_inputs=index, key_inputs=index.repeat_interleave(kpq), sample_index=index,
                        keys_per_query=kpq)
            step += 1
