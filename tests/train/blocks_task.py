"""A plug-in task for the compile and chunk-size tests: the synthetic task's data with towers made
of repeated residual blocks in an ``nn.ModuleList`` (what ``model.compile`` compiles), with
optional dropout inside the blocks (GradCache's RNG replay)."""

import torch
from torch import nn

from ds_infcl.tasks.synthetic import SyntheticTask


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + dropout(gelu(fc(ln(x))))``."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(nn.functional.gelu(self.fc(self.ln(x))))


class BlockTower(nn.Module):
    def __init__(self, input_dim: int, width: int, embed_dim: int, num_blocks: int, dropout: float):
        super().__init__()
        self.embed = nn.Linear(input_dim, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(num_blocks))
        self.head = nn.Linear(width, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return nn.functional.normalize(self.head(x), dim=-1)


class BlockTowers(nn.Module):
    def __init__(self, input_dim=32, width=32, embed_dim=16, num_blocks=2, dropout=0.0):
        super().__init__()
        self.query_tower = BlockTower(input_dim, width, embed_dim, num_blocks, dropout)
        self.key_tower = BlockTower(input_dim, width, embed_dim, num_blocks, dropout)

    def encode_query(self, x):
        return self.query_tower(x)

    def encode_key(self, x):
        return self.key_tower(x)


class BlocksTask(SyntheticTask):
    """``SyntheticTask`` with ``BlockTowers`` (same data, same ``dropout`` argument)."""

    def build_towers(self):
        return BlockTowers(self.input_dim, self.hidden_dim // 2, self.embed_dim, 2, self.dropout)
