"""FastCLIP on the digits CLIP: a short smoke test, and the comparison run of docs/fastclip.md.

The comparison trains ``digits-tiny`` from scratch in one process (plain torch, the same
recipe as ``ds_infcl.demos.clip_digits_check``) with

- FastCLIP-v3 at a small global batch,
- InfoNCE (Inf-CL ``ContrastiveLoss``, learnable temperature) at the same batch,
- InfoNCE at the full batch (the whole training split in one step),

for the same number of epochs, and reports held-out zero-shot accuracy::

    python -m tests.loss.test_fastclip_digits --epochs 40 --seeds 0 1 2 --out docs/fastclip_digits.json

(The file lives under tests/ because it crosses packages -- data, adapters, loss -- which
``ds_infcl.loss`` itself may not import.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import pytest
import torch

NUM_DIGITS = 1797  # rows of sklearn's load_digits(): the global sample indices


def _lr_at(step, *, lr, warmup, steps):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * lr * (1 + math.cos(math.pi * progress))


def train_digits(loss_name: str, *, batch_size: int, epochs: int, data_dir: str, seed: int = 0,
                 lr: float = 2e-3, warmup_frac: float = 0.1, arch: str = "digits-tiny",
                 init_temperature: float = 0.07, fastclip_kwargs=None, log_every: int = 0) -> dict:
    """Train one run; ``loss_name`` is ``"infonce"`` or a FastCLIP registry name."""
    from ds_infcl.adapters.clip import ClipModel
    from ds_infcl.adapters.clip_eval import evaluate_clip
    from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer
    from ds_infcl.data import ImageTextShards, ImageTransform, read_captions
    from ds_infcl.data.digits import read_digits_info, write_digits_shards
    from ds_infcl.loss import ContrastiveLoss, build_fastclip_loss

    torch.manual_seed(seed)
    start = time.perf_counter()
    if not os.path.exists(os.path.join(data_dir, "digits.json")):
        write_digits_shards(data_dir, seed=0)
    info = read_digits_info(data_dir)
    num_train = int(info["train"]["num_samples"]) if "num_samples" in info["train"] else None
    tokenizer = CaptionTokenizer.train(read_captions(info["train"]["urls"]), kind="wordlevel",
                                       context_length=16)
    model = ClipModel.from_architecture(arch, tokenizer, with_loss=False)
    train_transform = ImageTransform(model.image_size, model.image_mean, model.image_std)
    train_data = ImageTextShards(
        info["train"]["urls"], image_transform=train_transform, batch_size=batch_size,
        tokenizer=tokenizer, shuffle_buffer=2000, repeat=True, drop_last=True, seed=seed,
    )
    if num_train is None:
        num_train = sum(1 for _ in ImageTextShards(info["train"]["urls"], batch_size=512))
    steps_per_epoch = num_train // batch_size
    steps = steps_per_epoch * epochs
    if loss_name == "infonce":
        loss_fn = ContrastiveLoss(symmetric=True, init_logit_scale=math.log(1 / init_temperature),
                                  backend="torch")
    else:
        kwargs = dict(init_temperature=init_temperature, steps_per_epoch=steps_per_epoch,
                      gamma_decay_epochs=max(1, epochs // 2), backend="torch")
        kwargs.update(fastclip_kwargs or {})
        loss_fn = build_fastclip_loss(loss_name, NUM_DIGITS, **kwargs)
    params = [p for p in list(model.parameters()) + list(loss_fn.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.98), eps=1e-6,
    )
    heldout = list(ImageTextShards(
        info["heldout"]["urls"], image_transform=ImageTransform(model.image_size, model.image_mean,
                                                                model.image_std),
        batch_size=512, shuffle_shards=False,
    ))
    model.train()
    batches = iter(train_data)
    warmup = max(1, int(warmup_frac * steps))
    losses = []
    for step in range(steps):
        batch = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, lr=lr, warmup=warmup, steps=steps)
        img = model.encode_image(batch["image"])
        txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        if loss_name == "infonce":
            loss = loss_fn(img, txt)
        else:
            loss = loss_fn(img, txt, torch.as_tensor(batch["idx"]).long())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            temp = loss_fn.temperature if hasattr(loss_fn, "temperature") else 1 / loss_fn.scale.item()
            print(f"{loss_name} b={batch_size} step {step}/{steps} loss {loss.item():.4f} "
                  f"tau {temp:.4f}", flush=True)
    metrics = evaluate_clip(model, heldout, tokenizer, class_names=info["class_names"],
                            templates=info["zero_shot_templates"])
    final_tau = loss_fn.temperature if hasattr(loss_fn, "temperature") else 1 / loss_fn.scale.item()
    return dict(loss=loss_name, batch_size=batch_size, epochs=epochs, steps=steps, seed=seed,
                zero_shot_top1=metrics["zero_shot_top1"], zero_shot_top5=metrics["zero_shot_top5"],
                final_temperature=final_tau, final_loss=losses[-1],
                seconds=round(time.perf_counter() - start, 1))


@pytest.mark.slow
def test_fastclip_v3_trains_digits_briefly(tmp_path):
    out = train_digits("fastclip_v3", batch_size=64, epochs=1, data_dir=str(tmp_path / "digits"))
    assert math.isfinite(out["final_loss"]) and out["steps"] >= 20
    assert 0.0 <= out["zero_shot_top1"] <= 1.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "ds_infcl_digits"))
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=["fastclip_v3", "infonce", "infonce_full"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rho", type=float, default=None)
    parser.add_argument("--temperature-lr", type=float, default=None)
    parser.add_argument("--eps", type=float, default=None)
    parser.add_argument("--gamma-schedule", default=None, help='"cosine" or "constant"')
    parser.add_argument("--gamma", type=float, default=None, help="the constant schedule's gamma")
    parser.add_argument("--init-temperature", type=float, default=0.07)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fc = {k: v for k, v in (("rho", args.rho), ("temperature_lr", args.temperature_lr),
                            ("eps", args.eps), ("gamma_schedule", args.gamma_schedule),
                            ("gamma", args.gamma)) if v is not None}
    results = []
    for seed in args.seeds:
        for run in args.runs:
            name, batch = run, args.batch_size
            if run == "infonce_full":
                name, batch = "infonce", 1437  # the whole training split (80% of 1,797)
            res = train_digits(name, batch_size=batch, epochs=args.epochs, data_dir=args.data,
                               seed=seed, fastclip_kwargs=fc if name != "infonce" else None,
                               init_temperature=args.init_temperature)
            res["run"] = run
            res["fastclip_args"] = fc if name != "infonce" else {}
            print(json.dumps(res), flush=True)
            results.append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
