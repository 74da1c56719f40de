"""Single-process sanity run: train the digits CLIP with plain torch and report held-out metrics.

No DeepSpeed, no process group: this checks that the towers, the data pipeline, the tokenizer,
the ``infcl`` loss and the evaluation fit together and learn, and finds settings for the demo
(which runs the same task through the deepspeed launcher on 2 ranks)::

    python -m ds_infcl.demos.clip_digits_check --data data/digits --steps 150

It writes the digits shards if ``--data`` has none, trains a tokenizer on the training captions,
trains ``--arch`` from scratch with AdamW (warmup + cosine), evaluates zero-shot accuracy and
recall@k on the held-out split, and prints them with the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch


def _lr_at(step: int, *, lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * lr * (1 + math.cos(math.pi * progress))


def main(argv=None) -> dict:
    # The check crosses packages (data + adapters), as the trainer's task does.
    from ds_infcl.adapters.clip import ClipModel
    from ds_infcl.adapters.clip_eval import evaluate_clip
    from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer
    from ds_infcl.data import ImageTextShards, ImageTransform, read_captions
    from ds_infcl.data.digits import read_digits_info, write_digits_shards

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/digits", help="digits shard folder (written if missing)")
    parser.add_argument("--arch", default="digits-tiny")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--impl", default="infcl", help="loss implementation")
    parser.add_argument("--init-temperature", type=float, default=0.2,
                        help="initial temperature (the learnable scale starts at its inverse; "
                        "CLIP uses 0.07, which learns the digits more slowly)")
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument("--random-crop", type=float, default=0.0,
                        help="lower area bound of a random-resized crop (0: no augmentation)")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="folder to save the trained model and tokenizer")
    parser.add_argument("--losses-out", default=None, help="write the per-step losses to this JSON file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    if not os.path.exists(os.path.join(args.data, "digits.json")):
        write_digits_shards(args.data, seed=args.seed)
    info = read_digits_info(args.data)

    tokenizer = CaptionTokenizer.train(read_captions(info["train"]["urls"]), kind="wordlevel", context_length=16)
    model = ClipModel.from_architecture(
        args.arch, tokenizer, loss_impl=args.impl, init_logit_scale=math.log(1 / args.init_temperature)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )
    train_transform = ImageTransform(
        model.image_size, model.image_mean, model.image_std, train=args.random_crop > 0,
        random_crop_scale=(args.random_crop, 1.0) if args.random_crop > 0 else None, seed=args.seed,
    )
    eval_transform = ImageTransform(model.image_size, model.image_mean, model.image_std)
    train_data = ImageTextShards(
        info["train"]["urls"], image_transform=train_transform, batch_size=args.batch_size,
        tokenizer=tokenizer, shuffle_buffer=args.shuffle_buffer, repeat=True, drop_last=True,
        seed=args.seed,
    )
    heldout = ImageTextShards(
        info["heldout"]["urls"], image_transform=eval_transform, batch_size=512, shuffle_shards=False,
    )
    heldout_batches = list(heldout)  # small: decode once, evaluate many times

    def evaluate() -> dict:
        return evaluate_clip(
            model, heldout_batches, tokenizer, class_names=info["class_names"],
            templates=info["zero_shot_templates"],
        )

    setup_s = time.perf_counter() - start
    model.train()
    batches = iter(train_data)
    data_s, losses = 0.0, []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = next(batches)
        data_s += time.perf_counter() - t0
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, lr=args.lr, warmup=args.warmup, steps=args.steps)
        out = model(batch["image"], batch["input_ids"], batch["attention_mask"])
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d}  loss {out['loss'].item():.4f}  scale {model.loss.scale.item():6.2f}  "
                f"{time.perf_counter() - start:6.1f}s", flush=True,
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            m = evaluate()
            print(f"  eval @ {step + 1}: zero-shot top1 {m['zero_shot_top1']:.3f}", flush=True)
    train_s = time.perf_counter() - start - setup_s
    metrics = evaluate()
    total_s = time.perf_counter() - start
    metrics.update(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, arch=args.arch, impl=args.impl,
        setup_s=round(setup_s, 1), train_s=round(train_s, 1), data_s=round(data_s, 1),
        total_s=round(total_s, 1), bad_samples=sum(train_data.bad_samples.values()),
        num_params=sum(p.numel() for p in model.parameters()),
    )
    print(json.dumps(metrics, indent=1))
    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"impl": args.impl, "seed": args.seed, "losses": losses}, f)
    if args.save:
        model.save(args.save, tokenizer=tokenizer)
    return metrics


if __name__ == "__main__":
    main()
