"""Prompts with images (or other non-text inputs): prefilled by the model's own forward, then speculated on.

An image-text-to-text model's prompt needs what only the model knows how to run: its vision encoder
(transformers' generate() has already turned the images into `mm_encoder_outputs`), where the image
features go, and masks that let image tokens see each other. So the prompt is not fed through the
paged path. The model runs its own first generation step, exactly as plain generate() prepares it
(`prepare_inputs_for_generation`, the left-padded batch, its own attention and `DynamicCache`),
over every prompt token but the last; each row's keys / values are then copied into its blocks of
the paged cache and the loop carries on from the last prompt token, a text token, which the paged
attention handles like any other.

What is refused, with the reason: models whose positions after an image are not the token count
(M-RoPE: Qwen2-VL and its kind keep 3-D positions with per-image offsets), and hybrid models (their
recurrent state would have to be copied per row as well).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..cache.paged_cache import PagedKVCache, layer_attention
from ..models.feature_capture import TargetFeatureCapture


def check_model_prefill(model: PreTrainedModel, inputs: dict) -> None:
    """ValueError naming the input and the reason when the model's own prefill cannot hand over to the loop."""
    names = sorted(inputs)
    model_type = model.config.get_text_config().model_type
    rope_index = getattr(model, "get_rope_index", None) or getattr(getattr(model, "model", None), "get_rope_index", None)
    if rope_index is not None:
        raise ValueError(
            f"model inputs {names} are not supported for model_type={model_type!r}: its positions after an image are "
            "3-D (M-RoPE, offset per image), and the speculative loop continues with token-count positions"
        )
    if any(kind.startswith("recurrent") for kind, _ in layer_attention(model.config)):
        raise ValueError(
            f"model inputs {names} are not supported for model_type={model_type!r}: handing a hybrid model's "
            "recurrent state from its own prefill to the speculative loop is not built"
        )


def prefill_with_model(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    inputs: dict,
    cache: PagedKVCache,
    features: TargetFeatureCapture | None,
    rows: Sequence[int] | None = None,
) -> np.ndarray:
    """Run the model's own forward over every prompt token but the last (left-padded batch, with the
    positions plain generate() computed for it and the extra `inputs`), copy each row's keys / values
    into `cache` and, for drafters reading the target's hidden states, queue each row's features.
    `rows`: the cache row of each batch row (default: the same index; the engine prefills one request
    into its own slot). Returns the tokens now cached per batch row."""
    batch, width = input_ids.shape
    prompt_lens = attention_mask.sum(dim=1).cpu().numpy().astype(np.int64)
    cached = np.maximum(prompt_lens - 1, 0)
    if width < 2:
        return cached
    own_cache = DynamicCache(config=model.config)
    if position_ids is None:  # what generate() derives from a left-padded mask
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    prepared = model.prepare_inputs_for_generation(
        input_ids[:, :-1], cache=own_cache, attention_mask=attention_mask[:, :-1], use_cache=True,
        position_ids=position_ids[:, :-1], is_first_iteration=True, **inputs,
    )
    if features is not None:
        features.begin_forward()
    model(**{**prepared, "logits_to_keep": 1})
    for index, row in enumerate(range(batch) if rows is None else rows):
        count = int(cached[index])
        if count == 0:
            continue
        metadata = cache.prepare_forward([row], [count])
        for layer, own in enumerate(own_cache.layers):
            keys, values = _row_states(own.keys, index, count), _row_states(own.values, index, count)
            cache.layers[layer].update(keys, values, metadata=metadata)
        if features is not None:
            features.keep(row, width - 1 - count, count, batch_index=index)
    return cached


def _row_states(states: torch.Tensor, row: int, count: int) -> torch.Tensor:
    """The row's last `count` positions of a `[batch, heads, kept, dim]` cache tensor as `[1, heads, count, dim]`.

    A sliding-window layer keeps fewer positions than the prompt holds: the missing early ones are
    zeros here, never read (the layer's mask hides them)."""
    kept = states.shape[2]
    if kept >= count:
        return states[row : row + 1, :, kept - count :]
    missing = states.new_zeros((1, states.shape[1], count - kept, states.shape[3]))
    return torch.cat([missing, states[row : row + 1]], dim=2)
