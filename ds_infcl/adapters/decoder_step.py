"""The decoder step: Hugging Face decoder towers (Qwen2, Llama, Mistral ...) without compute on
padding, with Liger-Kernel's fused ops, with layer checkpointing only where a chunk would not fit,
and their model FLOPs by the LLM formula.

**Packing** (``pack_texts``, ``pool_packed``). A chunk of ``n`` tokenized texts (``[n, S]`` ids and
attention mask, left or right padded) becomes ``R`` rows of ``L`` tokens: every text's tokens
placed whole in one row (first-fit decreasing by length), position ids restarting at 0 for each
text, and no pad token except at the end of a row (and in the whole rows added to round ``R`` up to
a multiple of ``rows_multiple``, so that compiled blocks see few shapes). The decoder runs with
``position_ids`` and no attention mask: transformers (>= 4.47, ``masking_utils``) then reads the
restarts as document boundaries and keeps attention within each text, as a block-diagonal causal
mask for ``sdpa`` / ``eager``, as varlen for ``flash_attention_2``. The tail pad tokens of a row
come after its texts, so causal attention never lets a text see them. Rows of ``L = S`` (the
longest text or the truncation length) make the attention cost ``R * L^2 <= n * S^2`` with a dense
mask; the linear layers see only the real tokens and the tails. Pooling (``lasttoken``, ``cls``,
``mean``) reads each text's own tokens in the packed layout; embeddings equal the padded ones to
rounding (rotary embeddings depend on relative positions only).

**Liger-Kernel** (``apply_liger``): its fused RMSNorm, SwiGLU MLP and RoPE patched into a loaded
model instance (``liger_kernel``'s own per-architecture patch, its loss patches off), parameter
names unchanged. Optional: needs ``pip install liger-kernel`` and CUDA.

**Layer checkpointing** (``LayerCheckpointing``): ``True`` / ``False``, or ``"auto"``: before
each forward with gradients on CUDA the activations of the call (``activation_bytes``: tokens x
layers x the bytes one token keeps alive in one layer, by the shapes) are compared with the device
memory still free; the layers recompute in the backward only when they would not fit. Each change
of the decision is logged.

**FLOPs** (``decoder_flops``): the usual dense-decoder formula. Forward, per text of ``l`` tokens:
``2 N l`` (``N``: the weights of every linear layer of the decoder blocks, with the grouped
key/value shapes as built: q, k, v, o and the MLP; embeddings and biases not counted) plus the
attention ``2 * 2 * layers * l^2 * head_dim * num_heads`` (scores and the weighted sum, the causal
half counted in full, as PaLM's appendix B and ``bench_decoder`` count); training is 3 x forward.
Only real tokens count (packing's tails and padding are not model FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ds_infcl.errors import ConfigError

__all__ = [
    "PackedTexts", "pack_texts", "pool_packed", "pool_padded", "PACKED_POOLING", "decoder_matmul_params",
    "decoder_flops", "apply_liger", "LayerCheckpointing", "activation_bytes", "decoder_layers", "liger_available",
    "check_decoder_options", "TokenTally", "LIGER_MARK", "LIGER_WITH_COMPILE",
]

# apply_liger sets this attribute on the model it patched (the kernels applied): model.compile
# refuses towers that carry it (train/model.py, compile_towers).
LIGER_MARK = "ds_infcl_liger_kernels"
# Why model.compile refuses Liger (train/preflight.check_compile from the task's args, before
# anything is built; train/model.compile_towers from the mark).
LIGER_WITH_COMPILE = (
    "model.compile with the task's liger: true: Liger-Kernel's Triton kernels inside compiled blocks "
    "crashed the GPU (illegal memory access; liger-kernel 0.8.5, torch 2.11, triton 3.6). Set one of "
    "them false; compiled blocks with packing were the faster step (docs/retrieval.md)"
)


PACKED_POOLING = ("lasttoken", "cls", "mean")


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


@dataclass
class PackedTexts:
    """``n`` texts packed into ``R`` rows of ``L`` tokens.

    Attributes:
        input_ids: ``[R, L]`` token ids (tails: ``pad_token_id``).
        position_ids: ``[R, L]``: ``0 .. l-1`` over each text, tails restarting at 0.
        starts: ``[n]`` flat index (into ``R * L``) of each text's first token.
        lengths: ``[n]`` tokens of each text.
        num_tokens: real tokens (``lengths.sum()``).
        sum_sq_tokens: ``sum(lengths ** 2)`` (the attention term of the FLOPs).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    num_tokens: int
    sum_sq_tokens: int


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Tuple[List[int], List[int], List[int]]:
    """Row and offset of each length (longest first, each into the first row with room) and the
    fill of every row."""
    rows: List[int] = [0] * len(lengths)
    offsets: List[int] = [0] * len(lengths)
    fill: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        length = lengths[i]
        for r, used in enumerate(fill):
            if used + length <= capacity:
                break
        else:
            r = len(fill)
            fill.append(0)
        rows[i], offsets[i] = r, fill[r]
        fill[r] += length
    return rows, offsets, fill


def pack_texts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], *, row_tokens: Optional[int] = None,
               rows_multiple: int = 1, pad_token_id: int = 0) -> PackedTexts:
    """Pack ``[n, S]`` padded texts into rows without padding between texts (module docstring).

    Args:
        input_ids: ``[n, S]`` token ids.
        attention_mask: ``[n, S]``, one contiguous run of ones per row (left or right padding);
            ``None``: no padding.
        row_tokens: tokens per row ``L`` (at least the longest text; default: the longest text).
        rows_multiple: round the number of rows up to a multiple of this (whole pad rows).
        pad_token_id: the id put in the tails.

    Raises:
        ValueError: a text with no token, a mask that is not one run of ones per row, or
            ``row_tokens`` shorter than a text.
    """
    n, width = input_ids.shape
    device = input_ids.device
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    cols = torch.arange(width, device=device)
    lengths_t = mask.sum(1)
    first = torch.where(mask, cols, width).amin(1)
    last = torch.where(mask, cols, -1).amax(1)
    lengths, spans = torch.stack([lengths_t, last - first + 1]).tolist()  # the one sync of the packing
    if any(length == 0 for length in lengths):
        raise ValueError(f"packing: {lengths.count(0)} of {n} texts have no token (an all-zero attention mask row)")
    if lengths != spans:
        raise ValueError("packing: the attention mask must be one run of ones per row (left or right padding); "
                         "got gaps inside a row")
    capacity = max(lengths) if row_tokens is None else int(row_tokens)
    if capacity < max(lengths):
        raise ValueError(f"packing: row_tokens={capacity} is shorter than the longest text ({max(lengths)} tokens)")
    rows, offsets, fill = _first_fit_decreasing(lengths, capacity)
    num_rows = -(-len(fill) // rows_multiple) * rows_multiple
    fill += [0] * (num_rows - len(fill))
    starts = torch.tensor([r * capacity + o for r, o in zip(rows, offsets)], dtype=torch.long).to(device)
    # every real token: its text, its place in the text, its place in the packed rows
    text_of = torch.repeat_interleave(torch.arange(n, device=device), lengths_t)
    cum = torch.cumsum(lengths_t, 0) - lengths_t
    within = torch.arange(int(sum(lengths)), device=device) - cum[text_of]
    dest = starts[text_of] + within
    packed = torch.full((num_rows * capacity,), pad_token_id, dtype=input_ids.dtype, device=device)
    packed[dest] = input_ids[mask]
    fill_t = torch.tensor(fill, dtype=torch.long).to(device)
    positions = (torch.arange(capacity, device=device)[None, :] - fill_t[:, None]).clamp_min(0).reshape(-1)
    positions[dest] = within
    return PackedTexts(packed.view(num_rows, capacity), positions.view(num_rows, capacity), starts, lengths_t,
                       int(sum(lengths)), int(sum(length * length for length in lengths)))


def pool_packed(hidden: torch.Tensor, packed: PackedTexts, mode: str) -> torch.Tensor:
    """``[n, H]`` pooled embeddings from the packed ``[R, L, H]`` hidden states: each text's last
    token (``lasttoken``), first token (``cls``) or the mean over its tokens (``mean``, summed in
    the hidden states' dtype as sentence-transformers' mean pooling does)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if mode == "lasttoken":
        return flat[packed.starts + packed.lengths - 1]
    if mode == "cls":
        return flat[packed.starts]
    if mode == "mean":
        width = int(packed.lengths.max())
        offsets = torch.arange(width, device=flat.device)
        valid = offsets[None, :] < packed.lengths[:, None]
        index = torch.where(valid, packed.starts[:, None] + offsets[None, :], torch.zeros_like(valid, dtype=torch.long))
        tokens = flat[index] * valid[..., None].to(flat.dtype)
        return tokens.sum(1) / packed.lengths[:, None].to(flat.dtype)
    raise ValueError(f"packing pools with one of {PACKED_POOLING}, got {mode!r}")


def pool_padded(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor], mode: str) -> torch.Tensor:
    """``[n, H]`` pooled embeddings from padded ``[n, S, H]`` hidden states (the reference of
    ``pool_packed``): the last / first attended token, or the mean over attended tokens."""
    n, width = hidden.shape[:2]
    mask = torch.ones(n, width, dtype=torch.bool, device=hidden.device) if attention_mask is None \
        else attention_mask.bool()
    cols = torch.arange(width, device=hidden.device)
    rows = torch.arange(n, device=hidden.device)
    if mode == "lasttoken":
        return hidden[rows, torch.where(mask, cols, -1).amax(1)]
    if mode == "cls":
        return hidden[rows, torch.where(mask, cols, width).amin(1)]
    if mode == "mean":
        m = mask[..., None].to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1)
    raise ValueError(f"pooling must be one of {PACKED_POOLING}, got {mode!r}")


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a transformers model (also under a peft wrapper): its outermost
    ``nn.ModuleList`` of layers."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "layer", "h", "blocks"):
            return module
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder layers")


def decoder_matmul_params(model: nn.Module) -> int:
    """``N`` of the FLOPs formula: the weights of every ``nn.Linear`` inside the decoder blocks (q,
    k, v, o with their grouped key/value shapes, the MLP), LoRA adapters left out. ZeRO-3
    partitioned weights count by their full size (``ds_numel``)."""
    total = 0
    for name, module in decoder_layers(model).named_modules():
        if isinstance(module, nn.Linear) and "lora_" not in name:
            total += int(getattr(module.weight, "ds_numel", module.weight.numel()))
    return total


def decoder_flops(config, matmul_params: int, num_tokens: int, sum_sq_tokens: int) -> float:
    """Training FLOPs of texts with ``num_tokens`` real tokens in all and ``sum_sq_tokens`` the sum
    of their squared lengths: ``3 * (2 N num_tokens + 4 layers head_dim heads sum_sq_tokens)``
    (module docstring)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 4 * config.num_hidden_layers * head_dim * heads
    return 3.0 * (2.0 * matmul_params * num_tokens + attention * sum_sq_tokens)


class TokenTally:
    """Real tokens of tokenized batches (``attention_mask`` sums): examples, tokens, and the sum of
    squared text lengths, for ``decoder_flops`` per example."""

    def __init__(self):
        self.examples = self.tokens = self.sum_sq = 0

    def add(self, num_examples: int, *inputs: Dict[str, torch.Tensor]) -> None:
        """Count ``num_examples`` examples whose texts are the rows of ``inputs`` (tokenized dicts)."""
        for features in inputs:
            ids, mask = features["input_ids"], features.get("attention_mask")
            lengths = mask.sum(1).long() if mask is not None else torch.full((ids.shape[0],), ids.shape[1])
            self.tokens += int(lengths.sum())
            self.sum_sq += int((lengths ** 2).sum())
        self.examples += num_examples

    def flops_per_example(self, config, matmul_params: int) -> float:
        return decoder_flops(config, matmul_params, self.tokens, self.sum_sq) / self.examples


# ----------------------------------------------------------------------------------------------
# Liger-Kernel
# ----------------------------------------------------------------------------------------------


def apply_liger(model: nn.Module) -> List[str]:
    """Patch Liger-Kernel's fused RMSNorm, SwiGLU MLP and RoPE into ``model`` (a transformers
    decoder instance, before any peft wrapping), in place; returns the kernels applied.

    Liger's per-architecture patch (``MODEL_TYPE_TO_APPLY_LIGER_FN``) rebinds the forwards of the
    norm and MLP modules of this instance (same parameters, same names) and sets the module-level
    ``apply_rotary_pos_emb`` of the architecture (every model of that type in the process). Its
    loss patches stay off: an embedder has no LM head.

    Raises:
        ConfigError: liger-kernel is not installed, or has no patch for this model type.
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        raise ConfigError(f"liger: true needs `pip install liger-kernel` (ds_infcl[gpu]) and CUDA; import failed: {e}") from None
    import inspect

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise ConfigError(f"liger: liger-kernel has no kernels for model type {model_type!r}; it supports "
                          f"{sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}; set liger: false")
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
    params = inspect.signature(fn).parameters
    fn(model=model, **{k: v for k, v in wanted.items() if k in params})
    applied = [k for k in ("rope", "rms_norm", "swiglu") if k in params]
    setattr(model, LIGER_MARK, applied)
    return applied


# ----------------------------------------------------------------------------------------------
# Layer checkpointing only where the chunk would not fit
# ----------------------------------------------------------------------------------------------


def activation_bytes(config, num_tokens: int, dtype: torch.dtype) -> int:
    """Activations a forward with gradients keeps for the backward, without layer checkpointing,
    for ``num_tokens`` tokens (an estimate by the shapes, per token and layer): two RMSNorms (an
    float32 input and normalized copy each, and the output), the post-RoPE q, k, v, the attention
    output and the o-projection input, and the MLP's gate, up, activation and product."""
    e = torch.finfo(dtype).bits // 8
    h, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    per_token_layer = 2 * (8 * h + e * h) + e * (q + 2 * kv) + 2 * e * q + 4 * e * inter
    return int(num_tokens) * config.num_hidden_layers * per_token_layer


class LayerCheckpointing:
    """Whether the decoder layers of ``model`` recompute in the backward: ``True``, ``False`` or
    ``"auto"`` (decided before every forward with gradients, see the module docstring).

    ``"auto"`` keeps ``SAFETY`` x the estimate below the device's free memory (the driver's free
    memory plus what torch's allocator holds unused). On CPU it never checkpoints (no device memory
    to budget). ``decisions`` counts the calls of each choice.
    """

    SAFETY = 1.25

    def __init__(self, model: nn.Module, setting: Union[bool, str], log: Callable[[str], None] = print):
        if setting not in (True, False, "auto"):
            raise ConfigError(f"gradient_checkpointing: true, false or \"auto\", got {setting!r}")
        self.setting, self.log = setting, log
        self.layers = list(decoder_layers(model))
        self.config = model.config
        self.decisions: Dict[bool, int] = {True: 0, False: 0}
        self._last: Optional[bool] = None
        if setting is not False:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(f"gradient_checkpointing: {type(model).__name__} does not support it; set it false")
            kwargs = {"use_reentrant": False}  # nests in GradCache's chunk checkpoints
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def decide(self, num_tokens: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Set the layers' flag for a forward of ``num_tokens`` tokens and return it."""
        if self.setting != "auto":
            return bool(self.setting)
        on = False
        if torch.is_grad_enabled() and device.type == "cuda":
            need = self.SAFETY * activation_bytes(self.config, num_tokens, dtype)
            free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
                - torch.cuda.memory_allocated(device)
            on = need > free
            if on != self._last:
                self.log(f"[ds_infcl] gradient_checkpointing auto: {num_tokens} tokens need ~{need / 2**30:.1f} GiB "
                         f"of activations, {free / 2**30:.1f} GiB free: layers {'recompute' if on else 'keep activations'}")
                self._last = on
        for layer in self.layers:
            layer.gradient_checkpointing = on
        self.decisions[on] += 1
        return on


def liger_available() -> bool:
    """Whether liger-kernel imports (GPU tests pick their path with it)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def check_decoder_options(*, packing: bool, liger: bool, is_decoder: bool, pooling: Optional[str] = None) -> None:
    """``ConfigError`` for packing or liger on a model they do not apply to."""
    if packing and not is_decoder:
        raise ConfigError("packing: true works with decoder-only models (Qwen2, Llama, Mistral ...); this model is an "
                          "encoder: set packing false")
    if packing and pooling is not None and pooling not in PACKED_POOLING:
        raise ConfigError(f"packing: pooling {pooling!r} is not supported packed; use one of {PACKED_POOLING} or "
                          "packing false")
    if liger and not is_decoder:
        raise ConfigError("liger: true applies to decoder-only models; set liger false")
