"""The protocol every drafter implements (the batched analogue of transformers'
`CandidateGenerator`).

Each step the loop hands the drafter the rows that are still generating, with their tokens so
far (left padding removed) and how many draft tokens each may receive; the drafter answers with
up to that many tokens per row (possibly none). Drafters that sample also return the draft
probabilities q of their tokens, which the rejection sampler needs for p/q acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..models.feature_capture import PendingFeatures


@dataclass
class ProposeRequest:
    rows: list[int]  # batch index of each row asking for drafts
    token_ids: list[np.ndarray]  # each row's tokens so far (prompt + generated), int64, unpadded
    max_draft_tokens: list[int]  # at most this many drafts for each row (may be 0)
    # Drafters with `target_feature_layers` (EAGLE, MTP): the target hidden states of the positions
    # that became accepted context (the pending token(s) and the accepted drafts) and that the
    # drafter has not taken yet, per row (none before the first verify). The same queue every
    # call: what a drafter leaves there waits for its next call. None for drafters that read tokens only.
    target_features: PendingFeatures | None = None
    # tree drafters: at most this many nodes per row this step (`"tree": "auto"` picks it per step)
    max_tree_nodes: int | None = None
    # per row, the target's position of a token less its count (0 but after an M-RoPE image): for
    # drafters running the target's own layers on its cache (layer_skip). None: all 0
    position_offsets: list[int] | None = None


@dataclass
class DraftProposal:
    draft_token_ids: list[np.ndarray]  # per row, 0..max_draft_tokens[i] tokens
    draft_probs: torch.Tensor | None = None  # [sum of draft lengths, vocab] q of each draft, None = one-hot
    # per row, the parent of each draft (`sampling/tree.py`): the drafts form a tree; None = chains.
    # Tree drafts are the drafter's ranked candidates (one-hot: draft_probs stays None)
    draft_parents: list[np.ndarray] | None = None

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(tokens) for tokens in self.draft_token_ids]

    def shortened(self, lengths: list[int]) -> DraftProposal:
        """Each row's first `lengths[i]` chain drafts (and their q). Exact for sampled drafts only where a length
        depends on the row's drafts up to it, not on what follows or on the target (a stopping rule)."""
        if self.draft_parents is not None:
            raise ValueError("DraftProposal.shortened: draft trees cannot be cut this way")
        probs = self.draft_probs
        if probs is not None:
            starts = np.cumsum([0, *self.num_draft_tokens[:-1]])
            kept = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, lengths)] or [np.zeros(0, np.int64)])
            probs = probs[torch.as_tensor(kept, dtype=torch.long, device=probs.device)]
        return DraftProposal([tokens[:n] for tokens, n in zip(self.draft_token_ids, lengths)], probs)


class Proposer(Protocol):
    """Optionally, `target_feature_layers: tuple[int, ...]` (transformers `hidden_states` indices
    of the target, L = the final norm's output): the loop then captures those hidden states during
    its forwards and passes them in `ProposeRequest.target_features` (see `feature_capture.py`).
    A drafter that drafts on the target's own `PagedKVCache` (layer_skip) gets it when built
    (`build_proposer(..., target_cache=)`) and must give every row back at its length.
    """

    def propose(self, request: ProposeRequest) -> DraftProposal: ...

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        """Rows that finished: drop whatever state the drafter keeps for them. `token_ids`: each
        row's final tokens (prompt + output, unpadded; the loop always passes them), for drafters
        that learn from finished outputs (suffix)."""
        ...
