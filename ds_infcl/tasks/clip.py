"""The CLIP image-text task for the trainer: towers, webdataset batches, zero-shot evaluation.

``ClipTask`` follows the trainer's ``Task`` interface (``ds_infcl.tasks.base``) by its methods;
``batches`` yields plain dicts with the fields of the trainer's ``Batch`` (``query_inputs``,
``key_inputs``, ``sample_index``), which the trainer accepts. The trainer knows it as
``task.name: "clip"``.

Images travel as ``uint8`` pixels by default (``image_dtype``) and the model normalizes them on
the device: a quarter of the host memory of float32 batches, which matters at global batches of
tens of thousands (a 32k batch of 224 px images is 4.9 GB in uint8). Training images get
OpenCLIP's random-resized crop (``random_crop_scale``, default 0.9-1.0 of the area); they are
decoded by the loader workers with PIL (``decode: "cpu"``) or, from the JPEG bytes the workers
pass, on this rank's GPU with nvjpeg (``decode: "gpu"``, ``ds_infcl.data.device_decode``).

Data: the built-in digits only when asked for by name (``data_dir: "builtin:digits"``, the
default; written on first use to ``$DS_INFCL_DIGITS`` or ``data/digits``), or a shard folder with
``train.json``/``heldout.json`` manifests written by the shard writer or ``ds_infcl.data.synthetic``
(and optionally ``zero_shot.json``: ``class_names``, ``templates``), or a folder the digits
writer wrote before, or explicit brace patterns (``train_shards``, ``heldout_shards``). A folder
that does not exist, holds no manifest, or whose manifest names missing shards is a
``ConfigError`` naming the path, before anything is built; ``--check`` writes nothing.

Model: a named architecture (``arch``) trained from scratch, or a folder (``model_path``): one
written by ``ClipModel.save`` or a Hugging Face ``CLIPModel`` checkpoint. The tokenizer comes
from ``tokenizer_path``, else the model folder, else it is trained on the training captions
(deterministically, so every rank builds the same one).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from ds_infcl.adapters.clip import CONFIG_NAME, ClipModel
from ds_infcl.adapters.clip_eval import evaluate_encoders
from ds_infcl.adapters.clip_tokenizer import CaptionTokenizer
from ds_infcl.data import BadSampleTally, ImageTextShards, ImageTransform, image_text_loader, read_captions
from ds_infcl.data.device_decode import EncodedImages, JpegBatchDecoder, gpu_decode_problem
from ds_infcl.data.rebatch import Rebatch, ThreadedPrefetch
from ds_infcl.data.transforms import check_crop_scale
from ds_infcl.errors import ConfigError
from ds_infcl.tasks.base import Task
from ds_infcl.tasks.clip_data import (
    BUILTIN_DATA,
    checked_shard_list,
    builtin_digits_dir,
    ensure_digits_shards,
    resolve_data_dir,
    scan_index_bound,
)

__all__ = ["ClipTask", "caption_ids", "ensure_digits_shards", "BUILTIN_DATA", "builtin_digits_dir", "resolve_data_dir",
           "scan_index_bound"]


def _summed_over_ranks(n: int) -> int:
    """``n`` summed over the ranks where torch.distributed is initialized (a collective: every
    rank calls it), else ``n``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(n)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, int(n))
    return sum(gathered)


def _log_bad_image(message: str) -> None:
    logging.getLogger(__name__).warning("GPU decode skipped a bad image (counted as bad_image): %s", message)


def caption_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[b]`` id of each caption's token sequence (equal captions, equal ids, on every
    rank): a polynomial hash of the attended tokens, wrapping in int64."""
    tokens = torch.where(attention_mask.bool(), input_ids.long() + 1, torch.zeros_like(input_ids, dtype=torch.long))
    powers = torch.full((tokens.shape[1],), 1_000_003, dtype=torch.long).cumprod(0)
    return (tokens * powers).sum(dim=1)


class ClipTask(Task):
    """CLIP on image + caption shards (the built-in digits by default, by name).

    Args:
        data_dir: ``"builtin:digits"`` (written on first use, see ``builtin_digits_dir``) or an
            existing folder with ``train.json`` and ``heldout.json`` manifests (and
            ``zero_shot.json`` for zero-shot prompts), or one the digits writer wrote.
        train_shards, heldout_shards: brace patterns, instead of ``data_dir``'s manifests.
        arch: named architecture or JSON file, trained from scratch (ignored with ``model_path``).
        model_path: a ``ClipModel.save`` folder or a local HF ``CLIPModel`` checkpoint.
        tokenizer_path: folder with ``tokenizer.json``; default ``model_path``, else trained.
        tokenizer_kind, context_length, vocab_size: for a trained tokenizer.
        lock_image, lock_text: LiT-style locked towers.
        init_temperature: initial temperature of the learnable scale (CLIP: 0.07).
        class_names, zero_shot_templates: zero-shot prompts (default: the digits').
        shuffle_buffer, num_workers, resampled: the training stream (``repeat`` unless
            ``resampled``). Each DataLoader worker builds whole per-rank batches.
        prefetch_factor: batches each worker prepares ahead (host memory: ``num_workers *
            prefetch_factor`` batches in flight).
        random_crop_scale: area range ``[lo, hi]`` of the training random-resized crop (OpenCLIP's
            ``RandomResizedCrop`` scale, default ``[0.9, 1.0]``); ``None`` trains on the evaluation
            transform (shorter side resized, centre crop). (Replaces ``random_crop: lo``.)
        decode: ``"cpu"`` (loader workers decode with PIL) or ``"gpu"`` (workers pass JPEG bytes
            and crop boxes; this process decodes each batch on its CUDA device with torchvision's
            batched nvjpeg ``decode_jpeg`` and crops/resizes it there: see
            ``ds_infcl.data.device_decode``). ``"gpu"`` needs torchvision and CUDA (a config
            error otherwise, also under ``--check``) and ``image_dtype: uint8``; the trainer
            pins only host tensors, so ``data.pin_memory`` may stay ``"auto"``.
        decode_batch: images per batched device decode call (``decode: gpu``).
        worker_batch_size: samples per loader-worker batch; the rank assembles its batch from
            them (``None``: each worker builds whole per-rank batches). Small worker batches (a few
            hundred) keep the workers' shared memory small and the first batch early at large
            per-rank batches (a 16k batch of 224 px images is 2.5 GB per worker otherwise).
        prefetch_batches: batches assembled (with ``decode: gpu``, decoded on a side CUDA stream)
            ahead in a background thread while the step runs, when batches are reassembled
            (``worker_batch_size`` or ``decode: gpu``); 0 does it inline.
        report_data_time: rank 0 prints, per batch, the seconds the trainer waited for it (the
            trainer's step time excludes them) and the cycle since the previous request
            (``[clip data] batch k waited W s, cycle C s``): ``global batch / C`` is the
            end-to-end rate.
        eval_batch_size: held-out batch size.
        positives: ``"pair"`` (image i with its own caption) or ``"caption"`` (with ``loss.impl:
            siglip``: every image whose caption is the same text is a positive too, so that
            duplicated captions are not pushed apart; ids from the caption's tokens).
        image_dtype: ``"uint8"`` (pixels normalized by the model on the device) or ``"float32"``.
        seed: data seed of the digits split and captions.
    """

    name = "clip"

    def __init__(
        self,
        data_dir: Optional[str] = "builtin:digits",
        *,
        train_shards: Optional[str] = None,
        heldout_shards: Optional[str] = None,
        arch: str = "digits-tiny",
        model_path: Optional[str] = None,
        tokenizer_path: Optional[str] = None,
        tokenizer_kind: str = "wordlevel",
        context_length: int = 16,
        vocab_size: int = 8192,
        lock_image: bool = False,
        lock_text: bool = False,
        init_temperature: float = 0.07,
        class_names: Optional[Sequence] = None,
        zero_shot_templates: Optional[Sequence[str]] = None,
        shuffle_buffer: int = 1000,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        resampled: bool = False,
        random_crop_scale: Optional[Sequence[float]] = (0.9, 1.0),
        decode: str = "cpu",
        decode_batch: int = 1024,
        worker_batch_size: Optional[int] = None,
        prefetch_batches: int = 1,
        report_data_time: bool = False,
        random_crop: Optional[float] = None,
        eval_batch_size: int = 512,
        positives: str = "pair",
        image_dtype: str = "uint8",
        seed: int = 0,
    ):
        if positives not in ("pair", "caption"):
            raise ValueError(f"positives must be 'pair' or 'caption', got {positives!r}")
        self.positives = positives
        if init_temperature <= 0:
            raise ValueError(f"init_temperature must be > 0, got {init_temperature}")
        if image_dtype not in ("uint8", "float32"):
            raise ValueError(f"image_dtype must be 'uint8' (normalized on the device) or 'float32', got {image_dtype!r}")
        self.image_dtype = image_dtype
        if random_crop is not None:
            raise ConfigError(f"task.args.random_crop was replaced by random_crop_scale: give "
                              f"random_crop_scale: [{random_crop}, 1.0] (or null for no crop)")
        try:
            self.random_crop_scale = check_crop_scale(random_crop_scale)
        except ValueError as e:
            raise ConfigError(f"task.args.{e}") from None
        if decode not in ("cpu", "gpu"):
            raise ConfigError(f"task.args.decode must be 'cpu' (loader workers decode with PIL) or 'gpu' "
                              f"(batched nvjpeg on this rank's device), got {decode!r}")
        if decode == "gpu":
            if image_dtype != "uint8":
                raise ConfigError("task.args.decode: 'gpu' yields uint8 pixels (normalized by the model on the "
                                  f"device); set image_dtype: uint8 (got {image_dtype!r})")
            problem = gpu_decode_problem()
            if problem is not None:
                raise ConfigError(f"task.args.decode: 'gpu' needs torchvision (torchvision.io.decode_jpeg) and a "
                                  f"CUDA device, but {problem}; use decode: 'cpu' (loader workers decode with "
                                  "PIL) or install the torchvision that matches torch")
        if decode_batch < 1:
            raise ConfigError(f"task.args.decode_batch must be >= 1, got {decode_batch}")
        if prefetch_batches < 0:
            raise ConfigError(f"task.args.prefetch_batches must be >= 0 (0: inline), got {prefetch_batches}")
        if worker_batch_size is not None and worker_batch_size < 1:
            raise ConfigError(f"task.args.worker_batch_size must be >= 1 or null (whole batches), got {worker_batch_size}")
        self.decode, self.decode_batch, self.prefetch_batches = decode, decode_batch, prefetch_batches
        self.worker_batch_size = worker_batch_size
        self.report_data_time = report_data_time
        if prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        self.prefetch_factor = prefetch_factor
        info: Dict[str, Any] = {}
        if train_shards is None:
            if data_dir is None:
                raise ConfigError("task.args: give data_dir or train_shards")
            info = resolve_data_dir(str(data_dir), seed=seed)
            if info is None:  # --check before the built-in digits are written: nothing to read
                self._unbuilt = True
                return
            train_shards = info["train"]["urls"]
            if heldout_shards is None and "heldout" in info:
                heldout_shards = info["heldout"]["urls"]
        self._unbuilt = False
        self._index_bound: Optional[int] = info.get("index_bound")
        # Shard lists with their sizes (a sizes.json, a manifest, or counted once and cached: not
        # under --check, which writes nothing), so that samples lost in a damaged shard are exact.
        self.train_shards = checked_shard_list(train_shards, "train_shards")
        self.heldout_shards = None if heldout_shards is None else checked_shard_list(heldout_shards, "heldout_shards")
        self.class_names = class_names if class_names is not None else info.get("class_names")
        self.zero_shot_templates = (
            zero_shot_templates if zero_shot_templates is not None else info.get("zero_shot_templates")
        )
        self.arch = arch
        self.model_path = model_path
        self.lock_image, self.lock_text = lock_image, lock_text
        self.init_temperature = init_temperature
        self.shuffle_buffer = shuffle_buffer
        self.num_workers = num_workers
        self.resampled = resampled
        self.eval_batch_size = eval_batch_size

        self.damaged_caption_shards: List[Any] = []
        self.tokenizer = self._build_tokenizer(tokenizer_path or model_path, tokenizer_kind, context_length,
                                               vocab_size)
        self._towers: Optional[ClipModel] = None
        self._heldout: Optional[List[Dict[str, Any]]] = None
        self.tally = BadSampleTally()
        self.batches_consumed = 0

    def _build_tokenizer(self, tok_dir, kind: str, context_length: int, vocab_size: int):
        """The caption tokenizer: loaded from ``tok_dir``, else trained on the training captions."""
        if tok_dir is not None and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            return CaptionTokenizer.load(tok_dir)
        captions = read_captions(self.train_shards, damaged=self.damaged_caption_shards)
        return CaptionTokenizer.train(captions, kind=kind, context_length=context_length, vocab_size=vocab_size)

    # -- the Task interface ----------------------------------------------------------------------

    def sample_index_bound(self) -> int:
        """One more than the largest global index of the training samples (FastCLIP's table
        size): the digits' row count, else scanned once from the shards' json members."""
        if self._index_bound is None:
            self._index_bound = scan_index_bound(self.train_shards)
        return self._index_bound

    def build_towers(self) -> ClipModel:
        """The towers without a loss (the trainer owns the ``ContrastiveLoss``)."""
        kwargs = dict(lock_image=self.lock_image, lock_text=self.lock_text, with_loss=False)
        if self.model_path is None:
            towers = ClipModel.from_architecture(self.arch, self.tokenizer, **kwargs)
        elif os.path.exists(os.path.join(self.model_path, CONFIG_NAME)):
            towers = ClipModel.load(self.model_path, **kwargs)
        else:
            towers = ClipModel.from_hf_clip(self.model_path, **kwargs)
        self._towers = towers
        return towers

    def loss_defaults(self) -> Dict[str, Any]:
        return {
            "symmetric": True,
            "init_logit_scale": math.log(1 / self.init_temperature),
            "max_logit_scale": math.log(100.0),
            "learnable_scale": True,
        }

    def build_loss(self, loss_config):
        """The trainer's default loss (``Task.build_loss``); ``positives: caption`` needs a loss
        that takes several positives per query (SigLIP's)."""
        from ds_infcl.loss import loss_features, losses_with

        if self.positives == "caption" and "multi_positive" not in loss_features(loss_config.impl):
            wanted = " or ".join(repr(n) for n in losses_with("multi_positive"))
            raise ValueError(f"task.args.positives: 'caption' needs loss.impl {wanted} (got {loss_config.impl!r}): "
                             "the InfoNCE losses take one positive per query")
        return super().build_loss(loss_config)

    def check_loss(self, loss_config) -> None:
        """``Task.check_loss``; under ``--check`` before the built-in digits exist there is no data
        to size FastCLIP's tables from yet, so nothing is checked."""
        if not self._unbuilt:
            super().check_loss(loss_config)

    def _transform(self, train: bool) -> ImageTransform:
        towers = self._towers if self._towers is not None else None
        if towers is None:
            raise RuntimeError("build_towers() must run before the data (it fixes the image size)")
        if train and self.random_crop_scale is not None:
            return ImageTransform(towers.image_size, towers.image_mean, towers.image_std, train=True,
                                  random_crop_scale=self.random_crop_scale, output=self.image_dtype)
        return ImageTransform(towers.image_size, towers.image_mean, towers.image_std, output=self.image_dtype)

    def batches(
        self, *, rank: int, world_size: int, local_batch_size: int, start_step: int, seed: int
    ) -> Iterator[Dict[str, Any]]:
        """Endless stream of this rank's batches: dicts with ``query_inputs`` (images
        ``[b, 3, H, W]``), ``key_inputs`` (``input_ids``, ``attention_mask`` ``[b, L]``) and
        ``sample_index`` (``[b]`` global index). ``start_step`` batches are skipped (decoded and
        dropped: the stream is a deterministic function of seed, rank and worker count)."""
        self._rank = rank
        transform = self._transform(train=True)
        gpu = self.decode == "gpu"
        worker_batch = self.worker_batch_size or local_batch_size
        rebatch = gpu or worker_batch != local_batch_size
        dataset = ImageTextShards(
            self.train_shards, image_transform=EncodedImages(transform) if gpu else transform,
            batch_size=worker_batch, tokenizer=self.tokenizer, rank=rank, world_size=world_size,
            shuffle_buffer=self.shuffle_buffer, repeat=not self.resampled, resampled=self.resampled,
            drop_last=not rebatch, seed=seed,  # Rebatch refills across worker batches and drops once, at the end
        )
        loader_kwargs = {"prefetch_factor": self.prefetch_factor} if self.num_workers > 0 else {}
        stream = iter(image_text_loader(dataset, num_workers=self.num_workers, **loader_kwargs))
        prefetch = None
        if rebatch:
            device = self.decode_device() if gpu else torch.device("cpu")
            decoder = JpegBatchDecoder(transform.image_size, device, decode_batch=self.decode_batch) if gpu else None
            self._decoder = decoder
            rebatcher = Rebatch(stream, local_batch_size, self.tally, decoder=decoder,
                                pin=not gpu and torch.cuda.is_available(), on_failure=_log_bad_image,
                                defer_counts=True)  # counted as the trainer takes each batch (prefetch reads ahead)
            stream = iter(rebatcher)
            if self.prefetch_batches:
                stream = prefetch = ThreadedPrefetch(stream, device, depth=self.prefetch_batches)
            count = rebatcher.count
        else:
            count = self.tally.update
        try:
            for _ in range(start_step):
                count(next(stream))
            self.batches_consumed = start_step
            yield from self._steps(stream, count, rank)
        finally:
            if prefetch is not None:
                prefetch.close()

    def _steps(self, stream, count, rank: int) -> Iterator[Dict[str, Any]]:
        """The trainer's dicts from the loader's (or the device decoder's) batches; with
        ``report_data_time``, rank 0 prints per batch how long the trainer waited for it and the
        time since its previous request (a whole step as the trainer runs it: wait, placement,
        step, logging), so that ``global batch / cycle`` is the end-to-end rate."""
        report = self.report_data_time and rank == 0
        sync = self.decode == "gpu" and report  # the wait includes this batch's device decode (not the next's)
        asked, previous = time.perf_counter(), None
        for batch in stream:
            count(batch)
            self.batches_consumed += 1
            out = {
                "query_inputs": batch["image"],
                "key_inputs": {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                "sample_index": batch["idx"],
            }
            if self.positives == "caption":
                ids = caption_ids(batch["input_ids"], batch["attention_mask"])
                out["loss_inputs"] = {"query_ids": ids, "key_ids": ids}
            if report:
                if sync and batch["image"].is_cuda:
                    torch.cuda.current_stream(batch["image"].device).synchronize()
                cycle = "" if previous is None else f", cycle {asked - previous:.4f} s"
                print(f"[clip data] batch {self.batches_consumed} waited {time.perf_counter() - asked:.4f} s{cycle}",
                      flush=True)
            yield out
            previous, asked = asked, time.perf_counter()

    @staticmethod
    def decode_device() -> torch.device:
        """This rank's CUDA device for ``decode: gpu``: ``LOCAL_RANK`` (set by the launchers), else
        the current device."""
        local = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())

    def heldout_batches(self) -> List[Dict[str, Any]]:
        """The held-out set, decoded once (every rank evaluates all of it)."""
        if self._heldout is None:
            if self.heldout_shards is None:
                self._heldout = []
            else:
                data = ImageTextShards(
                    self.heldout_shards, image_transform=self._transform(train=False),
                    batch_size=self.eval_batch_size, shuffle_shards=False, split="sample",
                )
                self._heldout = list(data)
        return self._heldout

    def evaluate(self, encoder, step: int) -> Dict[str, float]:
        """Zero-shot accuracy and recall@1/5/10 on the held-out shards (see ``evaluate_encoders``),
        plus ``bad_samples``: the training samples skipped so far, an integer summed over the ranks
        (the sum of the reasons of ``data_report``; every rank calls ``evaluate``)."""
        metrics: Dict[str, float] = {"bad_samples": _summed_over_ranks(self.tally.total)}
        batches = self.heldout_batches()
        if not batches:
            return metrics

        def encode_text(texts: List[str]) -> torch.Tensor:
            tokens = self.tokenizer(texts)
            return encoder.encode_key({"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]})

        metrics.update(evaluate_encoders(
            encoder.encode_query, encode_text, batches,
            class_names=self.class_names, templates=self.zero_shot_templates,
        ))
        return metrics

    def data_report(self) -> Dict[str, int]:
        """This rank's counts of training samples not trained on, by reason (the engine sums them
        over ranks): bad samples, samples lost in a damaged shard (exact when the shard's size is
        known), samples missing from a short shard, a dropped final partial batch; and shards the
        caption tokenizer could not read (rank 0)."""
        counts = dict(self.tally.counts)
        if getattr(self, "_rank", 0) == 0 and self.damaged_caption_shards:
            counts["damaged_shards_at_tokenizer_build"] = len(self.damaged_caption_shards)
        return counts

    def state_dict(self) -> Dict[str, Any]:
        return {"batches_consumed": self.batches_consumed, "bad_samples": self.tally.counts}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # The position is replayed from the trainer's start_step; nothing else to restore.
        pass

    def save_pretrained(self, folder: str, towers: ClipModel, logit_scale: torch.Tensor,
                        logit_bias: Optional[torch.Tensor] = None) -> None:
        """Write the trained model (towers, the trainer's logit scale and, for SigLIP, bias,
        tokenizer) as a folder that ``ClipModel.load`` / ``load_clip`` read."""
        towers.save(folder, tokenizer=self.tokenizer, logit_scale=logit_scale, logit_bias=logit_bias)
