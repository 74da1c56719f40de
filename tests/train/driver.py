"""Run several training jobs in one (possibly launched) process group; used by the tests.

    python tests/train/driver.py JOBS.json            # one rank
    deepspeed --num_gpus 2 tests/train/driver.py JOBS.json

``JOBS.json`` is a list of ``{"name", "ds_config", "ds_set": [...], "set": [...], "resume": null}``;
each job trains with ``ds_infcl.train.train`` and leaves ``<out>/<name>/params.pt`` and
``summary.json`` (``out`` is the directory of JOBS.json). Also registers the loss implementation
``test_gather`` (plain all-gather of features with gradient), so the engine's multi-rank tests do
not depend on the ring.
"""

import json
import os
import sys

import torch
import torch.distributed as tdist

from ds_infcl.loss import register_loss_impl
from ds_infcl.loss.functional import compose_infonce, positive_logits
from ds_infcl.ring import group_size


@register_loss_impl("test_gather")
def _gather_loss(query, key, scale, labels, *, symmetric, backend, group, tile_size):
    """Reference multi-rank InfoNCE: all-gather with gradient, local rows, x world for DP mean."""
    world = group_size(group)
    if world == 1:
        logits = scale * query.float() @ key.float().T
        row = torch.logsumexp(logits, dim=1)
        col = torch.logsumexp(logits, dim=0) if symmetric else None
        pos = positive_logits(query, key, scale, labels)
        return compose_infonce(row, col, pos, labels, query.shape[0], symmetric)
    import torch.distributed.nn.functional as dnn

    rank = tdist.get_rank(group)
    qs = dnn.all_gather(query.float(), group=group)
    ks = dnn.all_gather(key.float(), group=group)
    all_q, all_k = torch.cat(qs), torch.cat(ks)
    b, m = query.shape[0], key.shape[0]
    B = b * world
    q_off, k_off = b * rank, m * rank
    logits = scale * all_q @ all_k.T  # [B, M] (tests only)
    row = torch.logsumexp(logits[q_off:q_off + b], dim=1)
    pos = scale * (all_q[q_off:q_off + b] * all_k[k_off + labels]).sum(dim=1)
    share = (row - pos).sum() / B
    if symmetric:
        col = torch.logsumexp(logits, dim=0)[k_off + labels]
        share = (share + (col - pos).sum() / B) / 2
    total = share.detach().clone()
    tdist.all_reduce(total, group=group)
    # all_gather's backward sums every rank's contribution, so each rank holds its share of the
    # gradient; x world makes DeepSpeed's DP mean exact. The value returned is the global loss.
    return share * world - (share * world).detach() + total


def main(path):
    from ds_infcl.train import load_run_config
    from ds_infcl.train.cli import _load_ds_config
    from ds_infcl.train.loop import train

    out = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        d = os.path.join(out, job["name"])
        cfg = load_run_config(job.get("config"), list(job.get("set", [])) + [f"output_dir={d}"])
        ds = _load_ds_config(job["ds_config"], job.get("ds_set", []))
        from torch._dynamo.utils import counters

        before = int(counters["stats"]["unique_graphs"])
        train(cfg, ds, resume=job.get("resume"), save_params=os.path.join(d, "params.pt"))
        with open(os.path.join(d, "dynamo.json"), "w") as f:  # graphs compiled during this job
            json.dump({"unique_graphs": int(counters["stats"]["unique_graphs"]) - before}, f)
    from ds_infcl.train.dist import exit_process, shutdown

    shutdown()
    exit_process(0)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0])
