"""``train(run_config, ds_config)``: what ``python -m ds_infcl.train`` calls on every rank; it may
be called several times in one process (the tests do). The run itself is the ``Trainer`` class
(``train/trainer.py``); this is its one-call form."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ds_infcl.train.config import RunConfig
from ds_infcl.train.trainer import Encoder, Trainer, TrainSummary

__all__ = ["train", "TrainSummary", "Encoder", "Trainer"]


def train(
    cfg: RunConfig,
    ds_config: Dict[str, Any],
    *,
    resume: Optional[str] = None,
    ds_config_source: str = "DeepSpeed config",
    save_params: Optional[str] = None,
) -> TrainSummary:
    """Train ``cfg.task`` with DeepSpeed on every rank of the launched world: ``Trainer(...).fit()``.

    The arguments are ``Trainer``'s (documented there). The watchdog, the data stream, the metrics
    logger and the engine are released however the run ends (``Trainer.close``).
    """
    with Trainer(cfg, ds_config, resume=resume, ds_config_source=ds_config_source, save_params=save_params) as trainer:
        return trainer.fit()
