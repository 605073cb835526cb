"""The speculative decode loop.

`generate` is the callable transformers' `generate(custom_generate=...)` takes: transformers has
already prepared the generation config, the logits processors and the stopping criteria; we run
the loop. Each step (`speculative_step`):

1. draft: the proposer gives each active row up to k tokens (ragged, possibly none); k is the
   config's, or with num_speculative_tokens="auto" chosen per step (`auto_k.py`);
2. verify: one target forward over every row's pending token(s) and drafts, packed varlen into
   the paged KV cache;
3. sample: logits processors at every verify position, then rejection sampling;
4. emit: append accepted drafts + the bonus / recovered token, apply stopping criteria per
   token, roll the cache back to the accepted length, release finished rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.architectures import check_architecture
from ..cache.forward import forward_tokens
from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..config import SpeculativeConfig
from ..drafters import Proposer, ProposeRequest, build_proposer
from ..models.cpu_linear import fast_cpu_linears, resolve_backend
from ..models.feature_capture import TargetFeatureCapture, capture_for_proposer
from ..profiling import StepTimer
from ..sampling.grammar import SpeculativeGrammar, cut_forbidden_drafts, with_speculative_grammars
from ..sampling.logits_processing import (
    StopChecker,
    accept_emitted,
    check_supported_processors,
    process_logits,
)
from ..sampling.metadata import SpecDecodeMetadata
from ..sampling.rejection_sampler import draw_random, rejection_sample
from ..sampling.tree import tree_depths
from ..sampling.tree_acceptance import accept_tree
from ..transfer import to_device
from .auto_k import AutoKController, controller_for
from .auto_tree import AutoTreeController
from .metrics import SpecDecodeMetrics
from .prefill import check_model_prefill, prefill_with_model
from .tree_verify import tree_layout, tree_prefixes


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the metrics of this call (`SpecDecodeMetrics.to_dict()`)."""

    spec_metrics: dict | None = None


@dataclass
class DecodeState:
    """Every row's tokens and how far each has got.

    `token_buffer` holds rows exactly as plain generate's `input_ids` would: left padding,
    prompt, generated tokens (then pad). Columns past a row's `seq_lens` are scratch space where
    drafts are written during verification.
    """

    token_buffer: torch.Tensor  # [rows, max_length]
    pad_lens: np.ndarray  # left padding per row
    seq_lens: np.ndarray  # columns in use per row (padding included)
    num_cached: np.ndarray  # tokens per row whose K/V the cache holds
    finished: np.ndarray  # bool per row
    max_length: int
    pad_token_id: int

    def active_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.finished)

    def tokens(self, row: int) -> np.ndarray:
        return self.token_buffer[row, self.pad_lens[row] : self.seq_lens[row]].numpy()

    def pending_tokens(self, row: int) -> torch.Tensor:
        """Tokens of the row not yet in the cache: the whole prompt at first, then the last token."""
        return self.token_buffer[row, self.pad_lens[row] + self.num_cached[row] : self.seq_lens[row]]


@dataclass
class SamplingState:
    is_greedy: torch.Tensor  # [batch] bool
    generators: list[torch.Generator | None]  # one per batch row, None for greedy rows


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
    **model_kwargs,
) -> torch.LongTensor | SpeculativeGenerateOutput:
    """Speculative decoding, usable as `model.generate(..., custom_generate=hf_specdec.generate,
    speculative_config=...)`.

    transformers drops `streamer` for custom_generate callables: pass `speculative_streamer=`
    instead (`hf_specdec.enable(model)` does that for you).
    """
    config = SpeculativeConfig.from_any(speculative_config)
    generation_config = generation_config or model.generation_config
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    _check_request(model, input_ids, generation_config, logits_processor, model_kwargs, synced_gpus)
    streamer = speculative_streamer or streamer
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer is supported at batch size 1 only (as transformers' streamers)")

    logits_processor = with_speculative_grammars(logits_processor, input_ids.shape[0], input_ids.shape[1])
    stop_checker = StopChecker(stopping_criteria)
    state = _initial_state(input_ids, model_kwargs.get("attention_mask"), generation_config, stop_checker)
    sampling = _sampling_state(generation_config, config, input_ids.shape[0], model.device)
    max_new_tokens = state.max_length - input_ids.shape[1]
    prompt_lens = state.seq_lens - state.pad_lens
    # a tree's nodes occupy slots past what the row will keep until its path is chosen
    tree_slots = 0 if config.tree is None else config.tree.num_nodes
    num_blocks = config.num_kv_blocks or sum(
        -(-(int(length) + max_new_tokens + 1 + tree_slots) // config.block_size) for length in prompt_lens
    )
    cache = PagedKVCache.for_model(
        model, num_blocks=num_blocks, block_size=config.block_size, max_rollback=config.max_draft_tokens
    )
    if config.tree is not None:
        _check_tree_request(cache, logits_processor)
    proposer = build_proposer(config, model, generation_config, logits_processor, target_cache=cache)

    metrics = SpecDecodeMetrics()
    k_controller = controller_for(model, config, generation_config.do_sample) if config.auto_k else None
    tree_controller = AutoTreeController(config.tree.num_nodes) if config.tree is not None and config.tree.auto else None
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    emitted_scores: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
    emitted_logits: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
    if streamer is not None and speculative_streamer is not None:
        streamer.put(input_ids.cpu())
    started = time.perf_counter()
    # verify forwards carry k+1 tokens per row: see cpu_linear.py for why they skip torch's BLAS
    networks = [model, *_drafter_networks(proposer)]
    linear_backend = resolve_backend(config.cpu_linear_backend, networks)
    fast_linears = (
        fast_cpu_linears(*networks, backend=linear_backend) if linear_backend != "torch" else contextlib.nullcontext()
    )
    # drafters that read the target's hidden states (EAGLE) get them from hooks on these forwards
    prefill_inputs = _prefill_inputs(model_kwargs)
    with torch.no_grad(), capture_for_proposer(model, proposer) as features:
        if prefill_inputs:  # images and the like: the model's own forward prefills the prompt
            attention_mask = model_kwargs.get("attention_mask")
            state.num_cached[:] = prefill_with_model(
                model, input_ids, torch.ones_like(input_ids) if attention_mask is None else attention_mask,
                model_kwargs.get("position_ids"), prefill_inputs, cache, features,
            )
        with use_paged_attention(model), fast_linears:
            while not state.finished.all():
                step = speculative_step(
                    model, state, proposer, cache, config, logits_processor, stop_checker, sampling, metrics, features,
                    k_controller=k_controller, tree_controller=tree_controller, keep_logits=want_scores or want_logits,
                )
                for row, tokens, raw, processed in step:
                    if want_scores:
                        emitted_scores[row].append(processed)
                    if want_logits:
                        emitted_logits[row].append(raw)
                    if streamer is not None:
                        for token in tokens:
                            streamer.put(token[None].cpu())
    metrics.total_seconds = time.perf_counter() - started
    if streamer is not None:
        streamer.end()
    _record_on_model(model, metrics)

    sequences = state.token_buffer[:, : int(state.seq_lens.max())].to(input_ids.device)
    if not generation_config.return_dict_in_generate:
        return sequences
    num_new = sequences.shape[1] - input_ids.shape[1]
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=_per_step(emitted_scores, num_new) if want_scores else None,
        logits=_per_step(emitted_logits, num_new) if want_logits else None,
        spec_metrics=metrics.to_dict(),
    )


def speculative_step(
    model: PreTrainedModel,
    state: DecodeState,
    proposer: Proposer,
    cache: PagedKVCache,
    config: SpeculativeConfig,
    logits_processor: LogitsProcessorList,
    stop_checker: StopChecker,
    sampling: SamplingState,
    metrics: SpecDecodeMetrics,
    features: TargetFeatureCapture | None = None,
    k_controller: AutoKController | None = None,
    tree_controller: AutoTreeController | None = None,
    keep_logits: bool = False,
) -> list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """One draft / verify / accept step over every active row.

    `features` (drafters with `target_feature_layers`): hooks capturing the target's hidden states;
    the accepted positions' ones wait in `features.pending` until the drafter takes them.
    `k_controller` (num_speculative_tokens="auto"): picks this step's k and learns from its timing;
    `tree_controller` (tree="auto"): the same for the tree's size.

    Returns, per active row: (row, emitted tokens, their raw logits, their processed logits), the
    logits only with `keep_logits` (else None).
    """
    rows = state.active_rows()
    seq_lens = state.seq_lens[rows]

    # 1. draft: k drafts, never more than the row may still emit, minus the token the target adds
    timer = StepTimer(model.device)  # the parts' seconds for the metrics, and for a profile when one is active
    k = config.max_draft_tokens if k_controller is None else k_controller.next_k(len(rows))
    if config.disable_by_batch_size is not None and len(rows) >= config.disable_by_batch_size:
        k = 0
    max_draft = np.clip(np.minimum(k, state.max_length - seq_lens - 1), 0, None)
    tree_size = None if tree_controller is None else tree_controller.next_size(len(rows))
    proposal = proposer.propose(
        ProposeRequest(
            rows=rows.tolist(),
            token_ids=[state.tokens(r) for r in rows],
            max_draft_tokens=max_draft.tolist(),
            target_features=None if features is None else features.pending,
            max_tree_nodes=tree_size,
        )
    )
    if proposal.draft_probs is None:  # a grammar-forbidden deterministic draft cannot pass: cut it here
        proposal.draft_token_ids = cut_forbidden_drafts(logits_processor, rows, proposal.draft_token_ids)
    trees = proposal.draft_parents  # None: every row's drafts are a chain
    spec = SpecDecodeMetadata.from_drafts(proposal.draft_token_ids, device=model.device)
    num_draft = np.array(spec.num_draft_tokens, dtype=np.int64)
    metrics.draft_seconds += timer.lap("draft")

    # 2. verify: pending tokens + drafts of every row, packed into one forward (one per row for hybrids);
    # a tree's nodes sit at their depth's position and see only their ancestors (`tree_layout`)
    pending = [state.pending_tokens(r) for r in rows]
    num_pending = np.array([len(p) for p in pending], dtype=np.int64)
    segments = [np.concatenate([p.numpy(), d]) for p, d in zip(pending, proposal.draft_token_ids)]
    segment_lens = num_pending + num_draft
    if trees is None:
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(state.num_cached[rows], segment_lens)])
        tree_mask = None
    else:
        positions, tree_mask = tree_layout(state.num_cached[rows], num_pending, trees)
    segment_ends = np.cumsum(segment_lens)
    # logits of the last pending token and of every draft: num_draft + 1 per row
    keep = np.concatenate([np.arange(end - n - 1, end) for end, n in zip(segment_ends, num_draft)])
    if features is not None:
        features.begin_forward()
    input_ids, position_ids = to_device([np.concatenate(segments), positions], model.device)
    logits = forward_tokens(
        model, cache, rows.tolist(), segment_lens.tolist(), input_ids, position_ids, keep, tree_mask=tree_mask
    ).float()
    metrics.record_kv_usage(cache.num_blocks_used, cache.blocks_needed(state.num_cached[rows] + num_pending))
    metrics.verify_seconds += timer.lap("verify")

    # 3. sample: processors see, at each position, the prefix plain generate would have had
    if not logits_processor:
        processed = logits
    elif trees is None:
        for row, start, drafts in zip(rows, seq_lens, proposal.draft_token_ids):
            state.token_buffer[row, start : start + len(drafts)] = torch.from_numpy(drafts)
        logits_rows = np.repeat(rows, num_draft + 1)
        prefix_lens = np.repeat(seq_lens, num_draft + 1) + _offsets_within(num_draft + 1)
        processed = process_logits(logits_processor, logits, state.token_buffer, logits_rows, prefix_lens)
    else:
        processed = process_logits(logits_processor, logits, *tree_prefixes(state, rows, proposal.draft_token_ids, trees))
    metrics.sampler_seconds += timer.lap("logits_processing")
    generators = [sampling.generators[r] for r in rows]
    draws = None if all(g is None for g in generators) else draw_random(generators, spec, logits.shape[-1], logits.device)
    is_greedy = sampling.is_greedy[to_device([rows], model.device)[0]]
    if trees is None:
        output_tokens, num_accepted = rejection_sample(
            spec, processed, is_greedy, draws=draws, draft_probs=proposal.draft_probs, method=config.rejection_sample_method
        )
        accepted_nodes = None
    else:
        output_tokens, num_accepted, accepted_nodes = accept_tree(spec, trees, processed, is_greedy, draws=draws)
    metrics.sampler_seconds += timer.lap("sampling")

    # 4. emit, stop, roll back; the step's one device-to-host transfer (a sync on GPUs)
    results = [num_accepted[:, None].to(output_tokens.dtype), output_tokens]
    if accepted_nodes is not None:
        results.append(accepted_nodes.to(output_tokens.dtype))
    results = torch.cat(results, dim=1).cpu()
    num_accepted, output_tokens = results[:, 0].numpy(), results[:, 1 : 1 + output_tokens.shape[1]]
    # per row, the drafts accepted, in order: a chain's first ones, or a tree's accepted path
    paths = [np.arange(a) for a in num_accepted] if accepted_nodes is None else [
        results[i, 1 + output_tokens.shape[1] :][: num_accepted[i]].numpy() for i in range(len(rows))
    ]
    for i, row in enumerate(rows):
        state.token_buffer[row, seq_lens[i] : seq_lens[i] + num_accepted[i] + 1] = output_tokens[i, : num_accepted[i] + 1]
    num_kept, stopped = stop_checker.first_stop(state.token_buffer, rows, seq_lens, num_accepted + 1)
    metrics.record_step(
        spec.num_draft_tokens, num_accepted.tolist(), k,
        draft_depths=None if trees is None else [int(tree_depths(p).max(initial=0)) for p in trees],
    )
    metrics.num_emitted_tokens += int(num_kept.sum())

    # the logits of each emitted token, when asked for: at the row's root, then at each accepted draft
    # (consecutive for a chain), gathered for every row at once (at batch 8, k = 8 and a 152k
    # vocabulary these two copies were 27 ms of a 2 s step on CPU, so never when nobody reads them)
    raw_kept = processed_kept = None
    if keep_logits:
        first_logit = np.cumsum(num_draft + 1) - (num_draft + 1)
        emitted_logits = np.concatenate(
            [first + np.concatenate([[0], path + 1])[:kept] for first, path, kept in zip(first_logit, paths, num_kept)]
        )
        (emitted_index,) = to_device([emitted_logits], logits.device)
        raw_kept, processed_kept = logits[emitted_index], processed[emitted_index]
    emitted_start = np.cumsum(num_kept) - num_kept
    emitted, moves = [], []
    for i, row in enumerate(rows):
        start, kept = int(seq_lens[i]), int(num_kept[i])
        state.token_buffer[row, start + kept : start + num_draft[i] + 1] = state.pad_token_id
        state.seq_lens[row] = start + kept
        window = slice(int(emitted_start[i]), int(emitted_start[i]) + kept)
        emitted.append((
            int(row), output_tokens[i, :kept],
            None if raw_kept is None else raw_kept[window], None if processed_kept is None else processed_kept[window],
        ))  # fmt: skip
        accept_emitted(logits_processor, int(row), output_tokens[i, :kept])
        if stopped[i]:
            state.finished[row] = True
            cache.free_row(int(row))
            if features is not None:
                features.drop(int(row))
        else:
            first_draft = int(state.num_cached[row] + num_pending[i])
            if trees is not None:  # the accepted path's K/V move into place after the pending tokens
                moves.append((int(row), first_draft + paths[i], first_draft + np.arange(len(paths[i]))))
            state.num_cached[row] = first_draft + num_accepted[i]
            if features is not None:  # the pending token(s) and accepted drafts are context now
                segment_start = int(segment_ends[i] - segment_lens[i])
                features.keep_at(
                    int(row), segment_start + np.concatenate([np.arange(num_pending[i]), num_pending[i] + paths[i]])
                )
    if moves:
        cache.move_tokens(moves)
    for i, row in enumerate(rows):
        if not stopped[i]:
            cache.rollback(int(row), int(state.num_cached[row]))
    if stopped.any():
        finished = rows[stopped].tolist()
        proposer.release(finished, [state.tokens(r) for r in finished])
    timer.lap("emit")
    timer.finish(fed_prompt=bool(num_pending.max() > 1))
    if tree_controller is not None and num_draft.any() and num_pending.max() == 1:  # a drafted step, no prefill
        tree_controller.record_step(len(rows), tree_size, timer.elapsed(), int(num_kept.sum()))
    if k_controller is not None:
        k_controller.record_step(timer.elapsed(), k, spec.num_draft_tokens, num_accepted.tolist())
    return emitted


def _drafter_networks(proposer) -> list[torch.nn.Module]:
    """The modules a drafter runs, those of drafters it wraps (`NgramFirstProposer`) included."""
    found = []
    for part in vars(proposer).values():
        if isinstance(part, torch.nn.Module):
            found.append(part)
        elif hasattr(part, "propose"):
            found.extend(_drafter_networks(part))
    return found


def _offsets_within(lengths: np.ndarray) -> np.ndarray:
    """[0, 1, ..., n0-1, 0, 1, ..., n1-1, ...]"""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


# what transformers' generate() hands a custom_generate callable besides the user's inputs
_MODEL_KWARGS_WE_HANDLE = frozenset(
    {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache", "cache_position"}
)


def _prefill_inputs(model_kwargs: dict) -> dict:
    """Inputs besides the tokens (images as `mm_encoder_outputs`, `token_type_ids`, ...): the model's own
    prefill consumes them (`prefill.py`), as plain generate() uses them in its first step only."""
    return {
        k: v for k, v in model_kwargs.items()
        if k not in _MODEL_KWARGS_WE_HANDLE and v is not None and not (isinstance(v, (dict, list, tuple)) and not v)
    }


def _check_request(model, input_ids, generation_config, logits_processor, model_kwargs, synced_gpus) -> None:
    if generation_config.num_beams != 1:
        raise ValueError(f"num_beams={generation_config.num_beams} is not supported with speculative decoding; allowed: 1")
    for option in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"):
        if getattr(generation_config, option, None):
            raise ValueError(f"{option} is transformers' own assisted generation; do not combine it with speculative_config")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with speculative decoding; pass input_ids")
    prefill_inputs = _prefill_inputs(model_kwargs)
    if prefill_inputs:
        check_model_prefill(model, prefill_inputs)
    cache = model_kwargs.get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a pre-filled cache cannot be reused with speculative decoding; pass cache=None")
    if synced_gpus:
        raise ValueError("synced_gpus is not supported with speculative decoding")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    check_supported_processors(logits_processor)
    check_architecture(model)  # last: it may run a small probe forward, once per model


def _check_tree_request(cache: PagedKVCache, logits_processor: LogitsProcessorList) -> None:
    if cache.one_row_per_forward:
        raise ValueError(
            "speculative_config.tree is not supported on models with recurrent layers: their state follows one "
            "path, a tree has many"
        )
    if any(isinstance(p, SpeculativeGrammar) for p in logits_processor):
        raise ValueError("speculative_config.tree cannot be combined with structured output (xgrammar) yet")
    if any(kind in ("sliding", "chunked") for kind, _ in cache.layer_kinds or ()):
        raise ValueError(
            "speculative_config.tree is not supported on models with sliding-window or chunked attention layers yet "
            "(a window over a tree's slots is not defined)"
        )


def _initial_state(input_ids, attention_mask, generation_config, stop_checker: StopChecker) -> DecodeState:
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
    max_length = stop_checker.max_length or generation_config.max_length
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
        max_length=max_length,
        pad_token_id=pad_token_id,
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
