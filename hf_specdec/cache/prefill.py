"""Prompts with images (or other non-text inputs): prefilled by the model's own forward, then speculated on.

An image-text-to-text model's prompt needs what only the model knows how to run: its vision encoder
(transformers' generate() has already turned the images into `mm_encoder_outputs`), where the image
features go, and masks that let image tokens see each other. So the prompt is not fed through the
paged path. The model runs its own first generation step, exactly as plain generate() prepares it
(`prepare_inputs_for_generation`, the left-padded batch, its own attention and `DynamicCache`),
over every prompt token but the last; each row's keys / values are then copied into its blocks of
the paged cache and the loop carries on from the last prompt token, a text token, which the paged
attention handles like any other.

M-RoPE models (Qwen2-VL and its kind) place an image's tokens on a 3-D grid, so the text after it
sits at the token count plus a per-row offset, the same on all three axes. The prefill takes the
positions generate() computes (`_prepare_position_ids_for_generation`) and hands the loop that
offset (`DecodeState.position_offsets`); the loop feeds the model 1-D positions, which it spreads
over the three axes itself.

Models whose prompt attends both ways (`prompt_attends_both_ways`: PaliGemma's prefix, text-only
prompts too) take this path for every prompt. Plain generate()'s first forward lets each prompt token
see the later ones, so no piece of the prompt gives its keys: the model's own forward runs over the
whole prompt, every key but the last token's is copied, and the loop feeds the last token again. That
token reads every prompt token either way, so its logits are the first forward's; after it plain
generate() decodes one token per forward, which the loop's causal verify reproduces. Positions are
the ones the forward was handed: PaliGemma's `prepare_inputs_for_generation` counts from 1.

What is refused, with the reason: a prompt whose last token has different positions on those axes
(it ends with an image: the next positions are not one number), hybrid models (their recurrent
state would have to be copied per row as well), sparse indexed attention (its indexer keys too) and
models that run on their own attention (`own_attention.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from .forward import takes_logits_to_keep
from .own_attention import runs_own_attention
from .paged_cache import PagedKVCache, layer_attention

if TYPE_CHECKING:
    from ..models.feature_capture import TargetFeatureCapture


def prompt_attends_both_ways(model: PreTrainedModel) -> bool:
    """Whether plain generate()'s first forward lets prompt tokens attend to later ones (PaliGemma's text
    model: `use_bidirectional_attention`), so that the model's own forward must prefill every prompt."""
    return getattr(model.config.get_text_config(), "use_bidirectional_attention", None) in (True, "all")


def both_ways_prompt_problem(model: PreTrainedModel, prompt_length: int) -> str:
    """Why a prompt of `prompt_length` tokens (padding included) cannot be prefilled exactly, '' when it can.
    Where the prompt attends both ways, plain generate()'s first forward can let its last token read past a
    sliding window (PaliGemma 2's image-and-prefix block overrides the window: measured on a tiny one), and
    the loop feeds that token again under the window."""
    if not prompt_attends_both_ways(model):
        return ""
    windows = [size for kind, size in layer_attention(model.config) if kind in ("sliding", "chunked") and size]
    if windows and prompt_length > min(windows):
        return (
            f"the prompt ({prompt_length} tokens) is longer than the sliding window ({min(windows)} tokens) of a model "
            "whose prompt attends both ways: in plain generate()'s first forward its last token can read past the "
            "window, which speculative decoding does not reproduce; shorten the prompt"
        )
    return ""


def check_model_prefill(model: PreTrainedModel, inputs: dict) -> None:
    """ValueError naming the input and the reason when the model's own prefill cannot hand over to the loop."""
    problem = model_prefill_problem(model)
    if problem:
        raise ValueError(
            f"model inputs {sorted(inputs)} are not supported for model_type="
            f"{model.config.get_text_config().model_type!r}: {problem}"
        )


def model_prefill_problem(model: PreTrainedModel) -> str:
    """Why the model's own prefill cannot hand over to the loop ('' when it can)."""
    if runs_own_attention(model):
        return "it runs on its own attention and cache, one row per forward, and its own prefill of a batch is not handed over to that"
    kinds = [kind for kind, _ in layer_attention(model.config)]
    for held, what in (("recurrent", "a hybrid model's recurrent state"), ("indexed", "a sparse indexer's keys")):
        if any(kind.startswith(held) for kind in kinds):
            return f"handing {what} from its own prefill to the speculative loop is not built"
    return ""


class PrefilledRows(NamedTuple):
    num_cached: np.ndarray  # tokens now cached per batch row
    position_offsets: np.ndarray  # per batch row, the model's position of a token less its token count


def prefill_with_model(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    inputs: dict,
    cache: PagedKVCache,
    features: TargetFeatureCapture | None,
    rows: Sequence[int] | None = None,
) -> PrefilledRows:
    """Run the model's own forward over every prompt token but the last (the whole prompt where it attends
    both ways; left-padded batch, with the positions plain generate() computed for it, None: computed here
    as generate() does, and the extra `inputs`), copy each row's keys / values but its last token's into
    `cache` and, for drafters reading the target's hidden states, queue each row's features. `rows`: the
    cache row of each batch row (default: the same index; the engine prefills one request into its own slot)."""
    batch, width = input_ids.shape
    problem = both_ways_prompt_problem(model, width)
    if problem:
        raise ValueError(f"input_ids: {problem}")
    prompt_lens = attention_mask.sum(dim=1).cpu().numpy().astype(np.int64)
    cached = np.maximum(prompt_lens - 1, 0)
    position_ids, offsets = model_positions(model, input_ids, attention_mask, inputs, position_ids)
    fed = width if prompt_attends_both_ways(model) else width - 1  # tokens the model's own forward runs over
    if fed < 1:
        return PrefilledRows(cached, offsets)
    own_cache = DynamicCache(config=model.config)
    if fed == width:  # its last token's keys are dropped below, and the token fed again reads the window before it
        own_cache.layers = [
            DynamicSlidingWindowLayer(sliding_window=layer.sliding_window + 1) if type(layer) is DynamicSlidingWindowLayer
            else layer for layer in own_cache.layers
        ]  # fmt: skip
    prepared = model.prepare_inputs_for_generation(
        input_ids[:, :fed], cache=own_cache, attention_mask=attention_mask[:, :fed], use_cache=True,
        position_ids=position_ids[..., :fed], is_first_iteration=True, **inputs,
    )
    offsets = offsets + _prepared_shift(position_ids[..., :fed], prepared.get("position_ids"))
    if features is not None:
        features.begin_forward()
    keep = {}
    if takes_logits_to_keep(type(model)):
        # an index tensor, not 1, when hidden states are captured: given an int, models whose last layers
        # reuse earlier layers' KV (Gemma 3n / 4) run those layers on the last position only
        keep["logits_to_keep"] = 1 if features is None else torch.tensor([fed - 1], device=input_ids.device)
    model(**prepared, **keep)
    for index, row in enumerate(range(batch) if rows is None else rows):
        count = int(cached[index])
        if count == 0:
            continue
        metadata = cache.prepare_forward([row], [count])
        for layer, own in enumerate(own_cache.layers):
            if own.keys is None:  # a layer without a cache of its own (reusing another's, or MoE / MLP only)
                continue
            dropped = fed - (width - 1)  # the last token's keys, where the forward ran over it
            keys, values = _row_states(own.keys, index, count, dropped), _row_states(own.values, index, count, dropped)
            cache.layers[layer].update(keys, values, metadata=metadata)
        if features is not None:
            features.keep(row, width - 1 - count, count, batch_index=index)
    return PrefilledRows(cached, offsets)


def _prepared_shift(given: torch.Tensor, prepared: torch.Tensor | None) -> np.ndarray | int:
    """Per row, what the model's `prepare_inputs_for_generation` adds to generate()'s positions (PaliGemma: 1)."""
    if not isinstance(prepared, torch.Tensor) or prepared.shape != given.shape:
        return 0
    shift = (prepared - given.to(prepared.device))[..., -1].cpu().long()
    return shift.reshape(-1, shift.shape[-1])[0].numpy()


def model_positions(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, np.ndarray]:  # fmt: skip
    """(the prompt's positions as plain generate() gives them, each row's offset of the tokens after it
    from their token count). `position_ids`: generate()'s own, else computed here as generate() does
    (index arithmetic: no vision tower runs). Raises ValueError for a prompt the loop cannot continue."""
    if position_ids is None:
        # transformers' own: a model with M-RoPE overrides it (3-D positions from the image grids)
        position_ids = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": attention_mask, **inputs})
    prompt_lens = attention_mask.sum(dim=1).cpu().numpy().astype(np.int64)
    return position_ids, _position_offsets(model, position_ids, prompt_lens)


def _position_offsets(model: PreTrainedModel, position_ids: torch.Tensor, prompt_lens: np.ndarray) -> np.ndarray:
    """Per row, the position of the prompt's last token less its token count (0 but after an M-RoPE image).

    `position_ids`: `[batch, width]`, or for M-RoPE `[rows, batch, width]`: one row per M-RoPE axis
    (the config's `mrope_section`; 3 where it names none), after a row of text positions when there is
    one more row (as the models' own forwards read them). Raises where the last token's axes differ:
    the tokens after it would not have one position the loop can feed."""
    last = position_ids[..., -1].cpu().long()
    if last.ndim == 2:
        rope = getattr(model.config.get_text_config(), "rope_parameters", None)
        num_axes = len((rope or {}).get("mrope_section") or []) if isinstance(rope, dict) else 0
        axes = last[1:] if last.shape[0] == (num_axes or 3) + 1 else last
        if not bool((axes == axes[0]).all()):
            raise ValueError(
                f"model_type={model.config.get_text_config().model_type!r}: the prompt ends with an image or video "
                "token, whose M-RoPE positions differ per axis; speculative decoding continues from a text token "
                "(end the prompt with text, as chat templates do)"
            )
        last = axes[0]
    return last.numpy() - (prompt_lens - 1)


def _row_states(states: torch.Tensor, row: int, count: int, drop: int = 0) -> torch.Tensor:
    """The row's last `count` positions of a `[batch, heads, kept, dim]` cache tensor, before its last `drop`
    ones, as `[1, heads, count, dim]`.

    A sliding-window layer keeps fewer positions than the prompt holds: the missing early ones are
    zeros here, never read (the layer's mask hides them)."""
    states = states[:, :, : states.shape[2] - drop]
    kept = states.shape[2]
    if kept >= count:
        return states[row : row + 1, :, kept - count :]
    missing = states.new_zeros((1, states.shape[1], count - kept, states.shape[3]))
    return torch.cat([missing, states[row : row + 1]], dim=2)
