"""Which models the paged cache and attention run exactly: decided by what a model does, not its name.

A model is supported when it is a decoder-only causal LM whose attention runs through transformers'
`AttentionInterface` and whose cache layers are all attention layers (full, sliding-window or
chunked); everything its attention function is handed is honoured (`paged_attention.py`) or
refused. (transformers' `_supports_attention_backend` flag is not the test: it marks what vLLM-style
backends can serve, and is False on models, hybrid ones among them, whose attention does go
through the interface.) `check_architecture` checks the configuration first (cheap, and the reasons users need),
then runs a probe: two small packed forwards on a scratch `PagedKVCache`, which must

- route every layer's attention through the paged function, each after its own cache write (a
  model that computes attention itself, or shares one layer's cache with another, fails here);
- hand the attention function nothing it cannot honour (`UnsupportedAttentionError`);
- in float32, give the same logits as the model's own forward over the same tokens, so a mask or
  position rule the paged path does not know shows up as a refusal, not as wrong tokens. Where the
  prompt attends both ways (PaliGemma), a prefix is prefilled by the model's own forward (`prefill.py`)
  and the rest is checked against plain `generate()`'s logits after that prefix.

Where the paged probe fails for a reason the model's own code would not, the same probe runs on the
model's own attention and cache (`own_attention.py`), one row per forward, then, for a model whose
cache layers are all plain, batched; a model that passes runs that way. A model whose padded rows
plain `generate()` itself reads differently from the rows alone (positions counted from the cache,
GIT's mask) is supported for unpadded batches only: `padded_batch_problem` gives the reason, and
`generate()` refuses a left-padded batch with it. An encoder-decoder model's decoder skips the paged
probe: it runs on its own attention, each row over its own encoder output (`EncoderDecoderRowCache`),
checked by the same probe over an encoder output for a random source (`_probe_encoder_inputs`), then
batched the same way (`EncoderDecoderBatchedCache`) where that passes too.

A bfloat16 / float16 model is probed on float32 copies of its weights (`_float32_copies`): the logits checks
compare to a tolerance its rounding would exceed. The verdict is kept per model object, so the probe runs once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils.generic import TransformersKwargs

from .forward import forward_tokens
from .own_attention import (
    BatchedOwnAttentionCache,
    EncoderDecoderBatchedCache,
    EncoderDecoderRowCache,
    OwnAttentionCache,
    RowOwnAttentionCache,
    batches_plainly,
    encoder_input_name,
    encoder_token_embeddings,
    generate_passes_position_ids,
    mark_own_attention,
)
from .paged_attention import (
    ModelInUseError,
    UnsupportedAttentionError,
    held_by_this_thread,
    use_paged_attention,
)
from .paged_cache import PagedKVCache, UnsupportedMaskError, UnsupportedModelError, layer_attention
from .prefill import model_prefill_problem, prefill_with_model, prompt_attends_both_ways

_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PADDED_BATCH_PROBLEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason
_PADDING_ENDS_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its padding id
# how far the probe's logits may stray from the model's own forward (float32): attention
# implementations differ by ~1e-6; a wrong mask or position differs by orders of magnitude more
PROBE_TOLERANCE = 1e-3


def check_architecture(model: PreTrainedModel, role: str = "target") -> None:
    """Raise `UnsupportedModelError` (a ValueError) naming the model type and the reason when
    hf_specdec cannot speculate on `model` exactly; `role` ("target", "draft") goes in the message."""
    verdict = _VERDICTS.get(model)
    if verdict is None:
        verdict = _VERDICTS[model] = _verdict(model)
    if verdict:
        raise UnsupportedModelError(f"{role} model: {verdict}")


def padded_batch_problem(model: PreTrainedModel, length: int | None = None) -> str:
    """Why plain generate() gives a left-padded row of `model` other tokens than the row alone ('' when it
    does not), for rows that grow to `length` tokens, padding included (None: any length). The loop runs
    every row unpadded, so on such a model only unpadded batches can be exact."""
    check_architecture(model)
    return _PADDED_BATCH_PROBLEMS.get(model, "") or _indexer_padding_problem(model, length)


def padding_ends_forward(model: PreTrainedModel) -> int | None:
    """The padding id of an encoder-decoder model whose decoder numbers a forward's tokens by counting those that
    are not the padding id (fairseq's positions: M2M-100, NLLB-MoE, SpeechT5), else None. Plain generate() feeds
    it one token a time, so a token after the padding id in a forward of several reads another position: the
    loop ends a row's forward at the padding id (`loop/step.py`). Known once `check_architecture` has run."""
    return _PADDING_ENDS_FORWARD.get(model)


def _indexer_padding_problem(model: PreTrainedModel, length: int | None) -> str:
    """Sparse indexed attention (DeepSeek-V3.2's DSA) attends to the `index_topk` keys its indexer scores
    highest. Within that many tokens every key is kept and a padded row reads as the row alone; past it,
    plain generate() can give a padded row other tokens (tiny Mistral Large 4 and Hy-V4-VL at 20-26 tokens, index_topk 16)."""
    topk = getattr(model.config.get_text_config(), "index_topk", None)
    if topk is None or (length is not None and length <= topk):
        return ""
    return (
        f"its sparse attention keeps each query's top index_topk={topk} keys, and past {topk} tokens (prompt width "
        "plus max_new_tokens) plain generate() gives a left-padded row other tokens than the row alone"
    )


def _verdict(model: PreTrainedModel) -> str:
    """'' when supported (on the paged path, or else on the model's own attention), else why not."""
    config = model.config
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    try:
        problem = _static_reason(model, config, text)
    except UnsupportedModelError as error:
        problem = str(error)
    if not problem:
        try:
            copies = _float32_copies(model)
        except UnsupportedModelError as error:
            problem = str(error)
    if not problem:
        # the probes' logits checks run in float32, whatever the model's precision; no other thread runs it meanwhile
        with held_by_this_thread(model), _in_float32(copies):
            if config.is_encoder_decoder:  # its decoder runs on its own attention (cross-attention: `EncoderDecoderRowCache`)
                problem = _checked(_own_attention_problem, model, "its decoder does not run on its own cache")
                if not problem:
                    batched = batches_plainly(model) and not _checked(_batched_problem, model, "batched")
                    mark_own_attention(model, batched=batched)
                    padding = _padding_numbering(model)
                    if padding is not None:
                        _PADDING_ENDS_FORWARD[model] = padding
                    return ""
                return f"model_type={model_type!r} is not supported: {problem}"
            try:
                problem = _checked(_probe, model, "its forward does not run on the paged KV cache")
            except _NoFallback as error:
                problem = str(error)
            else:
                if problem and not prompt_attends_both_ways(model):  # own attention: no own-forward prefill there
                    own_problem = _checked(_own_attention_problem, model, "its forward does not run on its own cache")
                    if not own_problem:
                        padded = _PADDED_BATCH_PROBLEMS[model] = _checked(_padded_generate_problem, model, "plain generate() fails")
                        # one forward for the batch where plain generate()'s left-padded batch is what the rows alone give
                        batched = not padded and batches_plainly(model) and not _checked(_batched_problem, model, "batched")
                        mark_own_attention(model, batched=batched)
                        return ""
                    problem = f"{problem}; on its own attention and cache: {own_problem}"
                else:
                    _PADDED_BATCH_PROBLEMS[model] = _checked(_left_padding_problem, model, "a left-padded forward fails")
    if not problem:
        return ""
    return problem if problem.startswith("model_type=") else f"model_type={model_type!r} is not supported: {problem}"


class _NoFallback(UnsupportedModelError):
    """A reason the paged probe found that the model's own attention would not fix either."""


def _checked(probe: Callable[[PreTrainedModel], str], model: PreTrainedModel, failing: str) -> str:
    """`probe(model)`, with what it raises as the reason (`failing`, then the error)."""
    try:
        return probe(model)
    except _NoFallback:
        raise
    except (UnsupportedModelError, UnsupportedAttentionError, UnsupportedMaskError) as error:
        return str(error)
    except ModelInUseError:  # says nothing about the model: no verdict is kept
        raise
    except Exception as error:  # anything a forward raises there means it does not fit
        return f"{failing} ({type(error).__name__}: {error})"


def _static_reason(model: PreTrainedModel, config, text) -> str:
    """What the configuration and class say, most telling reason first; '' when nothing rules the model out."""
    if getattr(text, "is_encoder_decoder", False) and not getattr(config, "is_encoder_decoder", False):
        return "its text model is an encoder-decoder inside a model that is not (generate() runs no encoder for it)"
    if getattr(text, "add_cross_attention", False) and not config.is_encoder_decoder:
        return "its layers cross-attend to encoder states (add_cross_attention)"
    if not model.can_generate():
        return f"{type(model).__name__} cannot generate (not a causal LM with a generation head)"
    if not type(model)._supports_default_dynamic_cache():
        return "it keeps its own cache class instead of transformers' Cache layers"
    layer_attention(config)  # recurrent / linear-attention / other layer kinds: raises with the layer named
    if prompt_attends_both_ways(model) and model_prefill_problem(model):  # every prompt needs the model's own prefill
        return f"its prompt attends both ways (use_bidirectional_attention), and {model_prefill_problem(model)}"
    return ""


def _rollback_problem(model: PreTrainedModel, cache: PagedKVCache, tokens: torch.Tensor, last_logits: torch.Tensor) -> str:
    """Roll row 0 back by one token and feed that token again: its logits must come out as before
    (float32; other dtypes only check that the rollback runs). '' when they do."""
    length = len(tokens)
    try:
        cache.rollback(0, length - 1)
        again = forward_tokens(
            model, cache, [0], [1], tokens[-1:].to(model.device), torch.tensor([length - 1], device=model.device),
            np.arange(1),
        )[0].float().cpu()
    except (IndexError, RuntimeError, ValueError) as error:
        return f"its recurrent layers do not keep the per-token states a rollback needs ({type(error).__name__}: {error})"
    if next(model.parameters()).dtype == torch.float32:
        error = float((again - last_logits).abs().max())
        if error > PROBE_TOLERANCE * (1.0 + float(last_logits.abs().max())):
            return f"rolling its recurrent state back one token changes its logits by {error:.3g} (float32)"
    return ""


def _routing_problem(meta, attention_layers: int, reusing_layers: int, finished: bool) -> str:
    """'' when the forward's cache writes and paged attention calls add up (so far, when it failed
    midway): one write per attention layer, and attention calls from those and from the layers
    reusing another layer's cache."""
    calls = 0 if meta is None else meta.scratch.get("attention_calls", 0)
    writes = 0 if meta is None else meta.scratch.get("cache_writes", 0)
    readers = writes + reusing_layers
    # differential attention (DiffLlama) attends twice to each layer's one write: any multiple is fine
    calls_per_reader = calls // readers if readers and calls % readers == 0 else 0
    if not finished:
        return "" if writes <= calls else _not_routed(writes, calls, attention_layers)
    if attention_layers == 0:  # a purely recurrent model (Mamba): no attention to route
        return "" if writes == calls == 0 else _not_routed(writes, calls, attention_layers)
    if writes == attention_layers and calls_per_reader >= 1:
        return ""
    if writes == 0:
        return "its attention layers never write a KV cache (the model keeps none)"
    return _not_routed(writes, calls, attention_layers)


def _not_routed(writes: int, calls: int, attention_layers: int) -> str:
    return (
        f"{writes} cache writes and {calls} paged attention calls per forward for its {attention_layers} attention "
        "layers: its attention is not all routed through transformers' AttentionInterface after a cache update"
    )


def _mask_disagrees_with_cache(layer_kinds: list, layer_masks: dict) -> str:
    """'' when each layer's mask keeps what its cache layer keeps; else the first layer where not.

    transformers' cache drops keys a sliding (or chunked) layer no longer needs, and the mask the
    model builds for that layer is expected to hide them too. Where the two disagree (a sliding cache
    layer under a causal mask), plain generate() attends to everything while prefilling and only to the
    window while decoding: behaviour no single mask reproduces.
    """
    for index, mask in layer_masks.items():
        if index is None or not 0 <= index < len(layer_kinds):
            continue
        kind, size = layer_kinds[index]
        if kind not in ("sliding", "chunked"):
            continue
        far = torch.tensor([[[[2 * size]]]]), torch.tensor([[[[size - 1 if kind == "sliding" else 0]]]])
        zero = torch.zeros((1, 1, 1, 1), dtype=torch.long)
        if bool(mask.mask_function(zero, zero, *far)):
            return (
                f"layer {index}'s cache keeps a {kind} window of {size} tokens but the mask the model builds for it "
                "does not: plain generate() then attends differently while prefilling and while decoding"
            )
    return ""


def _left_padding_problem(model: PreTrainedModel) -> str:
    """A model plain generate() hands no position_ids counts positions itself. Where left padding shifts
    them (Whisper's decoder counts from the cache length), a padded row of plain generate()'s batch reads
    differently from the row alone, which the loop gives."""
    if generate_passes_position_ids(model):
        return ""
    tokens = _probe_rows(model)[1]
    pad = int(model.generation_config.pad_token_id or 0)
    padded = torch.cat([torch.full((2,), pad, dtype=tokens.dtype), tokens])[None].to(model.device)
    mask = torch.cat([torch.zeros(2, dtype=torch.long), torch.ones(len(tokens), dtype=torch.long)])[None].to(model.device)
    with _probing(model):
        own = _own_forward_logits(model, tokens)
        logits = model(input_ids=padded, attention_mask=mask, use_cache=False).logits[0, 2:].float().cpu()
    error = float((logits - own).abs().max())
    if error > PROBE_TOLERANCE * (1.0 + float(own.abs().max())):
        return (
            f"its forward takes no position_ids and left padding changes its logits by {error:.3g} (float32): the "
            "positions it counts itself include the padding, so plain generate() gives a padded row other tokens"
        )
    return ""


@contextlib.contextmanager
def _probing(model: PreTrainedModel) -> Iterator[None]:
    """Eval mode and no grad for a probe; the model held by this thread throughout, so that its own
    forwards do not run on another thread's switched attention."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), held_by_this_thread(model):
            yield
    finally:
        model.train(was_training)


def _float32_copies(model: PreTrainedModel) -> dict[torch.Tensor, torch.Tensor]:
    """For a bfloat16 / float16 model: each of its parameters and buffers -> the float32 (or, for integer
    buffers, same) tensor the probes run it on; {} for a float32 model, or one holding quantized weights (its
    logits are not compared, as before). The probes decide by the model's code, not its precision, but half
    precision's rounding would hide a wrong mask or position inside their tolerance (bfloat16 BART, Zamba,
    DiffLlama passed before). The copies go on each tensor's own device where they fit in 80% of its free
    memory, else, for a model on one device, on the CPU; raises `UnsupportedModelError` where neither."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(not t.is_floating_point() or t.element_size() == 1 for t in model.parameters()):
        return {}
    half = [t for t in tensors if t.dtype in (torch.bfloat16, torch.float16)]
    if not half:
        return {}
    needed: dict[torch.device, int] = {}
    for tensor in half:
        needed[tensor.device] = needed.get(tensor.device, 0) + tensor.numel() * 4
    target = None
    if any(size > 0.8 * _free_memory(device) for device, size in needed.items()):
        everything = sum(t.numel() * 4 if t.is_floating_point() else t.numel() * t.element_size() for t in tensors)
        on_cpu = _free_memory(torch.device("cpu"))
        if len(needed) > 1 or everything > 0.8 * on_cpu:
            where = ", ".join(f"{size / 2**30:.1f} GiB on {device} ({_free_memory(device) / 2**30:.1f} free)" for device, size in needed.items())
            raise UnsupportedModelError(
                f"it could not be checked: the probes run {model.dtype} weights as float32 copies, which need {where}, "
                f"or {everything / 2**30:.1f} GiB of CPU memory ({on_cpu / 2**30:.1f} free); free memory, or load it in "
                "float32 once to see whether it is supported"
            )
        target = torch.device("cpu")
    return {
        t: t.data.to(device=target or t.device, dtype=torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype)
        for t in tensors
        if t.dtype in (torch.bfloat16, torch.float16) or (target is not None and t.device != target)
    }


@contextlib.contextmanager
def _in_float32(copies: dict[torch.Tensor, torch.Tensor]) -> Iterator[None]:
    """Each tensor of `copies` swapped for its float32 copy (`_float32_copies`), the originals put back after."""
    originals = {tensor: tensor.data for tensor in copies}
    try:
        for tensor, copy in copies.items():
            tensor.data = copy
        yield
    finally:
        for tensor, original in originals.items():
            tensor.data = original


def _free_memory(device: torch.device) -> int:
    """Bytes free on `device` (0 where it cannot be told: a meta or offloaded weight)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0


def _forward_parameters(model: PreTrainedModel) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _passed_through(model: PreTrainedModel) -> set[str]:
    """Keywords that reach an attention function only because the model hands its forward's
    kwargs down: the forward's own parameters and transformers' shared `TransformersKwargs`."""
    names = set(TransformersKwargs.__annotations__) | _forward_parameters(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(base, torch.nn.Module) and base is not model:
        names |= _forward_parameters(base)
    return names


def _probe(model: PreTrainedModel) -> str:
    """Two packed forwards on a scratch cache (two rows: 3 + 2 tokens, then 2 + 1), checked
    against the model's own forward; '' when they agree, else what went wrong. A model whose prompt
    attends both ways has its rows' first 3 and 2 tokens prefilled by its own forward (`prefill.py`), feeds
    the rest (2 + 1, then 1 + 1) and is checked against plain generate() given those first tokens."""
    rows = _probe_rows(model)
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4, max_rollback=2)
    prompt_lens = PREFILLED_PROMPT_LENGTHS if prompt_attends_both_ways(model) else None
    attention_layers = sum(kind in ("full", "sliding", "chunked", "indexed", "recurrent+attention") for kind, _ in cache.layer_kinds)
    reusing_layers = sum(kind == "reuse" for kind, _ in cache.layer_kinds)
    paged_logits: list[list[torch.Tensor]] = [[], []]
    keywords: set[str] = set()
    tensor_mask_layers: set = set()  # layers handed a mask the model built itself (ALiBi, hand-made masks)
    layer_masks: dict = {}  # layer index -> the ModelMask its attention got
    with _probing(model):
        chunks, cached, offsets = PROBE_CHUNKS, [0, 0], [0, 0]
        if prompt_lens:
            chunks = PREFILLED_PROBE_CHUNKS
            for row, length in enumerate(prompt_lens):
                prompt = rows[row][None, :length].to(model.device)
                prefilled = prefill_with_model(model, prompt, torch.ones_like(prompt), None, {}, cache, None, rows=[row])
                cached[row], offsets[row] = int(prefilled.num_cached[0]), int(prefilled.position_offsets[0])
        with use_paged_attention(model):
            for step in range(2):
                counts = [c[step] for c in chunks]
                try:
                    logits = _probe_forward(model, cache, rows, step, chunks, cached, offsets)
                except (UnsupportedAttentionError, UnsupportedMaskError):
                    raise
                except (AttributeError, TypeError) as error:
                    if "ModelMask" not in str(error):
                        raise
                    return (
                        "it reads the attention mask itself (ALiBi or a mask of its own making) instead of leaving "
                        "it to its attention function, which the paged attention replaces"
                    )
                except Exception as error:
                    # a layer that wrote the cache and then did its own attention trips over the paged
                    # pools (or the mask object) right there: say that rather than what it tripped on
                    routing = _routing_problem(cache.forward_metadata, attention_layers, reusing_layers, finished=False)
                    if routing:
                        return routing
                    raise error
                routing = _routing_problem(cache.forward_metadata, attention_layers, reusing_layers, finished=True)
                if routing:
                    return routing
                meta = cache.forward_metadata
                keywords |= meta.scratch.get("attention_keywords", set())
                layer_masks.update(meta.scratch.get("layer_masks", {}))
                tensor_mask_layers |= meta.scratch.get("tensor_mask_layers", set())
                for row, piece in enumerate(logits.split(counts)):
                    paged_logits[row].append(piece.float().cpu())
            if cache.recurrent is not None:
                rollback_error = _rollback_problem(model, cache, rows[0], paged_logits[0][-1][-1])
                if rollback_error:
                    return rollback_error
        if tensor_mask_layers:
            # the paged attention would replace it; and such a mask may differ from causal only past the
            # probe's short rows (GLM-5-Next builds one from its indexer's top-k), so no logits check vets it
            return (
                "its layers hand the attention function a mask of their own making (ALiBi, a hand-made or top-k "
                "mask) instead of transformers' mask functions, which the paged attention replaces"
            )
        inconsistent = _mask_disagrees_with_cache(cache.layer_kinds, layer_masks)
        if inconsistent:  # its own cache drops those keys while decoding only, as in plain generate()
            raise _NoFallback(inconsistent)
        unknown = sorted(keywords - _passed_through(model) - {"paged_metadata"})
        if unknown:
            return (
                f"its attention layers pass {unknown} to the attention function, which the paged attention "
                "does not implement"
            )
        return _logits_problem(model, rows, paged_logits, "on the paged cache", prompt_lens)


# the probes' rows: 5 and 3 tokens, fed in two forwards of these many tokens each
PROBE_LENGTHS, PROBE_CHUNKS = (5, 3), ((3, 2), (2, 1))
# batched, row 1 gets 1 token, then 2 after 3 columns of left padding: a position counted from the cache's width
# (not the row's own) is off by 3 there (by 1, the probe's logits of a tiny random Marian had strayed only 1e-3)
BATCHED_PROBE_CHUNKS = ((4, 1), (1, 2))
# where the prompt attends both ways: these many tokens of each row are the prompt, then the rest are fed from its
# last token on
PREFILLED_PROMPT_LENGTHS, PREFILLED_PROBE_CHUNKS = (3, 2), ((2, 1), (1, 1))


def _probe_rows(model: PreTrainedModel) -> list[torch.Tensor]:
    config = model.config.get_text_config()
    vocab = int(getattr(config, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in PROBE_LENGTHS]


def _probe_forward(
    model: PreTrainedModel, cache: PagedKVCache, rows: list[torch.Tensor], step: int,
    chunks: tuple[tuple[int, int], ...] = PROBE_CHUNKS, cached: Sequence[int] = (0, 0), offsets: Sequence[int] = (0, 0),
) -> torch.Tensor:  # fmt: skip
    """Every position's logits of the probe's forward `step` (0, 1) over both rows (`cached` tokens of each
    already in the cache, its positions its token counts plus `offsets`)."""
    starts = [first + sum(c[:step]) for first, c in zip(cached, chunks)]
    counts = [c[step] for c in chunks]
    ids = torch.cat([r[s : s + n] for r, s, n in zip(rows, starts, counts)])
    positions = torch.cat([torch.arange(s, s + n) + offset for s, n, offset in zip(starts, counts, offsets)])
    return forward_tokens(
        model, cache, [0, 1], counts, ids.to(model.device), positions.to(model.device), np.arange(sum(counts))
    )


def _logits_problem(
    model: PreTrainedModel, rows: list[torch.Tensor], fed_logits: list[list[torch.Tensor]], where: str,
    prompt_lens: Sequence[int] | None = None, encoder_inputs: Sequence[dict] = (),
) -> str:  # fmt: skip
    """'' when each row's logits fed in pieces `where` equal the model's own forward over the row (float32;
    other dtypes are not compared: rounding, not structure), or with `prompt_lens`, plain generate()'s
    logits from each row's prompt on (`_generated_logits`). `encoder_inputs`: each row's, for an encoder-decoder
    model's decoder."""
    if next(model.parameters()).dtype != torch.float32:
        return ""
    for row, tokens in enumerate(rows):
        if encoder_inputs:
            own = model(decoder_input_ids=tokens[None].to(model.device), **encoder_inputs[row], use_cache=False)
            own = own.logits[0].float().cpu()
        elif prompt_lens is None:
            own = _own_forward_logits(model, tokens)
        else:
            own = _generated_logits(model, tokens[: prompt_lens[row]], tokens[prompt_lens[row] :])
        fed = torch.cat(fed_logits[row])
        error = float((own - fed).abs().max())
        if error > PROBE_TOLERANCE * (1.0 + float(own.abs().max())):
            reference = "its own forward" if prompt_lens is None else "plain generate()'s after its own prefill"
            return (
                f"its logits {where} differ from {reference} by {error:.3g} (float32): its attention depends on "
                f"something {where} does not reproduce"
            )
    return ""


def _probe_encoder_inputs(model: PreTrainedModel) -> list[tuple[Any, torch.Tensor]] | None:
    """For an encoder-decoder model, what its decoder reads of each probe row's source (None for other models):
    its encoder's output (some decoders read more of it than the states: a downsampled mask, router logits) and
    mask, over a random source (`_probe_sources`) for row 0 and the first half of another alone for row 1, so
    that a batched cache pads row 1's (as the engine pads requests' sources of different lengths); both whole
    where the encoder takes one length only (Whisper's 30 s)."""
    if not model.config.is_encoder_decoder:
        return None
    encoder = model.get_encoder()
    for source, mask in _probe_sources(model, encoder):
        rows = _encoded_rows(model, encoder, source, mask)
        if rows is not None:
            return rows
    # no layout fits: random states, which is all most decoders read
    encoder_config = getattr(encoder, "config", model.config).get_text_config(encoder=True)
    hidden_size = getattr(encoder_config, "d_model", None) or encoder_config.hidden_size
    states = torch.randn((2, 6, hidden_size), generator=torch.Generator().manual_seed(1)).to(model.device, model.dtype)
    return [
        (BaseModelOutput(last_hidden_state=states[row : row + 1, :length]), torch.ones((1, length), dtype=torch.long, device=model.device))
        for row, length in ((0, 6), (1, 3))
    ]  # fmt: skip


def _encoded_rows(
    model: PreTrainedModel, encoder: torch.nn.Module, source: torch.Tensor, mask: torch.Tensor
) -> list[tuple[Any, torch.Tensor]] | None:
    """`_probe_encoder_inputs` for one layout of the sources: None if the encoder does not take it."""
    full = mask.shape[1]
    rows = []
    for row, lengths in ((0, [full]), (1, [int(mask[1].sum()), full])):
        for length in lengths:
            row_source = source[row : row + 1, :length] if source.ndim == 3 and source.shape[1] == full else source[row : row + 1, ..., :length]
            row_mask = torch.ones((1, length), dtype=torch.long, device=model.device)
            try:
                with torch.no_grad():
                    outputs = encoder(**{encoder_input_name(model): row_source.to(model.device), "attention_mask": row_mask})
            except (RuntimeError, ValueError, IndexError):  # a length or spectrogram layout the encoder does not take
                continue
            rows.append((outputs, row_mask))
            break
        if len(rows) == row:
            return None
    return rows


def _padding_numbering(model: PreTrainedModel) -> int | None:
    """The padding id where an encoder-decoder model's decoder gives a token after it in one forward another
    position than fed one token at a time (`padding_ends_forward`), else None."""
    padding = model.generation_config.pad_token_id
    if padding is None:
        padding = getattr(model.config.get_text_config(decoder=True), "pad_token_id", None)
    if not isinstance(padding, int):
        return None
    other = _probe_rows(model)[0][:2].clone()
    other[other == padding] = padding + 1
    tokens = torch.tensor([[int(other[0]), padding, int(other[1])]], device=model.device)
    encoder_outputs, mask = _probe_encoder_inputs(model)[0]
    inputs = {"encoder_outputs": encoder_outputs, "attention_mask": mask}
    with _probing(model):
        whole = model(decoder_input_ids=tokens, **inputs, use_cache=False).logits[0, -1].float()
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        for index in range(3):
            alone = model(decoder_input_ids=tokens[:, index : index + 1], **inputs, cache=cache, use_cache=True).logits[0, -1]
    error = float((alone.float() - whole).abs().max())
    return padding if error > PROBE_TOLERANCE * (1.0 + float(whole.abs().max())) else None


def _probe_sources(model: PreTrainedModel, encoder: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random sources of two rows for the encoder's main input, with its attention mask (the second row's last
    half padding): tokens, audio samples, or spectrograms in the layouts encoders take ([mel bins, frames] as
    Whisper, which wants its full 30 s of frames, or [frames, features])."""
    generator = torch.Generator().manual_seed(1)
    name, config = encoder_input_name(model), getattr(encoder, "config", model.config)  # (FSMT's encoder: no config)

    def padded(length: int) -> torch.Tensor:
        return torch.tensor([[1] * length, [1] * (length // 2) + [0] * (length - length // 2)])

    if name == "input_ids":
        vocab = encoder_token_embeddings(encoder).num_embeddings
        return [(torch.randint(3, vocab, (2, 6), generator=generator), padded(6))]
    if name == "input_values":
        return [(torch.randn((2, 2400), generator=generator), padded(2400))]
    channels = getattr(config, "input_feat_per_channel", 0) * getattr(config, "input_channels", 1)
    features = getattr(config, "num_mel_bins", None) or channels or getattr(config, "feature_size", None) or 80
    frames = 2 * getattr(config, "max_source_positions", 48)
    return [
        (torch.randn((2, features, frames), generator=generator), padded(frames)),
        (torch.randn((2, frames, features), generator=generator), padded(frames)),
    ]


def _own_forward_logits(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """The logits plain generate() gets for `tokens` in one forward: position ids counted from 0 when its
    `prepare_inputs_for_generation` hands them over (RoBERTa-style models count from the padding id only
    without them; Kosmos-2.5 drops them so that they do)."""
    inputs = {"input_ids": tokens[None].to(model.device)}
    if generate_passes_position_ids(model):
        inputs["position_ids"] = torch.arange(len(tokens), device=model.device)[None]
    return model(**inputs, use_cache=False).logits[0].float().cpu()


def _generated_logits(model: PreTrainedModel, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """The logits plain generate() gives after `prompt` and each token of `continuation` (made to pick them)."""
    ids = prompt[None].to(model.device)
    steps = len(continuation) + 1
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[_FeedTokens(continuation.tolist() + [0])],
        max_new_tokens=steps, min_new_tokens=steps, do_sample=False, num_beams=1, output_logits=True,
        return_dict_in_generate=True, pad_token_id=int(model.generation_config.pad_token_id or 0),
    )  # fmt: skip
    return torch.stack(out.logits, dim=1)[0].float().cpu()


def _batched_problem(model: PreTrainedModel) -> str:
    """The own-attention probe with both rows in one forward on one `DynamicCache` (`BatchedOwnAttentionCache`):
    row 1 gets fewer new tokens than row 0 in the first (padding after them), is realigned by 3 columns, gets
    more in the second, and row 0 rolled back and fed again moves it once more."""
    return _own_attention_problem(model, BatchedOwnAttentionCache, BATCHED_PROBE_CHUNKS)


class _FeedTokens(LogitsProcessor):
    """Makes generate() pick `tokens` in turn, whatever the logits: the compared logits then all follow
    the same inputs (a near-tie's argmax cannot send two runs apart)."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -torch.inf)
        forced[:, self.tokens[self.step]] = 0.0
        self.step += 1
        return forced


def _padded_generate_problem(model: PreTrainedModel, steps: int = 3) -> str:
    """'' when plain generate() gives each row of a left-padded batch the logits it gives the row alone
    (`steps` decoding steps over the same tokens; float32), as the loop does: one row per forward, no
    padding in it. Some models read the padding while decoding from their cache (GIT) though a padded
    forward without one does not."""
    rows = _probe_rows(model)
    pad = int(model.generation_config.pad_token_id or 0)
    width = max(len(r) for r in rows)
    fed = rows[0][:steps].tolist()
    options = dict(
        max_new_tokens=steps, min_new_tokens=steps, do_sample=False, num_beams=1, output_logits=True,
        return_dict_in_generate=True, pad_token_id=pad,
    )  # fmt: skip
    ids = torch.stack([torch.cat([torch.full((width - len(r),), pad, dtype=r.dtype), r]) for r in rows]).to(model.device)
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long().to(model.device)
    with _probing(model):
        batch = model.generate(input_ids=ids, attention_mask=mask, logits_processor=[_FeedTokens(fed)], **options).logits
        batch = torch.stack(batch, dim=1).float().cpu()
        for index, row in enumerate(rows):
            alone_ids = row[None].to(model.device)
            alone = model.generate(
                input_ids=alone_ids, attention_mask=torch.ones_like(alone_ids), logits_processor=[_FeedTokens(fed)],
                **options,
            ).logits  # fmt: skip
            alone = torch.stack(alone, dim=1)[0].float().cpu()
            error = float((batch[index] - alone).abs().max())
            if error > PROBE_TOLERANCE * (1.0 + float(alone.abs().max())):
                return f"plain generate() gives a left-padded row other logits than the row alone (by {error:.3g}, float32)"
    return ""


def _own_attention_problem(
    model: PreTrainedModel, cache_class: type[OwnAttentionCache] = RowOwnAttentionCache,
    chunks: tuple[tuple[int, int], ...] = PROBE_CHUNKS,
) -> str:  # fmt: skip
    """The probe on the model's own attention: a `DynamicCache` per row (`RowOwnAttentionCache`, one row per
    forward) or one for the batch (`BatchedOwnAttentionCache`). The same two forwards (`chunks`), then row 0
    rolled back by one token and that token fed again, must give the model's own forward's logits; '' when they
    do. An encoder-decoder model's decoder runs on `EncoderDecoderRowCache` / `EncoderDecoderBatchedCache`, each
    row on encoder states of its own (`_probe_encoder_inputs`)."""
    rows = _probe_rows(model)
    encoder = _probe_encoder_inputs(model)
    encoder_inputs = []
    if encoder is not None:
        cache_class = EncoderDecoderRowCache if cache_class is RowOwnAttentionCache else EncoderDecoderBatchedCache
        encoder_inputs = [{"encoder_outputs": outputs, "attention_mask": mask} for outputs, mask in encoder]
    cache = cache_class(
        model, max_rollback=2, num_layers=model.config.get_text_config().num_hidden_layers, num_blocks=8, block_size=4,
        device=model.device,
    )  # fmt: skip
    for row, (outputs, mask) in enumerate(encoder or []):
        cache.set_encoder_states([row], outputs, mask)
    fed_logits: list[list[torch.Tensor]] = [[], []]
    with _probing(model):
        for step in range(2):
            logits = _probe_forward(model, cache, rows, step, chunks=chunks)
            for row, piece in enumerate(logits.split([c[step] for c in chunks])):
                fed_logits[row].append(piece.float().cpu())
        length = PROBE_LENGTHS[0]
        cache.rollback(0, length - 1)
        again = forward_tokens(
            model, cache, [0], [1], rows[0][-1:].to(model.device), torch.tensor([length - 1], device=model.device),
            np.arange(1),
        ).float().cpu()  # fmt: skip
        problem = _logits_problem(model, rows, fed_logits, "on its own cache", encoder_inputs=encoder_inputs)
        if problem or next(model.parameters()).dtype != torch.float32:
            return problem
        error = float((again[0] - fed_logits[0][-1][-1]).abs().max())
        if error > PROBE_TOLERANCE * (1.0 + float(again.abs().max())):
            return f"rolling its own cache back one token changes its logits by {error:.3g} (float32)"
        return ""
