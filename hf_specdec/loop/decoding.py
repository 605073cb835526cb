"""`generate`: the callable transformers' `generate(custom_generate=...)` takes.

transformers has already prepared the generation config, the logits processors and the stopping
criteria; we check the request, lay the batch out as plain generate's `input_ids` (`DecodeState`)
and run it on a `SpeculativeEngine` (`engine.py`) whose rows all start at once and share those
processors: the same loop (`step.speculative_step`) the engine runs for requests that come and go.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import (
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
    GenerationMixin,
)

from ..cache.architectures import check_architecture, padded_batch_problem
from ..cache.own_attention import runs_one_row_per_forward
from ..cache.prefill import check_model_prefill, prefill_with_model, prompt_attends_both_ways
from ..config import SpeculativeConfig
from ..sampling.grammar import with_speculative_grammars
from ..sampling.logits_processing import StopChecker, check_supported_processors, spread_over_rows
from ..sampling.prefix_constraint import with_speculative_prefix_constraints
from .encoder_decoder import (
    ENCODER_DECODER_INPUTS,
    batch_sources,
    check_encoder_decoder_request,
    hand_over_sources,
)
from .engine import ASSISTED_OPTIONS, ENGINE_INPUTS, SpeculativeEngine, unsupported_option
from .metrics import SpecDecodeMetrics
from .step import DecodeState, SamplingState


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the metrics of this call (`SpecDecodeMetrics.to_dict()`)."""

    spec_metrics: dict | None = None


@dataclass
class SpeculativeGenerateEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """An encoder-decoder model's `GenerateEncoderDecoderOutput` plus the metrics of this call (None under a
    generate() of the model's own, such as Whisper's, which splits the output by row and rebuilds it)."""

    spec_metrics: dict | None = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    speculative_config: SpeculativeConfig | dict | str | None = None,
    speculative_streamer: BaseStreamer | None = None,
    inputs_tensor: torch.Tensor | None = None,
    **model_kwargs,
) -> torch.LongTensor | SpeculativeGenerateOutput | SpeculativeGenerateEncoderDecoderOutput:
    """Speculative decoding, usable as `model.generate(..., custom_generate=hf_specdec.generate,
    speculative_config=...)`.

    transformers drops `streamer` for custom_generate callables: pass `speculative_streamer=`
    instead (`hf_specdec.enable(model)` does that for you). `inputs_tensor`: what generate() ran an
    encoder-decoder model's encoder on (transformers hands it over), which an encoder-decoder draft encodes too.
    """
    config = SpeculativeConfig.from_any(speculative_config)
    encoder_decoder = model.config.is_encoder_decoder
    if encoder_decoder:
        check_encoder_decoder_request(model, config, inputs_tensor, model_kwargs)
    generation_config = generation_config or model.generation_config
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    stop_checker = StopChecker(stopping_criteria)
    max_length = stop_checker.max_length or generation_config.max_length
    given_positions = _check_request(
        model, input_ids, generation_config, logits_processor, model_kwargs, synced_gpus, max_length
    )
    streamer = speculative_streamer or streamer
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer is supported at batch size 1 only (as transformers' streamers)")

    logits_processor = with_speculative_grammars(logits_processor, input_ids.shape[0], input_ids.shape[1])
    logits_processor = with_speculative_prefix_constraints(logits_processor)
    logits_processor = spread_over_rows(logits_processor, input_ids.shape[0])
    # an encoder-decoder model's input_ids are its decoder's (one length), its attention_mask the encoder's
    state = _initial_state(
        input_ids, None if encoder_decoder else model_kwargs.get("attention_mask"), generation_config, max_length
    )
    sampling = _sampling_state(generation_config, config, input_ids.shape[0], model.device)
    max_new_tokens = int(state.max_lengths.max()) - input_ids.shape[1]
    prompt_lens = state.seq_lens - state.pad_lens
    # a tree's nodes occupy slots past what the row will keep until its path is chosen
    tree_slots = 0 if config.tree is None else config.tree.num_nodes
    num_blocks = config.num_kv_blocks or sum(
        -(-(int(length) + max_new_tokens + 1 + tree_slots) // config.block_size) for length in prompt_lens
    )
    engine = SpeculativeEngine.for_batch(
        model, config, state, sampling, logits_processor, stop_checker, generation_config, num_blocks
    )
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    emitted_scores: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
    emitted_logits: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
    if streamer is not None and speculative_streamer is not None:
        streamer.put(input_ids.cpu())
    if encoder_decoder:
        hand_over_sources(engine, *batch_sources(engine, model_kwargs, inputs_tensor), generation_config)
    started = time.perf_counter()
    prefill_inputs = _prefill_inputs(model_kwargs)
    try:
        # images and the like, or positions of the caller's choosing: the model's own forward prefills
        if prefill_inputs or prompt_attends_both_ways(model) or given_positions:
            attention_mask = model_kwargs.get("attention_mask")
            with torch.no_grad():
                state.num_cached[:], state.position_offsets[:] = prefill_with_model(
                    model, input_ids, torch.ones_like(input_ids) if attention_mask is None else attention_mask,
                    model_kwargs.get("position_ids"), prefill_inputs, engine.cache, engine.hold_capture(),
                )
        while engine.has_unfinished():
            for row, tokens, raw, processed in engine.decode_step(keep_logits=want_scores or want_logits):
                if want_scores:
                    emitted_scores[row].append(processed)
                if want_logits:
                    emitted_logits[row].append(raw)
                if streamer is not None:
                    for token in tokens:
                        streamer.put(token[None].cpu())
    finally:
        engine.close()
    metrics = engine.metrics
    metrics.total_seconds = time.perf_counter() - started
    if streamer is not None:
        streamer.end()
    _record_on_model(model, metrics)

    sequences = state.token_buffer[:, : int(state.seq_lens.max())].to(input_ids.device)
    if not generation_config.return_dict_in_generate:
        return sequences
    num_new = sequences.shape[1] - input_ids.shape[1]
    scores = _per_step(emitted_scores, num_new) if want_scores else None
    logits = _per_step(emitted_logits, num_new) if want_logits else None
    if not encoder_decoder:
        return SpeculativeGenerateOutput(sequences=sequences, scores=scores, logits=logits, spec_metrics=metrics.to_dict())
    # the metrics stay on the model (`model.spec_decode_metrics`) where the model's own generate() rebuilds this
    own_generate = type(model).generate is not GenerationMixin.generate
    return SpeculativeGenerateEncoderDecoderOutput(
        sequences=sequences, scores=scores, logits=logits, spec_metrics=None if own_generate else metrics.to_dict()
    )


def _prefill_inputs(model_kwargs: dict) -> dict:
    """Inputs besides the tokens (images as `mm_encoder_outputs`, `token_type_ids`, ...): the model's own
    prefill consumes them (`cache/prefill.py`), as plain generate() uses them in its first step only. (An
    encoder-decoder model's encoder states go to every forward of its decoder: `encoder_decoder.py`.)"""
    return {
        k: v for k, v in model_kwargs.items()
        if k not in ENGINE_INPUTS and k not in ENCODER_DECODER_INPUTS and v is not None
        and not (isinstance(v, (dict, list, tuple)) and not v)
    }  # fmt: skip


def _given_positions(model, input_ids: torch.Tensor, model_kwargs: dict) -> bool:
    """Whether generate() was handed prompt positions other than the ones it computes from the attention mask:
    plain generate() runs the prompt at them and continues from the last one, so the model's own forward
    prefills such a prompt (`cache/prefill.py`) and the loop continues at that offset."""
    given = model_kwargs.get("position_ids")
    if given is None or model.config.is_encoder_decoder:  # its decoder's positions: `encoder_decoder.py`
        return False
    # without padding generate() drops the attention mask after computing them: `[1, width]` then, for every row
    own = model._prepare_position_ids_for_generation(
        input_ids, {"attention_mask": model_kwargs.get("attention_mask"), **_prefill_inputs(model_kwargs)}
    ).to(given.device)
    shape = (*own.shape[:-2], input_ids.shape[0], input_ids.shape[1])
    if tuple(given.shape) != shape or given.is_floating_point() or given.is_complex():
        raise ValueError(
            f"position_ids must be integers of shape {list(shape)} (as generate() computes them for input_ids), "
            f"got {given.dtype} of shape {list(given.shape)}"
        )
    return not torch.equal(own.expand_as(given), given)


def _check_request(model, input_ids, generation_config, logits_processor, model_kwargs, synced_gpus, max_length) -> bool:
    """ValueError naming what cannot run exactly; returns whether the caller gave positions of its own."""
    if generation_config.num_beams != 1:
        raise ValueError(f"num_beams={generation_config.num_beams} is not supported with speculative decoding; allowed: 1")
    for option in ASSISTED_OPTIONS:
        if getattr(generation_config, option, None):
            raise ValueError(f"{option} is transformers' own assisted generation; do not combine it with speculative_config")
    problem = unsupported_option(generation_config, generation_config.return_dict_in_generate)
    if problem:
        raise ValueError(f"{problem}; remove it")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with speculative decoding; pass input_ids")
    cache = model_kwargs.get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a pre-filled cache cannot be reused with speculative decoding; pass cache=None")
    if synced_gpus:
        raise ValueError("synced_gpus is not supported with speculative decoding")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    check_supported_processors(logits_processor)
    check_architecture(model)  # it may run a small probe forward, once per model
    prefill_inputs = _prefill_inputs(model_kwargs)  # after it: whether the model runs on its own attention is its verdict
    given_positions = _given_positions(model, input_ids, model_kwargs)
    if given_positions:
        prefill_inputs["position_ids"] = model_kwargs["position_ids"]
    if prefill_inputs:
        check_model_prefill(model, prefill_inputs)
    attention_mask = model_kwargs.get("attention_mask")  # an encoder-decoder model's: its encoder's
    if attention_mask is not None and not bool(attention_mask.all()) and not model.config.is_encoder_decoder:
        problem = padded_batch_problem(model, max_length)
        if problem:
            raise ValueError(
                f"attention_mask: this {type(model).__name__} cannot take a left-padded batch exactly: {problem}. The "
                "loop runs each row alone, so pass prompts of one length (or one prompt per call), or use "
                "hf_specdec.SpeculativeEngine, whose requests each run alone"
            )
    if runs_one_row_per_forward(model) and input_ids.shape[0] > 1:
        warnings.warn(
            f"this {type(model).__name__} runs on its own attention and cache, one forward per row: at batch size "
            f"{input_ids.shape[0]} speculative decoding is likely slower than plain generate() (SmolLM2 made to run "
            "so: 0.39-0.53x plain at batch 8, 1.5-1.6x at batch 1; docs/architectures.md)",
            stacklevel=4,
        )
    return given_positions


def _initial_state(input_ids, attention_mask, generation_config, max_length: int) -> DecodeState:
    batch, prompt_width = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.cpu().bool()
    prompt_lens = attention_mask.sum(dim=1)
    left_padded = torch.arange(prompt_width)[None, :] >= (prompt_width - prompt_lens)[:, None]
    if not torch.equal(attention_mask, left_padded):
        raise ValueError(
            "attention_mask must describe left padding (zeros only at the start of each row); "
            "set tokenizer.padding_side='left'"
        )
    if (prompt_lens == 0).any():
        raise ValueError("every row of input_ids needs at least one token that is not padding")
    pad = generation_config._pad_token_tensor
    pad_token_id = int(pad.flatten()[0]) if pad is not None else (generation_config.pad_token_id or 0)
    token_buffer = torch.full((batch, max(max_length, prompt_width + 1)), pad_token_id, dtype=torch.long)
    token_buffer[:, :prompt_width] = input_ids.cpu()
    return DecodeState(
        token_buffer=token_buffer,
        pad_lens=(prompt_width - prompt_lens).numpy().astype(np.int64),
        seq_lens=np.full(batch, prompt_width, dtype=np.int64),
        num_cached=np.zeros(batch, dtype=np.int64),
        finished=np.zeros(batch, dtype=bool),
        max_lengths=np.full(batch, max_length, dtype=np.int64),
        pad_token_id=pad_token_id,
        position_offsets=np.zeros(batch, dtype=np.int64),
    )


def _sampling_state(
    generation_config: GenerationConfig, config: SpeculativeConfig, batch: int, device: torch.device
) -> SamplingState:
    if not generation_config.do_sample:
        if config.rejection_sample_method == "block":  # not ignored silently: it would change nothing
            raise ValueError(
                "speculative_config.rejection_sample_method='block' needs do_sample=True: it changes how sampled "
                "rows accept drafts, and greedy rows accept the longest prefix equal to the argmax either way; "
                "allowed with do_sample=False: 'token'"
            )
        return SamplingState(is_greedy=torch.ones(batch, dtype=torch.bool, device=device), generators=[None] * batch)
    seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    generators = [torch.Generator(device=device).manual_seed(seed + row) for row in range(batch)]
    return SamplingState(is_greedy=torch.zeros(batch, dtype=torch.bool, device=device), generators=generators)


def _per_step(per_row: list[list[torch.Tensor]], num_steps: int) -> tuple[torch.Tensor, ...]:
    """Rows' emitted logits regrouped as plain generate returns them: one [batch, vocab] per step.

    Positions after a row finished are 0 (plain generate fills them with the logits of its pad steps).
    """
    rows = [torch.cat(chunks) if chunks else None for chunks in per_row]
    vocab = next(r.shape[-1] for r in rows if r is not None)
    out = torch.zeros(num_steps, len(rows), vocab)
    for i, r in enumerate(rows):
        if r is not None:
            out[: len(r), i] = r
    return tuple(out)


def _record_on_model(model: PreTrainedModel, metrics: SpecDecodeMetrics) -> None:
    """Cumulative metrics live on the model: `model.spec_decode_metrics`."""
    total = getattr(model, "spec_decode_metrics", None)
    if not isinstance(total, SpecDecodeMetrics):
        total = SpecDecodeMetrics()
        model.spec_decode_metrics = total
    total.merge(metrics)
