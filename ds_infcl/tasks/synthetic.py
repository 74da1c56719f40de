"""The built-in synthetic task: two tiny MLP towers on generated pairs (``task.name: synthetic``)."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ds_infcl.tasks.base import Batch, Task

__all__ = ["SyntheticTask"]




class _MLPTower(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int, embed_dim: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)


class _TwoTowers(nn.Module):
    def __init__(self, query_tower: nn.Module, key_tower: nn.Module):
        super().__init__()
        self.query_tower = query_tower
        self.key_tower = key_tower

    def encode_query(self, x: torch.Tensor) -> torch.Tensor:
        return self.query_tower(x)

    def encode_key(self, x: torch.Tensor) -> torch.Tensor:
        return self.key_tower(x)


class SyntheticTask(Task):
    """Two tiny MLP towers on generated pairs: a latent ``z_n ~ N(0, I)`` per global sample index
    ``n``, seen through two fixed random linear maps plus noise (query ``A z + e``, key
    ``B z + e'``). Everything is a deterministic function of ``data_seed`` and ``n``, so any rank
    count, chunking or resumption sees the same examples. Evaluation: query-to-key recall@1 and
    the loss over ``eval_size`` held-out pairs (indices ``-1 .. -eval_size``).

    Args:
        input_dim: width of query and key inputs.
        latent_dim: width of the shared latent.
        hidden_dim: tower hidden width.
        embed_dim: feature dim ``c`` fed to the loss.
        noise: std of the per-view noise.
        dropout: dropout inside the towers (exercises GradCache's RNG replay).
        data_seed: seed of the maps and the samples.
        eval_size: held-out pairs for ``evaluate``.
        symmetric: the loss default (symmetric, CLIP-like).
        num_samples: a finite data set of this many pairs, visited in order epoch after epoch
            (global index modulo ``num_samples``); ``None``: an endless stream.
    """

    name = "synthetic"

    def __init__(
        self,
        input_dim: int = 32,
        latent_dim: int = 8,
        hidden_dim: int = 64,
        embed_dim: int = 16,
        noise: float = 0.3,
        dropout: float = 0.0,
        data_seed: int = 1234,
        eval_size: int = 256,
        symmetric: bool = True,
        num_samples: Optional[int] = None,
    ):
        self.input_dim = input_dim
        self.latent_dim = latent_dim
        self.hidden_dim = hidden_dim
        self.embed_dim = embed_dim
        self.noise = noise
        self.dropout = dropout
        self.data_seed = data_seed
        self.eval_size = eval_size
        self.symmetric = symmetric
        self.num_samples = num_samples
        g = torch.Generator().manual_seed(data_seed)
        self._map_q = torch.randn(latent_dim, input_dim, generator=g) / math.sqrt(latent_dim)
        self._map_k = torch.randn(latent_dim, input_dim, generator=g) / math.sqrt(latent_dim)

    def build_towers(self) -> nn.Module:
        return _TwoTowers(
            _MLPTower(self.input_dim, self.hidden_dim, self.embed_dim, self.dropout),
            _MLPTower(self.input_dim, self.hidden_dim, self.embed_dim, self.dropout),
        )

    def loss_defaults(self) -> Dict[str, Any]:
        return {"symmetric": self.symmetric}

    def sample_index_bound(self) -> Optional[int]:
        return self.num_samples  # None: an endless stream, indices grow without bound

    def pairs(self, sample_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(query [n, input_dim], key [n, input_dim])`` for the given global sample indices."""
        rows_z, rows_e = [], []
        for n in sample_index.tolist():
            g = torch.Generator().manual_seed((self.data_seed * 1_000_003 + int(n)) % (2**63))
            rows_z.append(torch.randn(self.latent_dim, generator=g))
            rows_e.append(torch.randn(2, self.input_dim, generator=g))
        z = torch.stack(rows_z)
        e = torch.stack(rows_e) * self.noise
        return z @ self._map_q + e[:, 0], z @ self._map_k + e[:, 1]

    def batches(self, *, rank, world_size, local_batch_size, start_step, seed) -> Iterator[Batch]:
        global_batch = local_batch_size * world_size
        step = start_step
        while True:
            start = step * global_batch + rank * local_batch_size
            index = torch.arange(start, start + local_batch_size, dtype=torch.long)
            if self.num_samples:
                index = index % self.num_samples
            q, k = self.pairs(index)
            yield Batch(query_inputs=q, key_inputs=k, sample_index=index)
            step += 1

    def evaluate(self, encoder, step: int) -> Dict[str, float]:
        index = -1 - torch.arange(self.eval_size, dtype=torch.long)
        q_in, k_in = self.pairs(index)
        q = encoder.encode_query(q_in).float()
        k = encoder.encode_key(k_in).float()
        sim = q @ k.T
        target = torch.arange(len(index), device=sim.device)
        recall = (sim.argmax(dim=1) == target).float().mean().item()
        return {"eval_recall@1": recall}

