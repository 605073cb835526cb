"""Drafters. Each implements the small `Proposer` protocol of `base.py`; none imports the loop."""

from __future__ import annotations

import dataclasses

from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..cache.own_attention import runs_own_attention
from ..cache.paged_cache import PagedKVCache
from ..config import SpeculativeConfig
from .base import DraftProposal, Proposer, ProposeRequest
from .draft_model import DraftModelProposer, check_draft_compatible, load_draft_model
from .drafting import DraftSampling
from .layer_skip import LayerSkipProposer
from .ngram import NgramProposer
from .ngram_first import LookupFirstProposer, NgramFirstProposer
from .suffix import SuffixCache, SuffixProposer

__all__ = [
    "DraftModelProposer",
    "DraftProposal",
    "DraftSampling",
    "LayerSkipProposer",
    "LookupFirstProposer",
    "NgramFirstProposer",
    "NgramProposer",
    "ProposeRequest",
    "Proposer",
    "SuffixCache",
    "SuffixProposer",
    "build_proposer",
]


def build_proposer(
    config: SpeculativeConfig,
    target_model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    target_cache: PagedKVCache | None = None,
) -> Proposer:
    """The drafter `config.method` names, ready for `target_model`.

    Drafters that run a model sample their drafts when `generation_config.do_sample`, warped by
    the position-free processors of `logits_processor` (see `drafting.py`); greedy otherwise.
    `target_cache`: the loop's `PagedKVCache` for the target, which layer_skip drafts on and an MTP
    assistant (Gemma 4's) reads (required there, unused by the other drafters).
    """
    if config.method == "ngram":
        return NgramProposer(
            config.max_draft_tokens, config.prompt_lookup_min, config.prompt_lookup_max, tree=config.tree
        )
    if config.suffix_first:  # the suffix lookup, then whatever the rest of the config builds
        lookup = SuffixProposer.from_config(config, target_model)
        rest = dataclasses.replace(config, suffix_first=False, suffix_cache=None)
        drafter = build_proposer(rest, target_model, generation_config, logits_processor, target_cache)
        return LookupFirstProposer(lookup, drafter)
    if config.ngram_first:
        lookup = NgramProposer(
            config.prompt_lookup_num_tokens or config.max_draft_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        alone = dataclasses.replace(config, prompt_lookup_min=None, prompt_lookup_max=None, prompt_lookup_num_tokens=None)
        drafter = build_proposer(alone, target_model, generation_config, logits_processor, target_cache)
        return NgramFirstProposer(lookup, drafter)
    if config.method == "suffix":
        return SuffixProposer.from_config(config, target_model)
    if config.method in ("draft_model", "layer_skip"):
        sampling = DraftSampling.from_generate(generation_config, logits_processor, config)
        if config.method == "layer_skip":
            if target_cache is None:
                raise ValueError("build_proposer: method='layer_skip' drafts on the target's cache; pass target_cache")
            return LayerSkipProposer(
                target_model, target_cache, config.early_exit_layer, config.max_draft_tokens, sampling
            )
        draft = load_draft_model(config.model, target_model)
        check_draft_compatible(draft, target_model)
        return DraftModelProposer(
            draft,
            config.max_draft_tokens,
            sampling,
            block_size=config.block_size,
            num_blocks=config.num_kv_blocks,
            max_length=generation_config.max_length if generation_config is not None else None,
            output_device=target_model.device,
            tree=config.tree,
        )
    if config.method == "mtp":
        from .mtp import MtpProposer, load_mtp_model  # imports transformers' MtpModel: only when used
        from .mtp_assistant import MtpAssistantProposer, is_mtp_assistant, load_mtp_assistant

        if is_mtp_assistant(config.model):  # an MTP drafter of its own reading the target's KV (Gemma 4's assistant)
            if target_cache is None:
                raise ValueError("build_proposer: an assistant model attends to the target's cache; pass target_cache")
            return MtpAssistantProposer(
                target_model,
                load_mtp_assistant(config.model, target_model),
                target_cache,
                config.max_draft_tokens,
                DraftSampling.from_generate(generation_config, logits_processor, config),
            )
        if runs_own_attention(target_model):
            raise ValueError(
                "speculative_config.method='mtp' is not supported for this model: it runs on its own attention (the "
                "paged attention cannot run its layers), and its MTP layers, built like them, would run on the paged one"
            )
        return MtpProposer(
            target_model,
            load_mtp_model(config.model, target_model),
            config.max_draft_tokens,
            DraftSampling.from_generate(generation_config, logits_processor, config),
            block_size=config.block_size,
            num_blocks=config.num_kv_blocks,
            max_length=generation_config.max_length if generation_config is not None else None,
        )
    if config.method in ("eagle", "eagle3"):
        from .eagle import EagleProposer  # imports transformers' Llama modules: only when used

        max_length = generation_config.max_length if generation_config is not None else None
        return EagleProposer.from_config(config, target_model, max_length=max_length)
    raise NotImplementedError(
        f"speculative_config.method={config.method!r} is not implemented yet; "
        "available: 'ngram', 'suffix', 'draft_model', 'layer_skip', 'mtp', 'eagle', 'eagle3'"
    )
