"""The numba KMP n-gram (prompt lookup) proposer, against a plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build_tiny_llama

from hf_specdec.config import SpeculativeConfig
from hf_specdec.drafters import NgramProposer, ProposeRequest, build_proposer


def reference_draft(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; the first match that ends before the last token; what followed it, up to k."""
    if k <= 0:
        return []
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        for i in range(0, length - n):  # i + n <= length - 1
            if context[i : i + n] == suffix:
                return context[i + n : i + n + k]
    return []


def propose_one(proposer: NgramProposer, context, max_draft: int | None = None) -> list[int]:
    request = ProposeRequest(
        rows=[0],
        token_ids=[np.asarray(context, dtype=np.int64)],
        max_draft_tokens=[proposer.k if max_draft is None else max_draft],
    )
    proposal = proposer.propose(request)
    assert len(proposal.draft_token_ids) == 1
    assert proposal.draft_probs is None
    return proposal.draft_token_ids[0].tolist()


def test_seed_example():
    assert propose_one(NgramProposer(4, 2, 3), [1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_ngram_wins():
    # suffix [7, 8, 9]: the 3-gram occurs at index 4 (followed by 50, 51); the 1-gram [9] occurs earlier (followed by 30)
    context = [9, 30, 31, 32, 7, 8, 9, 50, 51, 8, 9, 40, 7, 8, 9]
    assert propose_one(NgramProposer(2, 1, 3), context) == [50, 51]
    assert propose_one(NgramProposer(2, 1, 1), context) == [30, 31]
    # 2-gram [8, 9] first occurs at index 5 too
    assert propose_one(NgramProposer(2, 2, 2), context) == [50, 51]
    # a min above every matching n gives nothing
    assert propose_one(NgramProposer(2, 4, 5), context) == []


def test_first_match_is_used():
    context = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert propose_one(NgramProposer(3, 2, 2), context) == [1, 5, 6]


def test_fewer_than_k_near_the_end():
    # the match of [3] ends right before the last token: only that token follows
    assert propose_one(NgramProposer(5, 1, 1), [1, 2, 3, 3]) == [3]
    assert propose_one(NgramProposer(5, 1, 2), [4, 1, 2, 1, 2]) == [1, 2]
    assert propose_one(NgramProposer(8, 1, 3), [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2, 3]


def test_match_must_end_before_the_last_token():
    # [7, 7]: the suffix [7] matches at index 0, which ends before the last token
    assert propose_one(NgramProposer(3, 1, 1), [7, 7]) == [7]
    # the suffix only matches itself: no draft
    assert propose_one(NgramProposer(3, 1, 4), [1, 2, 3, 4]) == []
    # a single token has no earlier context
    assert propose_one(NgramProposer(3, 1, 4), [5]) == []


def test_no_match_is_empty():
    assert propose_one(NgramProposer(5, 1, 4), list(range(20))) == []
    assert propose_one(NgramProposer(5, 2, 4), [1, 2, 3, 1, 4, 5, 6, 7, 3]) == []


def test_max_draft_tokens_per_row():
    proposer = NgramProposer(5, 1, 3)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    assert propose_one(proposer, context) == [4, 5, 6, 7, 8]
    assert propose_one(proposer, context, max_draft=2) == [4, 5]
    assert propose_one(proposer, context, max_draft=0) == []
    assert propose_one(proposer, context, max_draft=-3) == []
    assert propose_one(proposer, context, max_draft=99) == [4, 5, 6, 7, 8]  # never more than k


def test_batch_of_rows_is_independent():
    proposer = NgramProposer(3, 1, 3)
    contexts = [
        [1, 2, 3, 4, 5, 1, 2, 3],
        list(range(10, 20)),
        [9, 9, 9, 9],
        [4, 5, 6, 4, 5],
        [6, 7, 8, 9, 6, 7],
    ]
    max_draft = [3, 3, 2, 0, 1]
    proposal = proposer.propose(
        ProposeRequest(
            rows=[0, 2, 5, 6, 7],
            token_ids=[np.asarray(c, dtype=np.int64) for c in contexts],
            max_draft_tokens=max_draft,
        )
    )
    drafts = [d.tolist() for d in proposal.draft_token_ids]
    assert drafts == [[4, 5, 1], [], [9], [], [8]]  # [9, 9, 9] matches at 0: one token follows
    assert proposal.num_draft_tokens == [3, 0, 1, 0, 1]
    for draft in proposal.draft_token_ids:
        assert draft.dtype == np.int64


def test_build_proposer_uses_config():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = build_proposer(config, target_model=None)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.k, proposer.min_n, proposer.max_n) == (4, 2, 3)
    assert propose_one(proposer, [1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    proposer.release([0])  # stateless, but part of the protocol
    # every method is implemented now; one that does not fit the target says why
    with pytest.raises(ValueError, match="num_mtp_layers"):
        build_proposer(SpeculativeConfig(method="mtp"), target_model=build_tiny_llama())


@pytest.mark.parametrize("vocab", (2, 3, 5, 12))
def test_matches_reference_on_random_contexts(vocab):
    rng = np.random.default_rng(vocab)
    proposers = {}
    for case in range(150):
        k = int(rng.integers(1, 9))
        min_n = int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 4))
        key = (k, min_n, max_n)
        if key not in proposers:
            proposers[key] = NgramProposer(k, min_n, max_n)
        length = int(rng.integers(1, 40))
        context = rng.integers(0, vocab, size=length).tolist()
        max_draft = int(rng.integers(0, k + 2))
        expected = reference_draft(context, min_n, max_n, min(k, max_draft))
        assert propose_one(proposers[key], context, max_draft) == expected, (case, context, key, max_draft)


def test_batched_matches_reference_on_random_contexts():
    rng = np.random.default_rng(1234)
    proposer = NgramProposer(6, 2, 4)
    for _ in range(30):
        contexts = [
            rng.integers(0, 4, size=int(rng.integers(1, 50))).tolist() for _ in range(int(rng.integers(1, 9)))
        ]
        max_draft = [int(m) for m in rng.integers(0, 8, size=len(contexts))]
        proposal = proposer.propose(
            ProposeRequest(
                rows=list(range(len(contexts))),
                token_ids=[np.asarray(c, dtype=np.int64) for c in contexts],
                max_draft_tokens=max_draft,
            )
        )
        for context, limit, draft in zip(contexts, max_draft, proposal.draft_token_ids, strict=True):
            assert draft.tolist() == reference_draft(context, 2, 4, min(6, limit)), (context, limit)


def test_reference_self_check():
    """The reference itself, on the seed example and the end-of-context rule."""
    assert reference_draft([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]
    assert reference_draft([1, 2, 3, 4], 1, 4, 3) == []
    assert reference_draft([7, 7], 1, 1, 3) == [7]
