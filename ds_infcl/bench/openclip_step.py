"""OpenCLIP's own CLIP training step, timed beside ours (``bench.engine --impls ... openclip_step``).

What ``open_clip_train`` does per step with ``--precision amp_bf16``, on random-init towers and
generated inputs (no download, no data loader): ``open_clip.create_model(name)`` in float32 under
``torch.autocast(bfloat16)``, TF32 matmuls allowed and cuDNN's benchmark mode on (its ``main``
sets both), eager or (``--compile``, its ``--torchcompile``) ``torch.compile`` of the model after
its DDP wrapping, optionally with its ``--grad-checkpointing``, DDP on more than one GPU, ``ClipLoss`` (``local_loss`` and
``gather_with_grad`` on more than one GPU), AdamW as OpenCLIP builds it (no weight decay on gains,
biases and the logit scale; ``fused=True``), the logit scale clamped to ``[0, log 100]`` after the
step, and optionally its ``accum_freq`` path (features of all micro-batches first without
gradients, then each micro-batch again with gradients and a backward of the whole loss). One
process (one ``torchrun`` group) runs one batch size; ``bench.engine`` searches the largest that
fits by launching one per size.

    python -m ds_infcl.bench.openclip_step --arch vit-b-16 --batch-per-gpu 512 --out runs/oc
    python -m ds_infcl.bench.openclip_step --arch vit-b-16 --batch-per-gpu 2048 --accum-freq 4 --compile --out runs/oc
    torchrun --nproc_per_node 2 -m ds_infcl.bench.openclip_step --arch vit-b-16 --batch-per-gpu 512 --out runs/oc

Reported (``<out>/summary.json`` and the last printed line): samples/s per GPU over the timed
steps (``--warmup`` steps first), the model FLOPs per sample counted the way the trainer counts
them (3 x the towers' forward FLOPs of one image-text pair, ``torch.utils.flop_counter``), TFLOP/s
per GPU, MFU against ``ds_infcl.train.metrics.peak_tflops`` and the peak device memory. Exit code
3 (and a line saying so) when ``open_clip`` cannot be imported (``pip install open_clip_torch``;
it needs torchvision).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Dict, List, Optional

__all__ = ["ARCHS", "open_clip_model_name", "import_open_clip", "parse_args", "main", "MISSING_EXIT_CODE", "mode_name"]

ARCHS = {"vit-b-16": "ViT-B-16", "vit-l-14": "ViT-L-14"}
MISSING_EXIT_CODE = 3


def open_clip_model_name(arch: str) -> str:
    """OpenCLIP's model name for one of our bench archs (``vit-b-16`` -> ``ViT-B-16``)."""
    if arch not in ARCHS:
        raise ValueError(f"openclip_step: no OpenCLIP model for arch {arch!r}; choose one of {sorted(ARCHS)}")
    return ARCHS[arch]


def import_open_clip():
    """``open_clip``, or a ``RuntimeError`` that says how to install it."""
    try:
        import open_clip
    except ImportError as e:
        raise RuntimeError(
            f"open_clip could not be imported ({type(e).__name__}: {e}); the openclip_step benchmark needs "
            "open_clip_torch and torchvision (pip install open_clip_torch)"
        ) from None
    return open_clip


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.openclip_step", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="vit-b-16", choices=sorted(ARCHS))
    p.add_argument("--batch-per-gpu", type=int, required=True, help="samples per GPU per optimizer step")
    p.add_argument("--accum-freq", type=int, default=1,
                   help="OpenCLIP's accum_freq: the batch is this many micro-batches (batch-per-gpu / accum-freq each)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the (DDP-wrapped) model, as open_clip_train's --torchcompile does")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="the towers' activation checkpointing, as open_clip_train's --grad-checkpointing")
    p.add_argument("--loss", default="clip", choices=["clip", "siglip"],
                   help="clip: ClipLoss; siglip: SigLipLoss with the learnable bias, as open_clip_train's --siglip "
                   "(logit scale init log 10, bias init -10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (a compiled step compiles in the first)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--out", required=True, help="folder for summary.json")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (OpenCLIP's default)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke tests only (one process)")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps, profile one more step and write its trace, "
                   "operator table and device-time split (ds_infcl/train/profiling.py) to DIR")
    args = p.parse_args(argv)
    for key in ("batch_per_gpu", "accum_freq", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.batch_per_gpu % args.accum_freq:
        p.error(f"--batch-per-gpu {args.batch_per_gpu} does not divide into --accum-freq {args.accum_freq} micro-batches")
    return args


def mode_name(compiled: bool, accum_freq: int, grad_checkpointing: bool = False, loss: str = "clip") -> str:
    """The row name of one OpenCLIP configuration: ``openclip_step [siglip] [compiled] [accum_freq N]
    [grad checkpointing]``, the words its command-line flags would need."""
    words = ["openclip_step"] + (["siglip"] if loss == "siglip" else []) + (["compiled"] if compiled else []) + (
        [f"accum_freq {accum_freq}"] if accum_freq > 1 else []) + (["grad checkpointing"] if grad_checkpointing else [])
    return " ".join(words)


def _param_groups(model, weight_decay: float) -> List[Dict]:
    """OpenCLIP's split: no weight decay on 1-d parameters (gains, biases), ``logit_scale`` and
    embeddings (``open_clip_train.main``'s ``exclude``)."""
    def exclude(name, p):
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": weight_decay}]


def _flops_per_sample(model, image, text) -> float:
    """3 x the forward FLOPs of one image-text pair (the trainer's model-FLOPs definition)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.encode_image(image[:1])
        model.encode_text(text[:1])
    return 3.0 * counter.get_total_flops()


def run(args: argparse.Namespace) -> Dict:
    """One benchmark case on this process's GPU (every rank of a ``torchrun`` group calls it)."""
    import torch
    import torch.distributed as dist

    from ds_infcl.train.metrics import peak_tflops

    open_clip = import_open_clip()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("openclip_step: no CUDA device (the benchmark times OpenCLIP's GPU step; --device cpu "
                           "is for smoke tests)")
    if not cuda and world > 1:
        raise RuntimeError("openclip_step: --device cpu runs one process")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # open_clip_train's main sets both
        torch.backends.cudnn.benchmark = True
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    siglip = args.loss == "siglip"
    model_kwargs = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0} if siglip else {}
    model = open_clip.create_model(open_clip_model_name(args.arch), pretrained=None, precision="fp32",
                                   device=device, output_dict=True, **model_kwargs)
    image_size = model.visual.image_size
    image_size = image_size if isinstance(image_size, int) else image_size[0]
    B, micro = args.batch_per_gpu, args.batch_per_gpu // args.accum_freq
    images = torch.randn(B, 3, image_size, image_size, device=device)
    texts = torch.randint(0, model.vocab_size, (B, model.context_length), device=device)
    flops = _flops_per_sample(model, images, texts)
    raw = model
    if args.grad_checkpointing:
        raw.set_grad_checkpointing(True)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    if args.compile:
        if args.grad_checkpointing and world > 1:
            torch._dynamo.config.optimize_ddp = False  # what open_clip_train does for this pair
        model = torch.compile(model)
    if siglip:  # as open_clip_train's create_loss with --siglip (its default distributed implementation)
        loss_fn = open_clip.loss.SigLipLoss(rank=rank, world_size=world)
    else:
        loss_fn = open_clip.loss.ClipLoss(local_loss=world > 1, gather_with_grad=world > 1, cache_labels=True,
                                          rank=rank, world_size=world)

    def loss_of(image_features, text_features, out):
        extra = (out["logit_bias"],) if siglip else ()
        return loss_fn(image_features, text_features, out["logit_scale"], *extra)
    optimizer = torch.optim.AdamW(_param_groups(raw, 0.2), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=True)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step():
        optimizer.zero_grad()
        if args.accum_freq == 1:
            with autocast():
                out = model(images, texts)
                loss = loss_of(out["image_features"], out["text_features"], out)
            loss.backward()
        else:
            parts = [(images[i:i + micro], texts[i:i + micro]) for i in range(0, B, micro)]
            cached = {"image_features": [], "text_features": []}
            with torch.no_grad(), autocast():
                for im, tx in parts:
                    out = model(im, tx)
                    for key in cached:
                        cached[key].append(out[key])
            for j, (im, tx) in enumerate(parts):
                with autocast():
                    out = model(im, tx)
                    feats = {key: torch.cat(cached[key][:j] + [out[key]] + cached[key][j + 1:]) for key in cached}
                    loss = loss_of(feats["image_features"], feats["text_features"], out)
                loss.backward()
        optimizer.step()
        with torch.no_grad():
            raw.logit_scale.clamp_(0, math.log(100))
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    sync()
    seconds = time.perf_counter() - t0
    sps = B * args.steps / seconds  # per GPU
    profile = None
    if args.profile:  # one more step under the profiler, split by the trainer's rule
        from ds_infcl.train.profiling import format_summary, profiled

        with profiled(args.profile, mode_name(args.compile, args.accum_freq, args.grad_checkpointing, args.loss), device,
                      write=rank == 0) as profile:
            step()
        if rank == 0:
            print(f"[openclip_step] {format_summary(profile['label'], profile)}", flush=True)
    peak = peak_tflops(device)
    tflops = flops * sps / 1e12
    summary = {
        "impl": mode_name(args.compile, args.accum_freq, args.grad_checkpointing, args.loss), "arch": args.arch,
        "compiled": args.compile, "grad_checkpointing": args.grad_checkpointing, "loss": args.loss, "model": open_clip_model_name(args.arch), "gpus": world,
        "batch_per_gpu": B, "global_batch": B * world, "accum_freq": args.accum_freq, "steps": args.steps,
        "samples_per_s_per_gpu": sps, "step_time_s": seconds / args.steps, "model_flops_per_sample": flops,
        "model_tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None, "losses": [float(x) for x in losses],
        "open_clip_version": getattr(open_clip, "__version__", "?"), "profile": profile,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    if world > 1:
        from ds_infcl.train.dist import shutdown

        shutdown()
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except RuntimeError as e:
        if "open_clip could not be imported" in str(e):
            print(f"[openclip_step] {e}", flush=True)
            return MISSING_EXIT_CODE
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"[openclip_step] {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
