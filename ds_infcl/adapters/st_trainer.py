"""``SentenceTransformerTrainer`` that saves a loadable model under DeepSpeed ZeRO-3.

sentence-transformers' trainer writes its folder with ``model.save_pretrained`` and ignores the
state dict that ``transformers.Trainer.save_model`` gathers for it. Under ZeRO-3 every parameter of
the module is a partition placeholder of shape ``[0]`` outside a gather, so the folder it writes
holds empty tensors and ``SentenceTransformer(path)`` refuses to load it. It also writes from every
rank into the same folder (``Trainer._save`` checks ``should_save``; its override does not).

This class is a drop-in for ``sentence_transformers.SentenceTransformerTrainer``: on the process
that saves, the gathered weights (``stage3_gather_16bit_weights_on_model_save: true`` in the
DeepSpeed config, which DeepSpeed's ZeRO-3 needs for any full-weight save) stand in for the
placeholders while the folder is written, then the placeholders come back; the other ranks write
nothing. Without ZeRO-3 it is sentence-transformers' trainer unchanged.

Example::

    from ds_infcl.adapters.st_trainer import SentenceTransformerTrainer   # in place of sentence-transformers'
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    trainer.save_model("runs/embedder")           # every rank calls it; rank 0 writes the folder
    SentenceTransformer("runs/embedder")          # the trained weights

The weights are the 16-bit copies that DeepSpeed gathers (bf16 or fp16 under mixed precision,
float32 otherwise), as ``transformers.Trainer`` saves them for any model under ZeRO-3. The model
card is written without its usage snippet's computed similarities: computing them runs a forward
on the saving rank alone, a collective under ZeRO-3 (sentence-transformers' own trainer hangs
there).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch
from sentence_transformers import SentenceTransformerTrainer as _STTrainer
from torch import nn

__all__ = ["SentenceTransformerTrainer", "zero3_partitioned", "full_weights"]

GATHER_FLAG = "stage3_gather_16bit_weights_on_model_save"


def zero3_partitioned(model: nn.Module) -> bool:
    """True when ``model``'s parameters are ZeRO-3 partitions (DeepSpeed tags them ``ds_numel``)."""
    return any(hasattr(p, "ds_numel") for p in model.parameters())


@contextlib.contextmanager
def full_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, each parameter of ``model`` named in ``state_dict`` holds that tensor (the
    gathered weight) instead of its partition placeholder; afterwards the placeholders are back.
    Parameters shared under several names take the tensor of the first name found.

    Raises:
        ValueError: a parameter that is a ZeRO-3 partition has no entry in ``state_dict`` and is
            not frozen (a state dict of another model).
    """
    originals = {}
    try:
        for name, p in model.named_parameters():
            if name in state_dict:
                originals[name] = (p, p.data)
                p.data = state_dict[name].to(p.device)
            elif hasattr(p, "ds_numel") and p.requires_grad:
                raise ValueError(f"the gathered state dict has no weight for parameter {name!r} "
                                 f"({len(state_dict)} entries): it is not this model's")
        yield
    finally:
        for p, data in originals.values():
            p.data = data


class SentenceTransformerTrainer(_STTrainer):
    """``sentence_transformers.SentenceTransformerTrainer`` whose saved folder holds the trained
    weights under DeepSpeed ZeRO-3 (see the module docstring)."""

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        if not self.args.should_save:  # transformers calls _save on every rank under DeepSpeed
            return
        if not zero3_partitioned(self.model):
            return super()._save(output_dir, state_dict=state_dict)
        if not state_dict:
            raise ValueError(
                f"saving a sentence-transformers folder under DeepSpeed ZeRO-3 needs the gathered weights: set "
                f'"zero_optimization": {{"{GATHER_FLAG}": true}} in the DeepSpeed config (without it each rank '
                "holds only its partition, and the folder would hold empty tensors)"
            )
        # The model card's usage snippet encodes three sentences: a forward on this rank alone, which
        # under ZeRO-3 gathers parameters (a collective the other ranks never join: a hang).
        card = getattr(self.model, "model_card_data", None)
        widget = getattr(card, "generate_widget_examples", None)
        if widget is not None:
            card.generate_widget_examples = False
        try:
            with full_weights(self.model, state_dict):
                super()._save(output_dir, state_dict=state_dict)
        finally:
            if widget is not None:
                card.generate_widget_examples = widget
