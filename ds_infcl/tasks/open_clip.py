"""Any OpenCLIP architecture as the towers of the CLIP task: ``open_clip.create_model(name)``
(random init, or a local checkpoint) trained here at any batch, on the same image + caption shards.

Run config (``task.name: open_clip``)::

    "task": {"name": "open_clip", "args": {"model_name": "ViT-B-16", "data_dir": "shards/"}},
    "loss": {"impl": "infcl"}          # or "siglip" for a SigLIP model

``model_config`` registers an architecture given inline (a dict in OpenCLIP's JSON format:
``embed_dim``, ``vision_cfg``, ``text_cfg``) under ``model_name``; ``pretrained`` is a local
checkpoint file (no download happens at run time). Text is tokenized with the model's own OpenCLIP
tokenizer (``open_clip.get_tokenizer``), images resized to the model's ``image_size`` and
normalized on the device with its mean and std. The model's own ``logit_scale`` / ``logit_bias``
are frozen: the trainer's loss module owns the learnable scale (and SigLIP's bias), and the export
writes them back into the OpenCLIP state dict (``open_clip_model.safetensors``, loadable with
``open_clip.create_model(name, pretrained=<that file>)``).

Needs ``open_clip_torch`` (the ``open_clip`` extra) and a working torchvision; on a CPU-only
machine whose torchvision wheel is a CUDA build the import fails with a clear error.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ds_infcl.tasks.clip import ClipTask

__all__ = ["OpenClipTask", "OpenClipTowers"]

WEIGHTS_NAME = "open_clip_model.safetensors"
CONFIG_NAME = "open_clip_config.json"


def _import_open_clip():
    try:
        import open_clip
    except Exception as err:  # noqa: BLE001 - torchvision may fail with RuntimeError, not ImportError
        raise ValueError(
            f"task open_clip needs open_clip_torch with a working torchvision ({type(err).__name__}: {err}); "
            'pip install "ds_infcl[open_clip]"'
        ) from None
    return open_clip


class _Tokenizer:
    """OpenCLIP's tokenizer behind the CLIP task's interface: ``list[str] -> {"input_ids",
    "attention_mask"}`` (OpenCLIP pads with 0)."""

    def __init__(self, tokenize):
        self._tokenize = tokenize

    def __call__(self, texts: List[str]) -> Dict[str, torch.Tensor]:
        ids = self._tokenize(list(texts))
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


class OpenClipTowers(nn.Module):
    """An OpenCLIP ``CLIP`` / ``CustomTextCLIP`` model with the trainer's ``encode_query`` (uint8
    or normalized images) and ``encode_key`` (``{"input_ids", ...}``), unit-norm features."""

    def __init__(self, model: nn.Module, model_name: str):
        super().__init__()
        self.model = model
        self.model_name = model_name
        # The model's own scale and bias are owned by the trainer's loss module: held as buffers
        # of shape [1] here (DeepSpeed cannot broadcast 0-dim parameters), written back in their
        # OpenCLIP shape by the export.
        self.open_clip_shapes = {}
        for name in ("logit_scale", "logit_bias"):
            param = getattr(model, name, None)
            if isinstance(param, nn.Parameter):
                self.open_clip_shapes[name] = tuple(param.shape)
                delattr(model, name)
                model.register_buffer(name, param.detach().reshape(1).clone())
        size = model.visual.image_size
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        cfg = getattr(model.visual, "preprocess_cfg", None) or {}
        self.image_mean = list(cfg.get("mean", (0.48145466, 0.4578275, 0.40821073)))
        self.image_std = list(cfg.get("std", (0.26862954, 0.26130258, 0.27577711)))

    def _pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dtype != torch.uint8:
            return pixels
        mean = torch.tensor(self.image_mean, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std, device=pixels.device).view(1, 3, 1, 1)
        x = (pixels.float() / 255.0 - mean) / std
        return x.to(next(self.model.parameters()).dtype)

    def encode_query(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.model.encode_image(self._pixels(pixels)), dim=-1)

    def encode_key(self, text_inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        return F.normalize(self.model.encode_text(text_inputs["input_ids"]), dim=-1)


class OpenClipTask(ClipTask):
    """The CLIP task (data, evaluation, GradCache) with an OpenCLIP model as the towers.

    Args:
        model_name: an OpenCLIP architecture name (``open_clip.list_models()``), or the name given
            to ``model_config``.
        model_config: an architecture in OpenCLIP's JSON format, registered as ``model_name``.
        pretrained: a local checkpoint file for ``create_model`` (``None``: random init).
        model_kwargs: more keyword arguments of ``open_clip.create_model``.
        **clip_task_args: the data, evaluation and augmentation arguments of ``ClipTask``.
    """

    name = "open_clip"

    def __init__(self, model_name: str = "ViT-B-16", *, model_config: Optional[Dict[str, Any]] = None,
                 pretrained: Optional[str] = None, model_kwargs: Optional[Dict[str, Any]] = None,
                 **clip_task_args):
        self.open_clip = _import_open_clip()
        if model_config is not None:
            folder = tempfile.mkdtemp(prefix="open_clip_cfg_")
            with open(os.path.join(folder, f"{model_name}.json"), "w") as f:
                json.dump(model_config, f)
            self.open_clip.add_model_config(folder)
        if model_name not in self.open_clip.list_models():
            raise ValueError(f"model_name {model_name!r} is not an OpenCLIP architecture; give model_config or "
                             f"one of open_clip.list_models() (e.g. {self.open_clip.list_models()[:4]})")
        if pretrained is not None and not os.path.isfile(pretrained):
            raise ValueError(f"pretrained {pretrained!r} is not a file (a local checkpoint; nothing is downloaded)")
        self.model_name = model_name
        self.pretrained = pretrained
        self.model_kwargs = dict(model_kwargs or {})
        super().__init__(**clip_task_args)

    def _build_tokenizer(self, tok_dir, kind, context_length, vocab_size):
        return _Tokenizer(self.open_clip.get_tokenizer(self.model_name))

    def build_towers(self) -> OpenClipTowers:
        model = self.open_clip.create_model(self.model_name, pretrained=self.pretrained, **self.model_kwargs)
        self._towers = OpenClipTowers(model, self.model_name)
        return self._towers

    def build_loss(self, loss_config):
        """The trainer's loss; SigLIP needs a model with a bias (OpenCLIP's SigLIP configs have
        ``init_logit_bias``), so that the export carries the trained one."""
        from ds_infcl.loss import loss_features

        if ("logit_bias" in loss_features(loss_config.impl) and self._towers is not None
                and "logit_bias" not in self._towers.open_clip_shapes):
            raise ValueError(
                f"loss.impl {loss_config.impl!r} trains a bias, but OpenCLIP model {self.model_name!r} has none: set "
                'task.args.model_kwargs: {"init_logit_bias": -10} (or use a SigLIP architecture)'
            )
        return super().build_loss(loss_config)

    def save_pretrained(self, folder: str, towers: OpenClipTowers, logit_scale: torch.Tensor,
                        logit_bias: Optional[torch.Tensor] = None) -> None:
        """The OpenCLIP state dict with the trained scale (and bias) written back, and the name."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in towers.model.state_dict().items()}
        for name, value in (("logit_scale", logit_scale), ("logit_bias", logit_bias)):
            if name in towers.open_clip_shapes:
                value = state[name] if value is None else value
                state[name] = value.detach().float().reshape(towers.open_clip_shapes[name]).cpu().clone()
        save_file(state, os.path.join(folder, WEIGHTS_NAME))
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            json.dump({"model_name": self.model_name, "weights": WEIGHTS_NAME,
                       "create_model_kwargs": self.model_kwargs}, f, indent=1)
