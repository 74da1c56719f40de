"""CLIP: an image tower and a text tower from ``transformers``, projections, L2 normalization and
the symmetric contrastive loss with its learnable logit scale, in one ``nn.Module``.

The loss module (``ds_infcl.loss.ContrastiveLoss``) sits inside the model, so the logit scale is a
parameter of the model that goes to ``deepspeed.initialize`` and ZeRO manages it like the others.
The model file knows nothing of distribution: the trainer sets ``model.loss.group`` to the
engine's data-parallel group.

Ways to build one (no network: configs and weights come from code or local folders)::

    tok = CaptionTokenizer.train(captions, context_length=16)
    model = ClipModel.from_architecture("digits-tiny", tok)     # named sizes: tiny .. ViT-L-14
    model = ClipModel.from_architecture("my_arch.json", tok)    # or a JSON file of your own
    model = ClipModel.from_hf_clip("/models/clip-vit-b-16")     # a local HF CLIPModel folder
    model = ClipModel.from_towers("/models/vit", "/models/bert", embed_dim=512)  # any HF towers
    model.save("runs/clip", tokenizer=tok); model = ClipModel.load("runs/clip")

Locking a tower (LiT; OpenCLIP's ``--lock-image``/``--lock-text``): its parameters and its
projection get ``requires_grad=False``, it stays in eval mode, and its features are computed under
``torch.no_grad()`` so no graph is built. Give the optimizer only parameters that require grad.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ds_infcl.adapters.clip_configs import get_architecture, image_stats, to_hf_configs
from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer
from ds_infcl.loss import ContrastiveLoss, SigLIPLoss

__all__ = ["ClipModel", "load_clip", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "clip_config.json"
WEIGHTS_NAME = "model.safetensors"
POOLINGS = ("eos", "cls", "mean", "pooler")
VISION_POOLINGS = ("cls", "mean")
_CLIP_TYPES = {"vision": "clip_vision_model", "text": "clip_text_model"}


def _config_from_dict(d: Dict[str, Any]):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"tower config has no model_type: keys {sorted(d)}")
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    return AutoConfig.for_model(model_type, **d)


def _build_tower(config):
    """A ``transformers`` model from its config (CLIP towers by class, others by ``AutoModel``)."""
    from transformers import AutoModel, CLIPTextModel, CLIPVisionModel

    if config.model_type == _CLIP_TYPES["vision"]:
        return CLIPVisionModel(config)
    if config.model_type == _CLIP_TYPES["text"]:
        return CLIPTextModel(config)
    kwargs = {"add_pooling_layer": False} if config.model_type in ("vit", "bert", "roberta") else {}
    return AutoModel.from_config(config, **kwargs)


class ClipModel(nn.Module):
    """CLIP image and text towers with projections and the symmetric Inf-CL loss.

    Args:
        vision_config: ``transformers`` config of the image tower (``CLIPVisionConfig``, or e.g.
            ``ViTConfig``), or its dict (with ``model_type``).
        text_config: config of the text tower (``CLIPTextConfig``, or e.g. ``BertConfig``).
        embed_dim: dimension of the shared embedding space.
        image_mean, image_std: the normalization the towers expect (kept for preprocessing).
        text_pooling: ``"eos"`` (CLIP: the last attended token), ``"cls"``, ``"mean"``; default
            ``eos`` for a CLIP text tower, ``cls`` otherwise.
        vision_pooling: ``"cls"`` (CLIP, ViT) or ``"mean"`` (the mean of the patch tokens, then
            the tower's final layer norm). A tiny ViT trained from scratch starts with a CLS
            output that hardly depends on the image (cosine ~0.99 between any two digits) and
            spends its first steps escaping that; the mean of the patch tokens does not.
        lock_image, lock_text: freeze that tower and its projection (LiT).
        init_logit_scale, max_logit_scale: log of the initial and maximal scale (CLIP: 1/0.07,
            SigLIP: 10; at most 100).
        loss_impl, loss_backend, tile_size: forwarded to ``ContrastiveLoss`` (``impl``,
            ``backend``, ``tile_size``); ``loss_impl="siglip"`` builds ``SigLIPLoss``, which owns
            the learnable scale and bias (``init_logit_bias``, SigLIP's -10).
        with_loss: ``False`` builds the towers only (``loss`` is ``None``), for a trainer that
            owns the loss module (``ds_infcl.train`` wraps ``encode_query``/``encode_key``).

    Inputs of ``forward``: ``pixel_values [b, 3, H, W]``, ``input_ids [b, L]``,
    ``attention_mask [b, L]`` (optional).
    Returns: ``{"loss": 0-dim, "image_features": [b, d], "text_features": [b, d],
    "logit_scale": 0-dim}`` with unit-norm features.

    Relations: the loss equals OpenCLIP's ``ClipLoss(local_loss=True, gather_with_grad=True)``
    on the global batch; the towers and projections match ``transformers.CLIPModel``'s
    (``from_hf_clip`` loads one, ``to_hf_clip`` exports one).

    Example::

        model = ClipModel.from_architecture("tiny", tokenizer)
        out = model(images, **tokenizer(captions))
        out["loss"].backward()
    """

    def __init__(
        self,
        vision_config,
        text_config,
        *,
        embed_dim: int,
        image_mean: Sequence[float] = (0.48145466, 0.4578275, 0.40821073),
        image_std: Sequence[float] = (0.26862954, 0.26130258, 0.27577711),
        text_pooling: Optional[str] = None,
        vision_pooling: str = "cls",
        lock_image: bool = False,
        lock_text: bool = False,
        init_logit_scale: Optional[float] = None,
        max_logit_scale: float = math.log(100.0),
        loss_impl: str = "infcl",
        init_logit_bias: float = -10.0,
        loss_backend: str = "auto",
        tile_size: Optional[int] = None,
        with_loss: bool = True,
    ):
        super().__init__()
        if isinstance(vision_config, dict):
            vision_config = _config_from_dict(vision_config)
        if isinstance(text_config, dict):
            text_config = _config_from_dict(text_config)
        if text_pooling is None:
            text_pooling = "eos" if text_config.model_type == _CLIP_TYPES["text"] else "cls"
        if text_pooling not in POOLINGS:
            raise ValueError(f"text_pooling must be one of {POOLINGS}, got {text_pooling!r}")
        if vision_pooling not in VISION_POOLINGS:
            raise ValueError(f"vision_pooling must be one of {VISION_POOLINGS}, got {vision_pooling!r}")
        self.vision_model = _build_tower(vision_config)
        self.text_model = _build_tower(text_config)
        self.visual_projection = nn.Linear(vision_config.hidden_size, embed_dim, bias=False)
        self.text_projection = nn.Linear(text_config.hidden_size, embed_dim, bias=False)
        self.loss: Optional[nn.Module] = None
        if with_loss and loss_impl == "siglip":  # the loss owns the learnable scale and bias
            self.loss = SigLIPLoss(
                init_logit_scale=math.log(10.0) if init_logit_scale is None else init_logit_scale,
                init_logit_bias=init_logit_bias, max_logit_scale=max_logit_scale, backend=loss_backend,
                tile_size=tile_size,
            )
        elif with_loss:
            self.loss = ContrastiveLoss(
                symmetric=True, max_logit_scale=max_logit_scale, impl=loss_impl, backend=loss_backend,
                init_logit_scale=math.log(1 / 0.07) if init_logit_scale is None else init_logit_scale,
                tile_size=tile_size,
            )
        self._loss_settings = {
            "max_logit_scale": float(max_logit_scale), "loss_impl": loss_impl,
            "loss_backend": loss_backend, "tile_size": tile_size,
        }
        self.embed_dim = embed_dim
        self.image_mean = [float(x) for x in image_mean]
        self.image_std = [float(x) for x in image_std]
        self.text_pooling = text_pooling
        self.vision_pooling = vision_pooling
        self.image_locked = False
        self.text_locked = False
        self._init_projections()
        if lock_image:
            self.lock_image_tower()
        if lock_text:
            self.lock_text_tower()

    def _init_projections(self) -> None:
        # CLIP's init: normal with std width^-0.5.
        for proj in (self.visual_projection, self.text_projection):
            nn.init.normal_(proj.weight, std=proj.in_features ** -0.5)

    # -- properties ------------------------------------------------------------------------------

    @property
    def image_size(self) -> int:
        return int(self.vision_model.config.image_size)

    @property
    def context_length(self) -> int:
        return int(self.text_model.config.max_position_embeddings)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self._require_loss().logit_scale

    def _require_loss(self) -> ContrastiveLoss:
        if self.loss is None:
            raise ValueError("this ClipModel was built with with_loss=False (towers only)")
        return self.loss

    # -- locking ---------------------------------------------------------------------------------

    def lock_image_tower(self) -> None:
        """Freeze the image tower and its projection (LiT / ``--lock-image``)."""
        for p in list(self.vision_model.parameters()) + list(self.visual_projection.parameters()):
            p.requires_grad_(False)
        self.image_locked = True
        self.vision_model.eval()

    def lock_text_tower(self) -> None:
        """Freeze the text tower and its projection (``--lock-text``)."""
        for p in list(self.text_model.parameters()) + list(self.text_projection.parameters()):
            p.requires_grad_(False)
        self.text_locked = True
        self.text_model.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        # A locked tower keeps eval behaviour (no dropout) as OpenCLIP's lock does.
        if self.image_locked:
            self.vision_model.eval()
        if self.text_locked:
            self.text_model.eval()
        return self

    # -- encoding --------------------------------------------------------------------------------

    def _pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``uint8`` pixels (as the data pipeline's ``output="uint8"`` yields them) normalized with
        ``image_mean``/``image_std`` on their device, in the vision tower's dtype; float input is
        taken as already normalized."""
        if pixel_values.dtype != torch.uint8:
            return pixel_values
        dev = pixel_values.device
        mean = torch.tensor(self.image_mean, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        scale = 1.0 / (255.0 * torch.tensor(self.image_std, dtype=torch.float32, device=dev).view(1, 3, 1, 1))
        x = pixel_values.to(torch.float32).mul_(scale).sub_(mean * 255.0 * scale)
        return x.to(next(self.vision_model.parameters()).dtype)

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_model(pixel_values=self._pixels(pixel_values))
        is_clip = self.vision_model.config.model_type == _CLIP_TYPES["vision"]
        if self.vision_pooling == "mean":
            pooled = out.last_hidden_state[:, 1:].mean(dim=1)
            if is_clip:
                pooled = self.vision_model.post_layernorm(pooled)
        elif is_clip:
            pooled = out.pooler_output  # post-layernorm CLS
        else:
            pooled = out.last_hidden_state[:, 0]
        return self.visual_projection(pooled)

    def _text_features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state
        if self.text_pooling == "eos":
            # The last attended token is [EOS] (right padding); CLIP pools there.
            last = attention_mask.sum(dim=1).clamp(min=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        elif self.text_pooling == "cls":
            pooled = hidden[:, 0]
        elif self.text_pooling == "mean":
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        else:
            pooled = out.pooler_output
        return self.text_projection(pooled)

    def encode_image(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """``[b, 3, H, W] -> [b, embed_dim]`` (unit norm unless ``normalize=False``); ``uint8``
        pixels are normalized here, float pixels are taken as normalized."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.image_locked):
            features = self._image_features(pixel_values)
            return F.normalize(features, dim=-1) if normalize else features

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, normalize: bool = True
    ) -> torch.Tensor:
        """``[b, L] -> [b, embed_dim]`` (unit norm unless ``normalize=False``)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.text_locked):
            features = self._text_features(input_ids, attention_mask)
            return F.normalize(features, dim=-1) if normalize else features

    def encode_query(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The trainer's name for ``encode_image`` (images are the queries)."""
        return self.encode_image(pixel_values)

    def encode_key(self, text_inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The trainer's name for ``encode_text``: ``{"input_ids", "attention_mask"}``."""
        return self.encode_text(text_inputs["input_ids"], text_inputs.get("attention_mask"))

    def compute_loss(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """The global symmetric loss of (already normalized) features; GradCache calls this."""
        return self._require_loss()(image_features, text_features)

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        image_features = self.encode_image(pixel_values)
        text_features = self.encode_text(input_ids, attention_mask)
        return {
            "loss": self.compute_loss(image_features, text_features),
            "image_features": image_features,
            "text_features": text_features,
            "logit_scale": self.logit_scale,
        }

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_architecture(cls, name_or_path: str, tokenizer: CaptionTokenizer, **kwargs) -> "ClipModel":
        """A randomly initialised CLIP of a named size (``CLIP_ARCHITECTURES``) or a JSON file.

        The text tower's vocabulary, special ids and context length follow ``tokenizer``.
        """
        arch = get_architecture(name_or_path)
        if tokenizer.context_length > arch["text"]["context_length"]:
            raise ValueError(
                f"tokenizer context_length {tokenizer.context_length} exceeds the architecture's "
                f"{arch['text']['context_length']}"
            )
        vision, text = to_hf_configs(
            arch, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        mean, std = image_stats(arch)
        kwargs.setdefault("vision_pooling", arch["vision"].get("pool", "cls"))
        kwargs.setdefault("image_mean", mean)
        kwargs.setdefault("image_std", std)
        return cls(vision, text, embed_dim=arch["embed_dim"], **kwargs)

    @classmethod
    def from_hf_clip(cls, folder: str, **kwargs) -> "ClipModel":
        """Load a local ``transformers.CLIPModel`` checkpoint folder (weights, logit scale,
        the image normalization of its ``preprocessor_config.json`` when present)."""
        from transformers import CLIPModel

        hf = CLIPModel.from_pretrained(folder, local_files_only=True)
        pre = os.path.join(folder, "preprocessor_config.json")
        if os.path.exists(pre):
            with open(pre) as f:
                p = json.load(f)
            kwargs.setdefault("image_mean", p.get("image_mean", (0.48145466, 0.4578275, 0.40821073)))
            kwargs.setdefault("image_std", p.get("image_std", (0.26862954, 0.26130258, 0.27577711)))
        kwargs.setdefault("init_logit_scale", min(hf.logit_scale.item(), math.log(100.0)))
        lock_image, lock_text = kwargs.pop("lock_image", False), kwargs.pop("lock_text", False)
        model = cls(hf.config.vision_config, hf.config.text_config, embed_dim=hf.config.projection_dim, **kwargs)
        model.vision_model.load_state_dict(hf.vision_model.state_dict())
        model.text_model.load_state_dict(hf.text_model.state_dict())
        model.visual_projection.load_state_dict(hf.visual_projection.state_dict())
        model.text_projection.load_state_dict(hf.text_projection.state_dict())
        if model.loss is not None:
            with torch.no_grad():
                model.loss.logit_scale.copy_(hf.logit_scale.clamp(max=model.loss.max_logit_scale))
        if lock_image:
            model.lock_image_tower()
        if lock_text:
            model.lock_text_tower()
        return model

    @classmethod
    def from_towers(cls, vision_folder: str, text_folder: str, *, embed_dim: int, **kwargs) -> "ClipModel":
        """Pretrained towers from two local ``transformers`` folders (e.g. a ViT and a BERT, as in
        LiT), with new projections."""
        from transformers import AutoModel

        lock_image, lock_text = kwargs.pop("lock_image", False), kwargs.pop("lock_text", False)
        vision = AutoModel.from_pretrained(vision_folder, local_files_only=True)
        text = AutoModel.from_pretrained(text_folder, local_files_only=True)
        if vision.config.model_type == "clip":
            vision = vision.vision_model
        if text.config.model_type == "clip":
            text = text.text_model
        model = cls(vision.config, text.config, embed_dim=embed_dim, **kwargs)
        model.vision_model.load_state_dict(vision.state_dict(), strict=False)
        model.text_model.load_state_dict(text.state_dict(), strict=False)
        if lock_image:
            model.lock_image_tower()
        if lock_text:
            model.lock_text_tower()
        return model

    def to_hf_clip(self):
        """A ``transformers.CLIPModel`` with these weights (CLIP towers only)."""
        from transformers import CLIPConfig, CLIPModel

        vc, tc = self.vision_model.config, self.text_model.config
        if (vc.model_type, tc.model_type) != (_CLIP_TYPES["vision"], _CLIP_TYPES["text"]):
            raise ValueError(f"to_hf_clip needs CLIP towers, got {vc.model_type} and {tc.model_type}")
        if (self.vision_pooling, self.text_pooling) != ("cls", "eos"):
            raise ValueError(
                f"to_hf_clip needs CLIP's pooling (vision 'cls', text 'eos'), got "
                f"{self.vision_pooling!r} and {self.text_pooling!r}"
            )
        config = CLIPConfig(
            vision_config=vc.to_dict(), text_config=tc.to_dict(), projection_dim=self.embed_dim,
            logit_scale_init_value=self.logit_scale.item(),
        )
        hf = CLIPModel(config)
        hf.vision_model.load_state_dict(self.vision_model.state_dict())
        hf.text_model.load_state_dict(self.text_model.state_dict())
        hf.visual_projection.load_state_dict(self.visual_projection.state_dict())
        hf.text_projection.load_state_dict(self.text_projection.state_dict())
        with torch.no_grad():
            hf.logit_scale.copy_(self.logit_scale.detach())
        return hf

    # -- disk ------------------------------------------------------------------------------------

    def config_dict(self) -> Dict[str, Any]:
        return {
            "vision_config": self.vision_model.config.to_dict(),
            "text_config": self.text_model.config.to_dict(),
            "embed_dim": self.embed_dim,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "text_pooling": self.text_pooling,
            "vision_pooling": self.vision_pooling,
            "lock_image": self.image_locked,
            "lock_text": self.text_locked,
            **self._loss_settings,
        }

    def save(
        self, folder: str, tokenizer: Optional[CaptionTokenizer] = None,
        logit_scale: Optional[torch.Tensor] = None, logit_bias: Optional[torch.Tensor] = None,
    ) -> None:
        """Write ``clip_config.json``, ``model.safetensors`` and, if given, the tokenizer.

        ``logit_scale`` (log of the scale) and SigLIP's ``logit_bias`` are saved in place of the
        model's own, e.g. by a trainer whose loss module held them while the model was built with
        ``with_loss=False``; a bias makes the folder a SigLIP model (``loss_impl: siglip``).
        """
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        config = self.config_dict()
        if logit_bias is not None:
            config["loss_impl"] = "siglip"
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=1)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        for name, value in (("logit_scale", logit_scale), ("logit_bias", logit_bias)):
            if value is not None:
                state[f"loss.{name}"] = value.detach().float().reshape(()).cpu().clone()
        save_file(state, os.path.join(folder, WEIGHTS_NAME))
        if tokenizer is not None:
            tokenizer.save(folder)

    @classmethod
    def load(cls, folder: str, **overrides) -> "ClipModel":
        """Rebuild a model written by ``save`` (``overrides`` replace saved settings, e.g.
        ``lock_image=True`` or ``loss_impl="vanilla"``)."""
        from safetensors.torch import load_file

        path = os.path.join(folder, CONFIG_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no {CONFIG_NAME} in {folder!r} (a folder written by ClipModel.save)")
        with open(path) as f:
            config = json.load(f)
        config.update(overrides)
        vision, text = config.pop("vision_config"), config.pop("text_config")
        lock_image, lock_text = config.pop("lock_image", False), config.pop("lock_text", False)
        model = cls(vision, text, **config)
        state = load_file(os.path.join(folder, WEIGHTS_NAME))
        if model.loss is None:
            state.pop("loss.logit_scale", None)
            state.pop("loss.logit_bias", None)
        elif "loss.logit_scale" not in state:
            raise ValueError(f"{folder!r} holds no logit scale: load it with with_loss=False")
        model.load_state_dict(state)
        if lock_image:
            model.lock_image_tower()
        if lock_text:
            model.lock_text_tower()
        return model


def load_clip(folder: str, **overrides):
    """``(ClipModel, CaptionTokenizer)`` from a folder written by ``ClipModel.save``."""
    return ClipModel.load(folder, **overrides), CaptionTokenizer.load(folder)
