"""sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with peft LoRA on a decoder of
``bench_decoder``'s shapes: the peer row of the LLM-embedder benchmark, one GPU, no DeepSpeed.

    python -m ds_infcl.bench.st_cached --arch qwen2-7b --batch 512 --mini-batch 16 --seq-len 256 \\
        --steps 2 --lora-r 16 --out runs/st_cached

The model is what a sentence-transformers user trains: ``SentenceTransformer(modules=[decoder,
Pooling("lasttoken"), Normalize()])``, with the decoder a random-initialized transformers
``AutoModel`` of ``bench_decoder.DECODER_ARCHS[arch]`` (no download, no tokenizer) behind a minimal
module that puts its last hidden state in ``features["token_embeddings"]`` (the contract of
sentence-transformers' ``Transformer`` module). ``--lora-r`` > 0 wraps the decoder with peft's
``get_peft_model`` (adapters on q, k, v, o as ``bench_decoder``'s default; what
``SentenceTransformer.add_adapter`` does through transformers), ``--lora-r 0`` trains every weight.
The base weights are bfloat16 with LoRA (the adapters stay float32: peft's
``autocast_adapter_dtype``), float32 for full training; the step runs under bf16 autocast
(``--precision fp32`` turns it off), with torch's AdamW over the trainable parameters, as
sentence-transformers' trainer does with ``bf16=True``.

Each step is ``--batch`` queries, their positives and ``--num-negatives`` hard negatives of
``--seq-len`` generated token ids (no padding, the last an end-of-text id), scale 20 and the
in-batch negatives of CachedMNRL (GradCache over mini-batches of ``--mini-batch`` texts per
column). ``--warmup-steps`` steps at ``--warmup-batch`` (default 2 mini-batches) come first (CUDA
context, kernel choice, allocator); the ``--steps`` timed steps follow at ``--batch``, and their
median step time gives samples/s and tokens/s (per GPU: one GPU), MFU and HFU by the same model
FLOPs as ``bench_decoder`` (the full model's 6 N per token also with LoRA; HFU adds CachedMNRL's
replay of every mini-batch and layer checkpointing's recompute with ``--gradient-checkpointing``),
and the peak device memory of the timed steps.

Reported: ``<out>/summary.json`` and the last printed line (``[st_cached] {json}``); a run that
runs out of memory reports ``status: "oom"`` (exit code 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List, Optional

import torch
from torch import nn

__all__ = ["DecoderModule", "build_model", "make_features", "make_loss", "run", "main", "case_command", "engine_row"]


class DecoderModule(nn.Module):
    """The first module of the sentence-transformers model: ``features`` (``input_ids``,
    ``attention_mask``) in, ``features`` with ``token_embeddings`` (the decoder's last hidden
    state) out, as sentence-transformers' ``Transformer`` module does for a loaded model."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, features: Dict[str, torch.Tensor], **kwargs) -> Dict[str, torch.Tensor]:
        out = self.decoder(input_ids=features["input_ids"], attention_mask=features.get("attention_mask"),
                           use_cache=False)
        features["token_embeddings"] = out.last_hidden_state
        return features

    def get_sentence_embedding_dimension(self) -> int:
        return self.decoder.config.hidden_size


def build_model(arch: str, *, lora_r: int, lora_alpha: Optional[int] = None, model_dtype: torch.dtype,
                device: torch.device, gradient_checkpointing: bool = False, attn_implementation: str = "sdpa"):
    """The ``SentenceTransformer`` (module docstring) on ``device``, built there (a 7B model's random
    initialization takes seconds on a GPU, minutes on a CPU); the trainable parameters are the
    LoRA adapters when ``lora_r`` > 0."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling

    from ds_infcl.tasks.bench_decoder import build_decoder

    decoder = build_decoder(arch, attn_implementation, device=str(device)).to(model_dtype)
    if gradient_checkpointing:
        decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_r > 0:
        from peft import LoraConfig, get_peft_model

        decoder = get_peft_model(decoder, LoraConfig(r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float32 build's blocks, before the bf16 copy's
    width = decoder.config.hidden_size
    return SentenceTransformer(modules=[DecoderModule(decoder), Pooling(width, pooling_mode="lasttoken"), Normalize()],
                               device=str(device))


def make_features(gen: torch.Generator, batch: int, seq_len: int, vocab: int, columns: int,
                  device: torch.device) -> List[Dict[str, torch.Tensor]]:
    """``columns`` tokenized columns (queries, positives, hard negatives) of ``batch`` texts of
    ``seq_len`` random ids each, the last one the end-of-text id ``vocab - 1``."""
    out = []
    for _ in range(columns):
        ids = torch.randint(0, vocab - 1, (batch, seq_len), generator=gen)
        ids[:, -1] = vocab - 1
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)})
    return out


def make_loss(model, cached: bool, mini_batch: int):
    """sentence-transformers' CachedMNRL (``cached``) or plain MNRL, scale 20."""
    from sentence_transformers.sentence_transformer import losses

    if cached:
        return losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini_batch)
    return losses.MultipleNegativesRankingLoss(model, scale=20.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(loss_fn, opt, params, features, autocast) -> float:
    """One training step as sentence-transformers' trainer runs it; returns the loss."""
    opt.zero_grad(set_to_none=True)
    with autocast:  # CachedMNRL re-encodes in its backward: under the same autocast
        loss = loss_fn([dict(f) for f in features], None)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach())


def _utilization(args, samples_per_s: float, device: torch.device) -> Dict[str, Optional[float]]:
    from ds_infcl.tasks.base import get_task
    from ds_infcl.train.metrics import peak_tflops, utilization

    task = get_task("bench_decoder", {"arch": args.arch, "seq_len": args.seq_len, "num_negatives": args.num_negatives})
    flops = task.model_flops_per_sample()
    # CachedMNRL replays every mini-batch (its pass 1 has no graph); checkpointing recomputes the layers
    util = utilization(flops, samples_per_s, 1, peak_tflops(device), 1.0, 1.0 if args.gradient_checkpointing else 0.0)
    return {"model_flops_per_sample": flops, "tokens_per_sample": task.tokens_per_sample(), **util}


def run(args) -> Dict[str, object]:
    """Build, warm up, time; the summary (module docstring)."""
    import peft
    import sentence_transformers
    import transformers

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.model_dtype if args.model_dtype != "auto" else ("bf16" if args.lora_r > 0 else "fp32")]
    model = build_model(args.arch, lora_r=args.lora_r, model_dtype=model_dtype, device=device,
                        gradient_checkpointing=args.gradient_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=device.type == "cuda")
    loss_fn = make_loss(model, True, args.mini_batch)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    vocab, columns = model[0].decoder.config.vocab_size, 2 + args.num_negatives
    gen = torch.Generator().manual_seed(args.seed)
    summary: Dict[str, object] = {
        "arch": args.arch, "global_batch": args.batch, "mini_batch_size": args.mini_batch, "seq_len": args.seq_len,
        "num_negatives": args.num_negatives, "lora_r": args.lora_r, "model_dtype": str(model_dtype).split(".")[-1],
        "precision": args.precision, "gradient_checkpointing": args.gradient_checkpointing, "steps": args.steps,
        "trainable_params": sum(p.numel() for p in params), "device": _device_name(device),
        "versions": {"sentence_transformers": sentence_transformers.__version__, "peft": peft.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
    }
    times, losses = [], []
    try:
        for _ in range(args.warmup_steps):
            _step(loss_fn, opt, params, make_features(gen, args.warmup_batch or 2 * args.mini_batch, args.seq_len,
                                                      vocab, columns, device), autocast)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.steps):
            features = make_features(gen, args.batch, args.seq_len, vocab, columns, device)
            _sync(device)
            t0 = time.perf_counter()
            losses.append(_step(loss_fn, opt, params, features, autocast))
            _sync(device)
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        summary.update(status="oom", peak_mem_gib=_peak_gib(device))
        return summary
    step_s = sorted(times)[len(times) // 2]
    sps = args.batch / step_s
    util = _utilization(args, sps, device)
    summary.update(status="ok", step_time_s=step_s, step_times_s=times, samples_per_s_per_gpu=sps,
                   tokens_per_s_per_gpu=sps * util["tokens_per_sample"], losses=losses,
                   peak_mem_gib=_peak_gib(device), **util)
    return summary


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def case_command(python: str, *, arch: str, seq_len: int, num_negatives: int, batch: int, mini_batch: int,
                 steps: int, lora_r: int, out: str) -> List[str]:
    """The command line of one case (``ds_infcl.bench.engine``'s ``st_cached`` rows)."""
    return [python, "-m", "ds_infcl.bench.st_cached", "--arch", arch, "--seq-len", str(seq_len), "--num-negatives",
            str(num_negatives), "--batch", str(batch), "--mini-batch", str(mini_batch), "--steps", str(steps),
            "--lora-r", str(lora_r), "--out", out]


def engine_row(args, launch, case_row, read_summary) -> Dict[str, object]:
    """The ``st_cached`` row of ``ds_infcl.bench.engine`` (its ``args``; its ``_launch``,
    ``_case_row`` and ``_summary``): this command on the first visible GPU with the decoder task's
    arch, seq_len, hard negatives and LoRA rank (``--st-lora-r`` when the task trains every weight)."""
    import shutil
    import sys

    task = json.loads(args.task_args) if args.task_args else {}
    lora_r = int((task.get("lora") or {}).get("r", args.st_lora_r))
    out = os.path.join(args.out, f"st_cached_{args.st_batch}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = case_command(sys.executable, arch=task.get("arch", "qwen2-1.5b"), seq_len=int(task.get("seq_len", 256)),
                       num_negatives=int(task.get("num_negatives", 1)), batch=args.st_batch, mini_batch=args.st_mini_batch,
                       steps=args.st_steps, lora_r=lora_r, out=out)
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    status, wall, text = launch(cmd, os.path.join(out, "log.txt"), args.case_timeout, env_extra={"CUDA_VISIBLE_DEVICES": gpu})
    s = read_summary(out) if status == "ok" else {}
    row = case_row(s.get("status", status), wall, impl=f"st_cached_mnrl+peft_r{lora_r}", phase="st_cached",
                   global_batch=args.st_batch, gpus=1, chunk=args.st_mini_batch, steps=args.st_steps)
    if s.get("status") == "ok":
        sps, tps = s["samples_per_s_per_gpu"], s["tokens_per_s_per_gpu"]
        row.update(samples_per_s=round(sps, 2), samples_per_s_per_gpu=round(sps, 2), tokens_per_s=round(tps),
                   tokens_per_s_per_gpu=round(tps), step_time_s=round(s["step_time_s"], 3),
                   peak_mem_gib="" if s["peak_mem_gib"] is None else round(s["peak_mem_gib"], 2))
        row.update({k: round(s[k], 4) for k in ("mfu", "hfu") if s.get(k) is not None})
    elif status != "ok":
        print(f"[bench] st_cached {status}; last lines:\n" + "\n".join(text.splitlines()[-20:]), flush=True)
    print(f"[bench] {row['impl']} B={args.st_batch} {row['status']} sps/GPU={row['samples_per_s_per_gpu']} "
          f"tokens/s/GPU={row.get('tokens_per_s_per_gpu', '-')} mfu={row.get('mfu', '-')} peak={row['peak_mem_gib']} GiB "
          f"wall={row['wall_s']} s", flush=True)
    return row


def parse_args(argv: Optional[List[str]] = None):
    from ds_infcl.tasks.bench_decoder import DECODER_ARCHS

    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.st_cached", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen2-7b", choices=sorted(DECODER_ARCHS))
    p.add_argument("--batch", type=int, default=512, help="global batch (queries) of a timed step")
    p.add_argument("--mini-batch", type=int, default=16, help="CachedMNRL's mini_batch_size (its GradCache chunk)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-negatives", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps (the median is reported)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--warmup-batch", type=int, default=0, help="batch of the warm-up steps (0: 2 x --mini-batch)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha 2r, q/k/v/o); 0 trains every weight")
    p.add_argument("--model-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="dtype of the weights (auto: bf16 with LoRA, fp32 for full training)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="bf16 autocast or none")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute the decoder layers in the backward")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for summary.json")
    args = p.parse_args(argv)
    for name in ("batch", "mini_batch", "seq_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_negatives < 0 or args.lora_r < 0 or args.warmup_steps < 0 or args.warmup_batch < 0:
        p.error("--num-negatives, --lora-r, --warmup-steps and --warmup-batch must be >= 0")
    if args.seq_len > DECODER_ARCHS[args.arch]["max_position_embeddings"]:
        p.error(f"--seq-len {args.seq_len}: {args.arch} has {DECODER_ARCHS[args.arch]['max_position_embeddings']} positions")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    if summary["status"] == "ok":
        mfu = summary.get("mfu")
        print(f"[st_cached] {args.arch} lora_r={args.lora_r} B={args.batch} mini={args.mini_batch} "
              f"sps/GPU={summary['samples_per_s_per_gpu']:.2f} tokens/s/GPU={summary['tokens_per_s_per_gpu']:.0f} "
              f"mfu={'-' if mfu is None else f'{mfu:.4f}'} step={summary['step_time_s']:.2f} s "
              f"peak={summary['peak_mem_gib']} GiB", flush=True)
    print(f"[st_cached] {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
