"""Drafters. Each implements the small `Proposer` protocol of `base.py`; none imports the loop."""

from __future__ import annotations

from ..config import SpeculativeConfig
from .base import DraftProposal, Proposer, ProposeRequest
from .ngram import NgramProposer

__all__ = ["DraftProposal", "NgramProposer", "ProposeRequest", "Proposer", "build_proposer"]


def build_proposer(config: SpeculativeConfig, target_model) -> Proposer:
    """The drafter `config.method` names, ready for `target_model`."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise NotImplementedError(f"speculative_config.method={config.method!r} is not implemented yet; available: 'ngram'")
