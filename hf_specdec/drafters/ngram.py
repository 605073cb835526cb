"""n-gram (prompt lookup) drafter: KMP search compiled with numba (seed §12.4.4).

For each row, the last n tokens are searched for in the row's earlier context, longest n first
(prompt_lookup_max down to prompt_lookup_min); the tokens that followed the first match are the
draft (up to k: fewer when the match sits near the end of the context).
"""

from __future__ import annotations

import numba
import numpy as np

from .base import DraftProposal, ProposeRequest


@numba.njit(nogil=True)
def _kmp_lps(pattern: np.ndarray) -> np.ndarray:
    """Longest proper prefix of pattern[:i+1] that is also its suffix, for every i."""
    lps = np.zeros(pattern.shape[0], dtype=np.int64)
    matched = 0
    i = 1
    while i < pattern.shape[0]:
        if pattern[i] == pattern[matched]:
            matched += 1
            lps[i] = matched
            i += 1
        elif matched != 0:
            matched = lps[matched - 1]
        else:
            i += 1
    return lps


@numba.njit(nogil=True)
def _find_after_match(context: np.ndarray, n: int) -> int:
    """Index just after the first earlier occurrence of context's last n tokens, or -1."""
    pattern = context[-n:]
    lps = _kmp_lps(pattern)
    i = 0
    j = 0
    # stop before the suffix itself: a match must end before the last token
    while i < context.shape[0] - 1:
        if context[i] == pattern[j]:
            i += 1
            j += 1
            if j == n:
                return i
        elif j != 0:
            j = lps[j - 1]
        else:
            i += 1
    return -1


@numba.njit(nogil=True)
def propose_ngram_batch(
    flat_tokens: np.ndarray,
    row_starts: np.ndarray,
    max_draft_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    out_tokens: np.ndarray,
) -> np.ndarray:
    """Drafts for every row of a batch in one call; returns the number of drafts per row."""
    num_rows = row_starts.shape[0] - 1
    counts = np.zeros(num_rows, dtype=np.int64)
    for row in range(num_rows):
        context = flat_tokens[row_starts[row] : row_starts[row + 1]]
        k = max_draft_tokens[row]
        if k <= 0:
            continue
        for n in range(min(max_n, context.shape[0] - 1), min_n - 1, -1):
            start = _find_after_match(context, n)
            if start >= 0:
                count = min(k, context.shape[0] - start)
                out_tokens[row, :count] = context[start : start + count]
                counts[row] = count
                break
    return counts


class NgramProposer:
    """Prompt-lookup drafts from each row's own prompt and generated tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # compile now, not on the user's first step
        self.propose(ProposeRequest(rows=[0], token_ids=[np.zeros(64, dtype=np.int64)], max_draft_tokens=[self.k]))

    def propose(self, request: ProposeRequest) -> DraftProposal:
        lengths = np.array([len(tokens) for tokens in request.token_ids], dtype=np.int64)
        row_starts = np.concatenate([[0], np.cumsum(lengths)])
        flat_tokens = np.concatenate(request.token_ids).astype(np.int64, copy=False)
        max_draft = np.minimum(np.asarray(request.max_draft_tokens, dtype=np.int64), self.k)
        out_tokens = np.zeros((len(lengths), self.k), dtype=np.int64)
        counts = propose_ngram_batch(flat_tokens, row_starts, max_draft, self.min_n, self.max_n, out_tokens)
        return DraftProposal(draft_token_ids=[out_tokens[i, : counts[i]] for i in range(len(lengths))])

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        pass  # stateless
