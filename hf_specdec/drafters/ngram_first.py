"""A lookup first, a model drafter for the rest: the n-gram lookup (`prompt_lookup_max` with a
non-ngram method) or the suffix lookup (`suffix_first`, `suffix.py`), through the same class.

Rows whose context has a match take the n-gram drafter's tokens: free to make, and where the
output repeats its context (code, edits, lists, a small model looping) long runs of them are
accepted. The other rows are asked of the method's drafter (EAGLE head, draft model, ...) in
the same step. A row served by the n-gram is asked for no drafts by the model drafter: EAGLE and
MTP leave its target features waiting in the loop's queue until it is theirs again, draft models
catch up from their own cache, so nothing runs for it.

N-gram drafts are fixed tokens (a one-hot q). When the model drafter samples and returns its q,
the n-gram rows get one-hot rows in that tensor, so the rejection sampler's p/q test treats them
exactly as it treats `draft_probs=None`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .base import DraftProposal, Proposer, ProposeRequest
from .ngram import NgramProposer


class LookupFirstProposer:
    """`lookup`'s drafts where it finds a match, `drafter`'s elsewhere. `lookup` drafts fixed tokens
    (n-gram, suffix); it sees every row every step (so a stateful lookup stays up to date)."""

    def __init__(self, lookup: Proposer, drafter: Proposer):
        self.lookup = lookup
        self.drafter = drafter
        layers = getattr(drafter, "target_feature_layers", None)
        if layers:  # the loop captures features only for drafters that declare them
            self.target_feature_layers = layers

    def propose(self, request: ProposeRequest) -> DraftProposal:
        lookup = self.lookup.propose(request).draft_token_ids
        matched = [len(tokens) > 0 for tokens in lookup]
        rest = dataclasses.replace(
            request, max_draft_tokens=[0 if m else n for m, n in zip(matched, request.max_draft_tokens)]
        )
        modelled = self.drafter.propose(rest)
        drafts = [found if m else own for m, found, own in zip(matched, lookup, modelled.draft_token_ids)]
        return DraftProposal(draft_token_ids=drafts, draft_probs=_with_one_hot_rows(modelled, drafts, matched))

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        self.lookup.release(rows, token_ids)
        self.drafter.release(rows, token_ids)


class NgramFirstProposer(LookupFirstProposer):
    """`ngram`'s drafts where it finds a match, `drafter`'s elsewhere."""

    def __init__(self, ngram: NgramProposer, drafter: Proposer):
        super().__init__(ngram, drafter)

    @property
    def ngram(self) -> NgramProposer:
        return self.lookup


def _with_one_hot_rows(modelled: DraftProposal, drafts, matched: list[bool]) -> torch.Tensor | None:
    """The drafter's q (flat, row-major over its drafts) with one-hot rows for the n-gram's drafts."""
    q = modelled.draft_probs
    if q is None or not any(matched):
        return q
    pieces, start = [], 0
    for tokens, from_ngram, own in zip(drafts, matched, modelled.draft_token_ids):
        if from_ngram:
            ids = torch.as_tensor(tokens, dtype=torch.long, device=q.device)
            pieces.append(torch.nn.functional.one_hot(ids, q.shape[-1]).to(q.dtype))
        else:
            pieces.append(q[start : start + len(own)])
        start += 0 if from_ngram else len(own)
    return torch.cat(pieces)
