"""Attention over the paged KV cache, registered through transformers' `AttentionInterface`.

The model is called with packed tokens (`[1, num_tokens]`, every row's new tokens one after
another) and a `paged_metadata` kwarg that transformers forwards to the attention function.
`PagedLayer.update` has already written the new keys / values into the pool and hands the pool
to us as `key` / `value`; the forward's `PagedAttentionMetadata` comes as a `paged_metadata`
keyword when the model passes its kwargs down, else from the cache write just before.

Two implementations, chosen per forward (`attention_backend`):
- "triton" (CUDA, the default there): our Triton kernel (`kernels/paged_attention.py`) reads each
  row's keys / values through the block table in place: no copy of the context per layer. The
  model's mask is handed to it as causal + sliding window when it is transformers' own causal /
  sliding-window function (read from the function itself, `structured_mask`), else evaluated into
  a dense per-row mask it applies as given.
- "torch" (CPU, and the reference): scatter the packed queries into a padded `[rows,
  max_query_len]` batch, gather each row's keys / values from its blocks, and run PyTorch's SDPA
  with the mask the metadata builds. A feature the kernel cannot take (MLA latents, a dtype other
  than fp32 / bf16 / fp16) runs here too, with a one-time warning naming it.

Masks: the model builds each layer's mask through transformers' `masking_utils` as it does for
plain generate() (causal, sliding window, chunks: whatever it chose for the layer); our mask
interface (`paged_mask`) keeps the index function it composed, and the attention evaluates it at
every row's own positions. A `sliding_window` keyword is only a hint for flash-attention kernels:
the mask already carries the window (Moshi passes a window to the config but builds a causal mask,
and plain generate() follows the mask). Everything else the model hands its attention function is
honoured or refused: `softcap` (Gemma 2 logit soft-capping) and attention sinks (`s_aux`, gpt-oss;
`sinks`) take the explicit path below, which follows transformers' own eager attention for those
models step for step. Keywords that select other keys raise `UnsupportedAttentionError` naming
them: a silently dropped feature changes the output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    sliding_window_overlay,
)

from .own_attention import runs_own_attention
from .paged_cache import PagedAttentionMetadata, active_metadata, gather_rows

ATTENTION_NAME = "hf_specdec_paged"

# keywords models hand their attention function that select keys the paged path would not
# (T5-style `position_bias`, MiniMax's `block_indices`): refused at once (DeepSeek-V3.2's sparse
# `indices` are honoured). Every other keyword is recorded per forward, and the architecture probe refuses the
# ones that are not plain forward flags (`architectures.py`), so nothing new passes unchecked.
UNSUPPORTED_KEYWORDS = frozenset({"position_bias", "block_indices", "attention_chunk_size"})


BACKEND_ENV_VAR = "HF_SPECDEC_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "torch")


def attention_backend(device: torch.device) -> str:
    """The implementation the paged attention runs for tensors on `device`: "triton" or "torch".

    `$HF_SPECDEC_ATTENTION_BACKEND`, read once per forward: "auto" (the default) runs the Triton
    kernel on CUDA when triton is installed and the reference otherwise; "triton" and "torch" force
    one. Forcing "triton" on CPU needs TRITON_INTERPRET=1 set before triton is first imported
    (Triton's interpreter: for tests).
    """
    choice = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV_VAR}={choice!r} is not a backend; allowed: {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    return choice


class UnsupportedAttentionError(ValueError):
    """The model handed its attention function something the paged attention cannot honour."""


@dataclass(frozen=True)
class ModelMask:
    """What the model's own mask creation (`masking_utils.create_causal_mask`,
    `create_sliding_window_causal_mask`, chunked, ...) hands the attention function of one layer:
    the index function it composed, which `PagedAttentionMetadata.attention_mask` evaluates at
    each row's positions. So every layer gets exactly the mask plain generate() gives it."""

    mask_function: Callable
    # a prepared mask, as transformers' mask creation tells it from a 2-D padding mask: a model whose outer
    # forward builds the mask and hands it to its language model (PaliGemma) gets it back from there (`paged_mask`)
    ndim = 4

    def __getitem__(self, index) -> torch.Tensor:
        """The dense mask `[rows, 1, queries, S]` of the forward in progress, indexed: only for models
        with sparse indexed attention, whose indexer reads its layer's mask as a tensor (DeepSeek-V3.2
        takes `mask[:, 0]`); those run one row per forward, so the layout is that row's. Other models
        get the TypeError any non-tensor gives, which the architecture probe reports as a model reading
        its mask itself."""
        meta = active_metadata()
        if meta is None or not meta.indexed:
            raise TypeError("'ModelMask' object is not subscriptable")
        dense = meta.attention_mask(self.mask_function)
        if dense is None:  # nothing hidden
            dense = torch.ones((1, 1, *meta.query_valid.shape[1:], meta.key_span), dtype=torch.bool, device=meta.seq_lens.device)
        return dense[index]


def paged_mask(*args, mask_function: Callable = causal_mask_function, **kwargs) -> ModelMask:
    """The mask interface of the paged attention (registered with transformers'
    `AttentionMaskInterface`): keep the model's mask function instead of materialising a mask over
    its single-batch layout, which is not the packed varlen layout the paged attention runs. A mask
    the model prepared already passes as it is, as transformers' own creation returns a prepared 4-D mask."""
    given = kwargs.get("attention_mask")
    return given if isinstance(given, ModelMask) else ModelMask(mask_function)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,  # for flash kernels, which take no mask: the model's mask carries it
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    is_causal: bool | None = None,
    indices: torch.Tensor | None = None,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[1, heads, tokens, dim]`; key / value: the layer's pools `[blocks, block_size, kv_heads, dim]`
    (or, for MLA caches, each row's keys / values `[rows, kv_heads, S, dim]`).

    `indices` (sparse indexed attention, DeepSeek-V3.2): `[1, queries, topk]`, the keys each query
    may see (of those its mask lets it), chosen by the model's indexer over the row's keys.

    Returns `[1, tokens, heads, dim]`, as transformers' attention functions do.
    """
    meta = paged_metadata or active_metadata()
    if meta is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs a PagedKVCache forward (it runs only inside hf_specdec)")
    _check_features(module, dropout, is_causal, kwargs)
    meta.count("attention_calls")
    meta.scratch.setdefault("attention_keywords", set()).update(k for k, v in kwargs.items() if v is not None)
    if isinstance(attention_mask, ModelMask):
        meta.scratch.setdefault("layer_masks", {}).setdefault(getattr(module, "layer_idx", None), attention_mask)
    elif attention_mask is not None:  # a mask the model built itself, not through masking_utils
        meta.scratch.setdefault("tensor_mask_layers", set()).add(getattr(module, "layer_idx", None))
    mask_function = attention_mask.mask_function if isinstance(attention_mask, ModelMask) else None
    sink_logits = s_aux if s_aux is not None else sinks
    if meta.tree_mask is not None and structured_mask(mask_function)[1] is not None:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} has a sliding-window layer: tree drafts are not supported with sliding windows"
        )
    if "attention_backend" not in meta.scratch:
        meta.scratch["attention_backend"] = attention_backend(query.device)
    if meta.scratch["attention_backend"] == "triton" and not _KERNEL_FAILED and indices is None:
        refused = _kernel_refuses(query, key, meta)
        if refused is None:
            try:
                return _kernel_attention(query, key, value, meta, mask_function, scaling, softcap, sink_logits), None
            except Exception as error:  # noqa: BLE001 - any failure to build or launch it on this GPU
                if _kernel_forced() or _KERNEL_WORKED:
                    raise
                # chosen by "auto" and never run here (a Triton / driver this kernel was not tested with):
                # the reference path gives the same result, so use it for the rest of the process
                _KERNEL_FAILED.append(repr(error))
                _warn_once(f"hf_specdec: the paged attention kernel failed on this device ({error!r}); "
                           f"using the gather + SDPA path (set {BACKEND_ENV_VAR}=triton to see the error)")
        else:
            _warn_once(f"hf_specdec: the paged attention kernel cannot take {refused}; using the gather + SDPA path")

    num_rows, max_query_len = meta.query_valid.shape
    if meta.kv_gathered:
        keys, values = key, value
    else:
        keys, values = gather_rows(key, meta, "keys"), gather_rows(value, meta, "values")
    head_dim = query.shape[-1]
    if meta.query_index is None:  # one row: the packed layout is already [1, heads, tokens, dim]
        queries = query
    else:
        queries = query[0].transpose(0, 1).index_select(0, meta.query_index)
        queries = queries.view(num_rows, max_query_len, -1, head_dim).transpose(1, 2)

    # a plain causal mask is built from positions alone (and, for one query reading exactly its row's keys,
    # not at all: SDPA runs faster without one); other functions are evaluated
    mask = meta.attention_mask(None if structured_mask(mask_function) == (True, None) else mask_function)
    if indices is not None:
        mask = _with_indices(mask, indices, meta)
    if softcap is None and sink_logits is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != queries.shape[1]
        )
    else:
        out = _explicit_attention(queries, keys, values, mask, scaling, softcap, sink_logits)
    out = out.transpose(1, 2)  # [rows, max_q, heads, dim]
    if meta.query_index is None:
        return out, None
    return out[meta.query_valid].unsqueeze(0), None


def _with_indices(mask: torch.Tensor | None, indices: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
    """`mask` (None: all keys) keeping only the keys each query's `indices` select (one row per forward)."""
    num_rows, max_query_len = meta.query_valid.shape
    if num_rows != 1 or indices.shape[-2] != max_query_len:
        raise UnsupportedAttentionError(
            f"sparse attention indices of shape {tuple(indices.shape)} for {num_rows} rows of {max_query_len} queries: "
            "indexed attention runs one row per forward"
        )
    selected = torch.zeros((1, 1, max_query_len, meta.key_span), dtype=torch.bool, device=indices.device)
    selected.scatter_(-1, indices.reshape(1, 1, max_query_len, -1).long(), True)
    return selected if mask is None else mask & selected


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_FAILED: list[str] = []  # the error that made "auto" give up on the kernel in this process
_KERNEL_WORKED = False


def _kernel_forced() -> bool:
    return os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() == "triton"
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _kernel_refuses(query: torch.Tensor, key: torch.Tensor, meta: PagedAttentionMetadata) -> str | None:
    """Why the kernel cannot run this layer (None: it can)."""
    if meta.kv_gathered:
        return "MLA latents (the cache hands attention each row's expanded keys, not the pool)"
    if query.dtype not in _KERNEL_DTYPES or key.dtype != query.dtype:
        return f"query dtype {query.dtype} with key dtype {key.dtype} (it takes float32, bfloat16, float16)"
    if query.shape[-1] != key.shape[-1]:
        return f"queries of width {query.shape[-1]} against keys of width {key.shape[-1]}"
    return None


# the code objects of transformers' mask factories, to recognise the functions they build
_AND_MASKS_CODE = and_masks(causal_mask_function).__code__
_SLIDING_WINDOW_CODE = sliding_window_overlay(1).__code__


def _closure(function: Callable) -> dict:
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))


def structured_mask(mask_function: Callable | None) -> tuple[bool, int | None]:
    """(is it causal + window, the window) for a layer's mask function.

    transformers' causal function, and `and_masks` of it with sliding-window overlays (what
    `create_sliding_window_causal_mask` builds), are recognised from the functions themselves (their
    code and the window their closure holds), so the kernel computes them from positions alone.
    Anything else (chunks, padding, image-token overlays, a function of the model's own) gives
    (False, None): the kernel then applies the function evaluated into a dense mask.
    """
    if mask_function is None or mask_function is causal_mask_function:
        return True, None
    if getattr(mask_function, "__code__", None) is not _AND_MASKS_CODE:
        return False, None
    causal, window = False, None
    for part in _closure(mask_function).get("mask_functions", ()):
        if part is causal_mask_function:
            causal = True
        elif getattr(part, "__code__", None) is _SLIDING_WINDOW_CODE and isinstance(
            size := _closure(part).get("sliding_window"), int
        ):
            window = size if window is None else min(window, size)
        else:
            return False, None
    return (True, window) if causal else (False, None)


def _kernel_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: PagedAttentionMetadata,
    mask_function: Callable | None,
    scaling: float | None,
    softcap: float | None,
    sink_logits: torch.Tensor | None,
) -> torch.Tensor:
    """The Triton kernel over the pool in place; `[1, tokens, heads, dim]`."""
    from ..kernels.paged_attention import paged_attention  # triton is optional: imported when used

    causal, window = structured_mask(mask_function)
    dense = None if causal else meta.attention_mask(mask_function)[:, 0]  # the tree mask is inside it
    global _KERNEL_WORKED
    out = paged_attention(
        query[0].transpose(0, 1),
        key_pool,
        value_pool,
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        max_query_len=meta.query_valid.shape[1],
        max_seq_len=meta.max_seq_len,
        window=window,
        mask=dense,
        tree_mask=meta.tree_mask if causal else None,
        softcap=softcap,
        sinks=sink_logits,
    )
    _KERNEL_WORKED = True
    return out.unsqueeze(0)


def _check_features(module: torch.nn.Module, dropout: float, is_causal: bool | None, extra: dict) -> None:
    unsupported = sorted(name for name in UNSUPPORTED_KEYWORDS if extra.get(name) is not None)
    if unsupported:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} passes {unsupported} to its attention function; the paged attention does not "
            "implement that, so it cannot speculate on this model exactly"
        )
    if is_causal is False:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} asks for non-causal (bidirectional) attention; only causal decoding is supported"
        )
    if dropout and module.training:
        raise UnsupportedAttentionError("attention dropout is active (model.train()): call model.eval() first")


def _explicit_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
    sink_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Soft-capped and / or sink attention, the way transformers' eager functions for Gemma 2 and
    gpt-oss compute it (SDPA has neither): scores, cap, mask, softmax (in float32 for the cap, in
    the scores' dtype with the max subtracted for sinks, as each model does), weights x values."""
    groups = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sink_logits is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    else:
        sinks = sink_logits.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(values.dtype)
    return torch.matmul(weights, values)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)


class ModelInUseError(RuntimeError):
    """Another thread is speculating with this model instance (see `use_paged_attention`)."""


# id(model) -> (the thread inside use_paged_attention, its nesting depth)
_IN_USE: dict[int, tuple[int, int]] = {}
_IN_USE_LOCK = threading.Lock()


def in_use_by_another_thread(model: PreTrainedModel) -> bool:
    """Whether another thread is speculating on this model instance right now."""
    owner = _IN_USE.get(id(model))
    return owner is not None and owner[0] != threading.get_ident()


@contextlib.contextmanager
def held_by_this_thread(model: PreTrainedModel) -> Iterator[None]:
    """This thread holds `model` for the block: another thread's `use_paged_attention` (or hold) raises
    `ModelInUseError` meanwhile. Nesting in the same thread is fine."""
    key, thread = id(model), threading.get_ident()
    with _IN_USE_LOCK:
        owner, depth = _IN_USE.get(key, (thread, 0))
        if owner != thread:
            raise ModelInUseError(
                f"another thread is speculating with this {type(model).__name__} instance (as target or drafter); "
                "its attention is switched for that call, so use one model (and drafter) instance per thread "
                "(they may share a SuffixCache)"
            )
        _IN_USE[key] = (thread, depth + 1)
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            if depth:
                _IN_USE[key] = (thread, depth)
            else:
                del _IN_USE[key]


@contextlib.contextmanager
def use_paged_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through the paged function for the duration of the block.

    The previous implementation comes back afterwards, so plain `generate()` is untouched.
    Every config in the model that names an attention implementation is switched (the text
    config of a multimodal model, sub-configs of composite ones).

    The switch is a setting of the model every forward reads, so one model instance speculates in
    one thread at a time (`held_by_this_thread`): a second thread is refused (RuntimeError) rather
    than left to run on the other's attention, or to restore the wrong setting.
    """
    with held_by_this_thread(model):
        if runs_own_attention(model):  # it keeps its own attention (`own_attention.py`)
            yield
            return
        configs = _attention_configs(model)
        previous = [config._attn_implementation for config in configs]
        try:
            for config in configs:
                config._attn_implementation = ATTENTION_NAME
            yield
        finally:
            for config, name in zip(configs, previous):
                config._attn_implementation = name


def _attention_configs(model: torch.nn.Module) -> list:
    """The distinct configs of `model` and its submodules (their attention layers read `config._attn_implementation`)."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen[id(config)] = config
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    for config in (model.config, text):
        if config is not None and id(config) not in seen:
            seen[id(config)] = config
    return list(seen.values())
