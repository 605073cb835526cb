"""Encoder-decoder models (BART, T5, Marian, Whisper, ...) in `generate()` and the engine.

transformers' `generate()` runs the encoder before it hands over to the decoding loop: the loop gets the
decoder's `input_ids` (its start tokens, one length), the `encoder_outputs`, the encoder's `attention_mask`
and, as `inputs_tensor`, the source the encoder read. The engine runs the encoder on each request's source as it
joins (`SpeculativeEngine._encode_source`). Either way `hand_over_sources` gives each row's encoder output to the
decoder's own-attention cache (`cache/own_attention.py`: batched, or a row per forward); an encoder-decoder draft
model runs its own encoder on the same source, as transformers' assisted generation runs its assistant's; the
n-gram lookup searches the source too where it is tokens of the decoder's vocabulary.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel

from ..config import SpeculativeConfig
from ..drafters.draft_model import DraftModelProposer
from ..drafters.ngram import NgramProposer
from .step import drafters_of

if TYPE_CHECKING:  # the engine hands its requests' sources over here
    from .engine import SpeculativeEngine

# what generate() hands an encoder-decoder model's decoding loop besides the decoder's tokens
ENCODER_DECODER_INPUTS = ("encoder_outputs", "decoder_attention_mask", "decoder_position_ids")
# drafters an encoder-decoder target speculates with: lookups of its decoder's tokens, or an encoder-decoder draft
ENCODER_DECODER_METHODS = ("ngram", "suffix", "draft_model")
# model -> whether its encoder and decoder embed tokens alike (`source_tokens`), decided once per model object
_SHARED_VOCABULARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_encoder_decoder_config(model: PreTrainedModel, config: SpeculativeConfig) -> None:
    """ValueError naming what an encoder-decoder target cannot speculate with: drafters built on a decoder-only
    target's hidden states or layers (EAGLE, MTP, layer_skip), draft trees (its decoder builds its own causal
    mask)."""
    if config.method not in ENCODER_DECODER_METHODS:
        raise ValueError(
            f"speculative_config.method={config.method!r} is not supported on an encoder-decoder target; allowed: "
            f"{', '.join(ENCODER_DECODER_METHODS)}"
        )
    if config.tree is not None:
        raise ValueError("speculative_config.tree is not supported on an encoder-decoder target (its decoder builds its own causal mask)")


def check_encoder_decoder_request(
    model: PreTrainedModel, config: SpeculativeConfig, inputs_tensor: torch.Tensor | None, model_kwargs: dict
) -> None:
    """`check_encoder_decoder_config`, and ValueError naming what generate() was handed that the loop cannot
    take: a draft model without the source, decoder inputs the loop cannot honour, no encoder output."""
    check_encoder_decoder_config(model, config)
    if config.method == "draft_model" and (not _given_source(inputs_tensor) or model_kwargs.get("inputs_embeds") is not None):
        raise ValueError(
            "speculative_config.method='draft_model' on an encoder-decoder target needs the encoder's inputs "
            "(input_ids / input_features) passed to generate(), not encoder_outputs or inputs_embeds: the draft runs "
            "its own encoder on them"
        )
    for name in ("decoder_attention_mask", "decoder_position_ids"):
        given = model_kwargs.get(name)
        if given is None or (name == "decoder_attention_mask" and bool(given.all())):
            continue
        raise ValueError(
            f"{name} is not supported with speculative decoding on an encoder-decoder model ({type(model).__name__}): "
            "its decoder runs each row unpadded, positions counted from 0; pass decoder_input_ids of one length "
            "without it"
        )
    if model_kwargs.get("encoder_outputs") is None:
        raise ValueError(
            f"encoder_outputs: {type(model).__name__} is an encoder-decoder model and generate() handed no encoder "
            "states to the decoding loop; pass the encoder's inputs (input_ids / input_features) or encoder_outputs"
        )


def hand_over_sources(
    engine: SpeculativeEngine, rows: Sequence[int], encoder_outputs: Any, encoder_mask: torch.Tensor | None,
    inputs_tensor: torch.Tensor | None, generation_config: GenerationConfig,
) -> None:  # fmt: skip
    """Before their first step (generate()'s whole batch, or an engine request as it joins): each row's encoder
    output and mask (a batch in `rows`' order) to the target's cache, the source to an encoder-decoder draft
    (which encodes it) and, as tokens, to n-gram lookups."""
    sources = source_tokens(engine.model, inputs_tensor, encoder_mask)
    for drafter in drafters_of(engine.proposer):
        if isinstance(drafter, DraftModelProposer):
            drafter.encode_sources(rows, inputs_tensor, encoder_mask, generation_config)
        if isinstance(drafter, NgramProposer):
            for row, source in zip(rows, sources):
                drafter.set_source(row, source)
    engine.cache.set_encoder_states(rows, encoder_outputs, encoder_mask)


def batch_sources(engine: SpeculativeEngine, model_kwargs: dict, inputs_tensor: torch.Tensor | None) -> tuple:
    """generate()'s encoder output, mask and source for its rows (`num_return_sequences` repeats each source)."""
    batch_size = len(engine.state.finished)
    if inputs_tensor is not None and len(inputs_tensor) != batch_size:
        inputs_tensor = inputs_tensor.repeat_interleave(batch_size // len(inputs_tensor), dim=0)
    return range(batch_size), model_kwargs["encoder_outputs"], model_kwargs.get("attention_mask"), inputs_tensor


def source_tokens(model: PreTrainedModel, inputs_tensor: torch.Tensor | None, encoder_mask: torch.Tensor | None) -> list[np.ndarray]:
    """Each row's source tokens, unpadded, where an encoder-decoder model's encoder reads tokens of its decoder's
    vocabulary (one embedding for both: BART, T5, most Marian models), for the n-gram lookup; else []."""
    if not _given_source(inputs_tensor) or inputs_tensor.is_floating_point() or inputs_tensor.ndim != 2:
        return []
    if model not in _SHARED_VOCABULARY:
        # tied, or loaded twice from one checkpoint tensor (T5 v1.1, mT5: transformers unties them with the head)
        embeddings = [getattr(part.get_input_embeddings(), "weight", None) for part in (model.get_encoder(), model.get_decoder())]
        _SHARED_VOCABULARY[model] = all(isinstance(e, torch.Tensor) for e in embeddings) and (
            embeddings[0].data_ptr() == embeddings[1].data_ptr()
            or (embeddings[0].shape == embeddings[1].shape and bool(torch.equal(embeddings[0], embeddings[1])))
        )
    if not _SHARED_VOCABULARY[model]:
        return []
    tokens = inputs_tensor.cpu().numpy()
    kept = np.ones(tokens.shape, dtype=bool) if encoder_mask is None else encoder_mask.cpu().numpy().astype(bool)
    return [row[keep] for row, keep in zip(tokens, kept)]


def _given_source(inputs_tensor: torch.Tensor | None) -> bool:
    """Whether generate() ran the encoder on a source (with `encoder_outputs` passed instead, its inputs_tensor
    is a placeholder of -100s)."""
    return inputs_tensor is not None and (inputs_tensor.is_floating_point() or not bool((inputs_tensor == -100).all()))


def decoder_start_ids(model: PreTrainedModel) -> list[int]:
    """The decoder prompt plain generate() begins an encoder-decoder model's output with when given none: its
    decoder start token (the generation config's, else the model config's, as transformers resolves it)."""
    config = copy.deepcopy(model.generation_config)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    start = config._decoder_start_token_tensor
    if start is None:
        raise ValueError(f"{type(model).__name__} names no decoder_start_token_id (generation config or config)")
    return [int(token) for token in start.flatten().tolist()]


def source_limit(model: PreTrainedModel) -> int | None:
    """The most tokens an encoder-decoder model's encoder reads (None: no limit its config states)."""
    return getattr(model.config.get_text_config(encoder=True), "max_position_embeddings", None)
