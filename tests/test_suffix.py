"""method="suffix" (SuffixDecoding): the numba suffix tries against a plain-Python reference of the
documented rule, the global cache (FIFO eviction, node reuse, reconfiguration, threads), greedy
identity with plain generate() (alone, behind a draft model, with a shared cache), more accepted
drafts on a second call, the sampled distribution, and the config's checks."""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    plain_generate,
    repeated_span_batch,
    repeated_span_prompts,
)
from test_draft_model import perturbed_copy
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import (
    LookupFirstProposer,
    ProposeRequest,
    SuffixCache,
    SuffixProposer,
    build_proposer,
)
from hf_specdec.drafters.suffix import BEST, COUNT, FIRST, MODEL_CACHE_ATTRIBUTE, SIBLING, TOKEN, TOTAL, USED

# --- the reference: the module docstring's rule, in plain Python --------------------------------


class ReferenceTrie:
    """Every substring of at most `depth` tokens of each sequence (no window crosses two sequences),
    with its count and when it was last counted: (sequence index, end position)."""

    def __init__(self, sequences, depth: int):
        self.count: Counter = Counter()
        self.last: dict[tuple, tuple[int, int]] = {}
        self.children: dict[tuple, set[int]] = {}
        for index, sequence in enumerate(sequences):
            sequence = [int(t) for t in sequence]
            for end in range(len(sequence)):
                for length in range(1, min(depth, end + 1) + 1):
                    substring = tuple(sequence[end - length + 1 : end + 1])
                    self.count[substring] += 1
                    self.last[substring] = (index, end)
                    self.children.setdefault(substring[:-1], set()).add(substring[-1])

    def total(self, substring: tuple) -> int:
        return sum(self.count[substring + (t,)] for t in self.children.get(substring, ()))

    def best(self, substring: tuple) -> int | None:
        """The most frequent continuation; a tie goes to the one counted most recently."""
        children = self.children.get(substring)
        if not children:
            return None
        return max(children, key=lambda t: (self.count[substring + (t,)], self.last[substring + (t,)]))

    def contents(self) -> dict[tuple, tuple[int, int, int | None]]:
        """substring -> (count, total, best continuation or None), as `trie_contents` reads the arrays."""
        return {s: (c, self.total(s), self.best(s)) for s, c in self.count.items()}


def reference_path(trie: ReferenceTrie, context, depth, k, factor, min_prob) -> tuple[list[int], float]:
    """The best draft of one trie: every suffix length m that occurred with a continuation follows
    the most frequent child while the product of count / total stays >= min_prob, for at most
    min(k, floor(factor * m), depth - m) tokens; the highest score (sum of those products) wins,
    the longer match on a tie."""
    context = tuple(int(t) for t in context)
    best, best_score = [], 0.0
    for m in range(1, min(len(context), depth) + 1):
        node = context[-m:]
        if trie.total(node) == 0:
            continue
        cap = min(k, math.floor(factor * m), depth - m)
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < cap:
            child = trie.best(node)
            if child is None:
                break
            prob = prob * trie.count[node + (child,)] / trie.total(node)
            if prob < min_prob:
                break
            draft.append(child)
            score += prob
            node = node + (child,)
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def reference_draft(context, outputs, depth, k, factor, min_prob, global_depth=None) -> list[int]:
    """The row's own trie (its context) against the global trie (earlier outputs): the row's wins a tie."""
    own, own_score = reference_path(ReferenceTrie([context], depth), context, depth, k, factor, min_prob)
    if outputs:
        global_depth = depth if global_depth is None else global_depth
        trie = ReferenceTrie(outputs, global_depth)
        other, other_score = reference_path(trie, context, global_depth, k, factor, min_prob)
        if other_score > own_score:
            return other
    return own


def trie_contents(trie) -> dict[tuple, tuple[int, int, int | None]]:
    """What a numba trie holds: substring -> (count, total, best child's token or None)."""
    nodes, contents = trie.nodes, {}

    def walk(node: int, prefix: tuple) -> None:
        substring = prefix + (int(nodes[node, TOKEN]),)
        best = int(nodes[node, BEST])
        contents[substring] = (
            int(nodes[node, COUNT]),
            int(nodes[node, TOTAL]),
            int(nodes[best, TOKEN]) if best >= 0 else None,
        )
        child = nodes[node, FIRST]
        while child >= 0:
            walk(int(child), substring)
            child = nodes[child, SIBLING]

    for token in np.flatnonzero(trie.root >= 0):
        node = int(trie.root[token])
        assert nodes[node, TOKEN] == token
        walk(node, ())
    return contents


def propose(proposer: SuffixProposer, contexts, max_draft=None, rows=None) -> list[list[int]]:
    proposal = proposer.propose(
        ProposeRequest(
            rows=list(range(len(contexts))) if rows is None else rows,
            token_ids=[np.asarray(c, dtype=np.int64) for c in contexts],
            max_draft_tokens=[proposer.k] * len(contexts) if max_draft is None else max_draft,
        )
    )
    assert proposal.draft_probs is None  # fixed tokens: one-hot q
    for draft in proposal.draft_token_ids:
        assert draft.dtype == np.int64
    return [d.tolist() for d in proposal.draft_token_ids]


def random_sequence(rng, vocab: int, low: int, high: int) -> list[int]:
    return rng.integers(0, vocab, size=int(rng.integers(low, high))).tolist()


# --- 1. the drafter against the reference ------------------------------------------------------


def test_reference_self_check():
    """The reference on hand-worked contexts, and the drafter on the same."""
    # [2] and [1, 2] were followed by 3 and by 4 once each: 4 was counted last; p 0.5, then 1, 1
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    assert reference_path(ReferenceTrie([context], 8), context, 8, 4, 4.0, 0.0) == ([4, 1, 2], 1.5)
    assert reference_path(ReferenceTrie([context], 8), context, 8, 4, 4.0, 0.6) == ([], 0.0)
    # the longest match drafts most, capped by factor * m (m = 4 -> 4 tokens; 0.5 x m: 2) and depth - m (4 - 2 -> 2)
    context = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    assert reference_path(ReferenceTrie([context], 8), context, 8, 5, 1.0, 0.0) == ([6, 7, 8, 5], 4.0)
    assert reference_path(ReferenceTrie([context], 8), context, 8, 5, 0.5, 0.0) == ([6, 7], 2.0)
    assert reference_path(ReferenceTrie([context], 4), context, 4, 5, 1.0, 0.0) == ([6, 7], 2.0)
    for depth, k, factor, min_prob, expected in [
        (8, 4, 4.0, 0.0, [4, 1, 2]),
        (8, 4, 4.0, 0.6, []),
        (8, 2, 4.0, 0.0, [4, 1]),
    ]:
        proposer = SuffixProposer(k, depth, factor, min_prob)
        assert propose(proposer, [[1, 2, 3, 1, 2, 4, 1, 2]]) == [expected]
    context = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    assert propose(SuffixProposer(5, 8, 1.0, 0.0), [context]) == [[6, 7, 8, 5]]
    assert propose(SuffixProposer(5, 8, 0.5, 0.0), [context]) == [[6, 7]]
    assert propose(SuffixProposer(5, 4, 1.0, 0.0), [context]) == [[6, 7]]
    # the global trie's draft wins only with a higher score; the row's own wins a tie
    cache = SuffixCache(max_tree_depth=8)
    cache.add_outputs([[9, 1, 2, 3, 4, 5]])
    assert propose(SuffixProposer(4, 8, 4.0, 0.0, cache), [[7, 1, 2]]) == [[3, 4, 5]]
    assert propose(SuffixProposer(4, 8, 4.0, 0.0, cache), [[1, 2, 6, 1, 2]]) == [[6, 1, 2]]
    assert reference_draft([1, 2, 6, 1, 2], [[9, 1, 2, 3, 4, 5]], 8, 4, 4.0, 0.0) == [6, 1, 2]
    # a cache deeper than the call: matched and drafted within the call's depth (m = 1: 4 - 1 tokens)
    deep = SuffixCache(max_tree_depth=8)
    deep.add_outputs([[1, 2, 3, 4, 5, 6, 7]])
    assert propose(SuffixProposer(6, 4, 4.0, 0.0, deep), [[9, 1, 2]]) == [[3, 4, 5]]
    assert propose(SuffixProposer(6, 4, 1.0, 0.0, deep), [[9, 1, 2]]) == [[3, 4]]  # m = 2: 2 tokens
    assert reference_draft([9, 1, 2], [[1, 2, 3, 4, 5, 6, 7]], 4, 6, 4.0, 0.0, global_depth=4) == [3, 4, 5]


SETTINGS_GRID = [  # (depth, k, factor, min_prob): factors are dyadic, so floor(factor * m) is exact
    (1, 4, 1.0, 0.1),
    (3, 5, 1.0, 0.0),
    (4, 8, 2.0, 0.1),
    (6, 3, 0.5, 0.25),
    (8, 6, 1.5, 0.0),
    (24, 8, 1.0, 0.1),
    (16, 16, 4.0, 0.5),
]


@pytest.mark.parametrize("vocab", (2, 3, 6))
@pytest.mark.parametrize("depth,k,factor,min_prob", SETTINGS_GRID)
def test_incremental_rows_match_reference(vocab, depth, k, factor, min_prob):
    """Rows whose tokens arrive a few at a time (as the loop hands them) draft what the reference
    drafts from the whole context, and what a proposer that sees the context once drafts."""
    rng = np.random.default_rng(vocab * 100 + depth)
    proposer = SuffixProposer(k, depth, factor, min_prob)
    contexts = [random_sequence(rng, vocab, 1, 6) for _ in range(3)]
    drafted = 0
    for _ in range(12):
        max_draft = [int(m) for m in rng.integers(0, k + 2, size=len(contexts))]
        drafts = propose(proposer, contexts, max_draft)
        fresh = propose(SuffixProposer(k, depth, factor, min_prob), contexts, max_draft)
        assert drafts == fresh, (contexts, max_draft)
        for context, limit, draft in zip(contexts, max_draft, drafts, strict=True):
            assert draft == reference_draft(context, [], depth, min(k, limit), factor, min_prob), (
                context,
                limit,
            )
            drafted += len(draft)
        for context in contexts:  # 0-4 tokens each, sometimes the draft's own
            draft = reference_draft(context, [], depth, k, factor, min_prob)
            new = (
                draft[: int(rng.integers(0, 3))]
                + rng.integers(0, vocab, size=int(rng.integers(0, 3))).tolist()
            )
            context.extend(new)
    assert drafted > 0 or depth == 1
    propose(proposer, contexts)  # the rows take in the last tokens
    for row in range(len(contexts)):  # the row's trie is the reference trie of its whole context
        assert trie_contents(proposer._rows[row].trie) == ReferenceTrie([contexts[row]], depth).contents()


@pytest.mark.parametrize("depth,k,factor,min_prob", SETTINGS_GRID[1:])
def test_rows_and_global_cache_match_reference(depth, k, factor, min_prob):
    """Rows drafting from their own trie and a global cache that gains (and evicts) outputs between
    steps: each step equals the reference over the row's context and the cache's kept outputs."""
    rng = np.random.default_rng(depth * 7 + k)
    cache_depth = [depth, max(1, depth // 2), depth + 3][depth % 3]  # the call drafts from the smaller
    cache = SuffixCache(max_tree_depth=cache_depth, max_cached_requests=4)
    proposer = SuffixProposer(k, depth, factor, min_prob, cache)
    contexts = [random_sequence(rng, 4, 1, 8) for _ in range(3)]
    from_global = 0
    for step in range(12):
        if step % 3 == 1:
            cache.add_outputs([random_sequence(rng, 4, 0, 12) for _ in range(int(rng.integers(1, 3)))])
        drafts = propose(proposer, contexts)
        outputs = cache.outputs()
        global_depth = min(depth, cache_depth)
        for context, draft in zip(contexts, drafts, strict=True):
            assert draft == reference_draft(context, outputs, depth, k, factor, min_prob, global_depth), (
                context,
                step,
            )
            from_global += draft != reference_draft(context, [], depth, k, factor, min_prob)
        for context in contexts:
            context.extend(rng.integers(0, 4, size=int(rng.integers(1, 4))).tolist())
    assert from_global > 0, "no draft came from the global cache: the test proves little"


def test_rows_refind_their_nodes_when_the_cache_changes():
    """A row's nodes in the global trie are found again after the cache changed, even without new
    tokens: a suffix that had no match gains one, nodes that were evicted (and reused) are dropped."""
    cache = SuffixCache(max_tree_depth=6, max_cached_requests=2)
    cache.add_outputs([[5, 5]])
    proposer = SuffixProposer(4, 6, 4.0, 0.0, cache)
    contexts = [[7, 1], [3, 5]]
    steps = [[], [[1, 2, 3]], [[4, 1, 6, 6, 6], [9, 3, 5, 8]], [[1, 2, 2]], [[3, 5, 1]]]
    drafted = []
    for outputs in steps:
        cache.add_outputs(outputs)
        drafts = propose(proposer, contexts)
        assert drafts == [reference_draft(c, cache.outputs(), 6, 4, 4.0, 0.0) for c in contexts]
        drafted.append(drafts)
    assert drafted[:3] == [[[], [5]], [[2, 3], [5]], [[6, 6, 6], [8]]]


def test_most_frequent_child_ties_go_to_the_last_counted():
    """[5] was followed by 7, 8, 7, 8: 8 was counted last (depth 2: only [5] drafts). In a cache,
    [5] followed by 7, 8, 7 (7 leads); after the oldest output goes, 7 and 8 tie again and 7
    (counted last) wins, as in a trie built afresh from the kept outputs."""
    assert propose(SuffixProposer(1, 2, 1.0, 0.0), [[5, 7, 5, 8, 5, 7, 5, 8, 5]]) == [[8]]
    assert propose(SuffixProposer(1, 2, 1.0, 0.0), [[5, 8, 5, 7, 5, 8, 5, 7, 5]]) == [[7]]
    cache = SuffixCache(max_tree_depth=4, max_cached_requests=2)
    cache.add_outputs([[5, 7], [5, 8], [5, 7]])  # the first is evicted: 7 and 8 once each, 7 the later
    assert propose(SuffixProposer(3, 4, 1.0, 0.0, cache), [[9, 5]]) == [[7]]
    assert trie_contents(cache._trie) == ReferenceTrie([[5, 8], [5, 7]], 4).contents()


# --- 2. the global cache ------------------------------------------------------------------------


def rebuilt(outputs, depth: int) -> SuffixCache:
    fresh = SuffixCache(max_tree_depth=depth, max_cached_requests=max(len(outputs), 1))
    fresh.add_outputs(outputs)
    return fresh


@pytest.mark.parametrize("depth", (2, 5, 12))
def test_eviction_leaves_the_trie_of_the_kept_outputs(depth):
    rng = np.random.default_rng(depth)
    cache = SuffixCache(max_tree_depth=depth, max_cached_requests=5)
    added = []
    for _ in range(9):  # one, two or three outputs at a time (some empty: skipped)
        batch = [random_sequence(rng, 3, 0, 25) for _ in range(int(rng.integers(1, 4)))]
        cache.add_outputs(batch)
        added.extend(o for o in batch if o)
        kept = added[-5:]
        assert len(cache) == len(kept) and [o.tolist() for o in cache.outputs()] == kept
        reference = ReferenceTrie(kept, depth)
        assert trie_contents(cache._trie) == reference.contents()
        fresh = rebuilt(kept, depth)
        assert cache.num_nodes == fresh.num_nodes == len(reference.count) + 1
        proposer, fresh_proposer = (
            SuffixProposer(6, depth, 1.0, 0.0, cache),
            SuffixProposer(6, depth, 1.0, 0.0, fresh),
        )
        contexts = [random_sequence(rng, 3, 1, 10) for _ in range(20)]
        assert propose(proposer, contexts) == propose(fresh_proposer, contexts)
    assert len(added) > 5


def test_freed_nodes_are_reused():
    """Adding and evicting thousands of outputs keeps the node array at the size a few need."""
    rng = np.random.default_rng(0)
    depth, bound, length = 8, 4, 40
    cache = SuffixCache(max_tree_depth=depth, max_cached_requests=bound)
    most_live = (bound + 1) * length * depth + 1  # add_outputs evicts after adding
    for _ in range(300):
        cache.add_outputs([rng.integers(0, 50, size=length)])
        assert cache._trie.meta[USED] <= most_live
    capacity = cache._trie.nodes.shape[0]
    for _ in range(1000):
        cache.add_outputs([rng.integers(0, 50, size=length) for _ in range(2)])
    assert cache._trie.nodes.shape[0] == capacity, "the node array grew: freed nodes were not reused"
    assert cache._trie.meta[USED] <= most_live
    assert len(cache) == bound
    assert trie_contents(cache._trie) == ReferenceTrie(cache.outputs(), depth).contents()
    assert cache.num_nodes == rebuilt(cache.outputs(), depth).num_nodes


def test_zero_cached_requests_keeps_nothing():
    cache = SuffixCache(max_tree_depth=6, max_cached_requests=0)
    cache.add_outputs([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert len(cache) == 0 and cache.num_nodes == 1 and cache.outputs() == []
    # drafts come from the row's own trie only
    assert propose(SuffixProposer(3, 6, 4.0, 0.0, cache), [[9, 1, 2]]) == [[]]
    assert propose(SuffixProposer(3, 6, 4.0, 0.0, cache), [[1, 2, 9, 1]]) == [[2, 9, 1]]
    kept = SuffixCache(max_tree_depth=6, max_cached_requests=3)
    kept.add_outputs([[1, 2, 3, 4]])
    assert propose(SuffixProposer(3, 6, 4.0, 0.0, kept), [[9, 1, 2]]) == [[3, 4]]
    kept.reconfigure(max_cached_requests=0)
    assert len(kept) == 0 and kept.num_nodes == 1
    assert propose(SuffixProposer(3, 6, 4.0, 0.0, kept), [[9, 1, 2]]) == [[]]


def test_reconfigure_and_clear():
    rng = np.random.default_rng(3)
    outputs = [random_sequence(rng, 3, 1, 20) for _ in range(6)]
    cache = SuffixCache(max_tree_depth=8, max_cached_requests=6)
    cache.add_outputs(outputs)
    proposer = SuffixProposer(4, 8, 1.0, 0.0, cache)
    contexts = [random_sequence(rng, 3, 2, 8) for _ in range(8)]
    propose(proposer, contexts)  # the rows follow the cache's nodes from here on
    version = cache.version
    cache.reconfigure(max_tree_depth=3)
    assert cache.max_tree_depth == 3 and cache.version != version
    assert trie_contents(cache._trie) == ReferenceTrie(outputs, 3).contents()
    assert propose(proposer, contexts) == [reference_draft(c, outputs, 8, 4, 1.0, 0.0, 3) for c in contexts]
    cache.reconfigure(max_cached_requests=2)
    assert [o.tolist() for o in cache.outputs()] == outputs[-2:]
    assert trie_contents(cache._trie) == ReferenceTrie(outputs[-2:], 3).contents()
    cache.reconfigure(max_tree_depth=8, max_cached_requests=6)
    assert trie_contents(cache._trie) == ReferenceTrie(outputs[-2:], 8).contents()
    assert propose(proposer, contexts) == [reference_draft(c, outputs[-2:], 8, 4, 1.0, 0.0) for c in contexts]
    with pytest.raises(ValueError, match="SuffixCache.max_tree_depth"):
        cache.reconfigure(max_tree_depth=0, max_cached_requests=1)
    assert (cache.max_tree_depth, cache.max_cached_requests, len(cache)) == (8, 6, 2)  # unchanged
    cache.clear()
    assert len(cache) == 0 and cache.num_nodes == 1
    assert propose(proposer, contexts) == [reference_draft(c, [], 8, 4, 1.0, 0.0) for c in contexts]


def test_release_adds_the_rows_outputs():
    cache = SuffixCache(max_tree_depth=6)
    proposer = SuffixProposer(3, 6, 1.0, 0.1, cache)
    propose(proposer, [[1, 2, 3], [4, 5]])
    propose(proposer, [[1, 2, 3, 7, 8], [4, 5, 9]])
    proposer.release([1])
    proposer.release([1, 5])  # unknown or already released rows are ignored
    assert [o.tolist() for o in cache.outputs()] == [[9]]
    propose(proposer, [[1, 2, 3, 7, 8, 6]], rows=[0])
    proposer.release([0])
    assert [o.tolist() for o in cache.outputs()] == [[9], [7, 8, 6]]
    assert proposer._rows == {}
    # with the final tokens (as the loop passes them) the last step's tokens are in too
    propose(proposer, [[1, 2, 3], [4, 5]])
    proposer.release([1, 0], [np.array([4, 5, 9, 9, 2]), np.array([1, 2, 3, 6])])
    assert [o.tolist() for o in cache.outputs()][2:] == [[9, 9, 2], [6]]


# --- 3. greedy identity with plain generate() ---------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(build_tiny_llama())


def suffix_config(k: int = 4, **extra) -> dict:
    return {"method": "suffix", "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize(
    "batch_size,k,extra",
    [
        (1, 1, {}),
        (1, 5, {"suffix_max_tree_depth": 6, "suffix_max_spec_factor": 2.0}),
        (3, 3, {}),
        (3, 8, {"suffix_min_token_prob": 0.0, "suffix_max_spec_factor": 4.0}),
    ],
)
def test_greedy_matches_plain_generate(target, batch_size, k, extra):
    inputs = repeated_span_batch(batch_size, seed=batch_size + 10)
    plain = plain_generate(target, **inputs, max_new_tokens=40, do_sample=False)
    out = target.generate(
        **inputs, max_new_tokens=40, do_sample=False, speculative_config=suffix_config(k, **extra),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] > 0, "no draft was ever accepted: the test proves nothing"
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"], "no draft was ever rejected"
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]


def test_greedy_suffix_first_before_a_draft_model(target, monkeypatch):
    """suffix_first: rows with a suffix match take its drafts, the others the draft model's."""
    inputs = left_padded_batch(repeated_span_prompts(3, seed=5)[:2] + [list(range(40, 47))])
    plain = plain_generate(target, **inputs, max_new_tokens=32, do_sample=False)
    served = {"suffix": 0, "model": 0}
    original = LookupFirstProposer.propose

    def counting(self, request):
        proposal = original(self, request)
        assert isinstance(self.lookup, SuffixProposer)
        found = self.lookup.propose(request).draft_token_ids  # stateless for tokens it has seen
        for own, draft in zip(found, proposal.draft_token_ids):
            served["suffix" if len(own) else "model"] += len(draft) > 0
        return proposal

    monkeypatch.setattr(LookupFirstProposer, "propose", counting)
    config = {
        "method": "draft_model",
        "model": perturbed_copy(target),
        "num_speculative_tokens": 3,
        "suffix_first": True,
        "suffix_max_cached_requests": 0,
    }
    out = target.generate(
        **inputs, max_new_tokens=32, do_sample=False, speculative_config=config, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    assert served["suffix"] > 0 and served["model"] > 0, served
    assert out.spec_metrics["num_accepted_tokens"] > 0


def test_greedy_with_a_shared_cache(target):
    """A SuffixCache passed in: used (and fed) instead of the model's own, output unchanged."""
    warm_inputs = repeated_span_batch(3, seed=21)
    warm = plain_generate(target, **warm_inputs, max_new_tokens=40, do_sample=False)
    cache = SuffixCache(max_tree_depth=12, max_cached_requests=8)
    cache.add_outputs(warm[:, warm_inputs["input_ids"].shape[1] :].tolist())
    own = getattr(target, MODEL_CACHE_ATTRIBUTE, None)
    own_size = None if own is None else len(own)
    config = suffix_config(4, suffix_cache=cache)
    out = target.generate(
        **warm_inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=config,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, warm)
    assert len(cache) == 6  # the call's 3 outputs joined the 3 it was warmed with
    assert getattr(target, MODEL_CACHE_ATTRIBUTE, None) is own and (own is None or len(own) == own_size)
    # the warm cache held these very continuations: most drafts are accepted
    assert out.spec_metrics["draft_acceptance_rate"] > 0.6
    assert isinstance(build_proposer(SpeculativeConfig(**config), target).cache, SuffixCache)


# --- 4. across calls ----------------------------------------------------------------------------


@pytest.mark.parametrize("cached", (10000, 0))
def test_second_call_accepts_more_from_the_models_cache(cached):
    model = hf_specdec.enable(build_tiny_llama())
    inputs = repeated_span_batch(3, seed=31)
    config = suffix_config(6, suffix_max_cached_requests=cached, cpu_linear_backend="torch")
    runs = [
        model.generate(**inputs, max_new_tokens=48, do_sample=False, speculative_config=config,
                       return_dict_in_generate=True)
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    first, second = (run.spec_metrics for run in runs)
    if cached:
        assert len(getattr(model, MODEL_CACHE_ATTRIBUTE)) == 6
        # whole outputs, the last step's tokens included (the loop hands the final tokens to release)
        generated = sorted(runs[0].sequences[:, inputs["input_ids"].shape[1] :].tolist())
        assert sorted(o.tolist() for o in getattr(model, MODEL_CACHE_ATTRIBUTE).outputs()[:3]) == generated
        assert second["num_accepted_tokens"] > first["num_accepted_tokens"]
        assert second["mean_acceptance_length"] > first["mean_acceptance_length"] + 0.5, (first, second)
        assert second["num_drafts"] < first["num_drafts"]
    else:
        assert not hasattr(model, MODEL_CACHE_ATTRIBUTE)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert second[key] == first[key], key


# --- 5. threads ---------------------------------------------------------------------------------


def run_threads(threads: list[threading.Thread], timeout: float = 120.0) -> None:
    """Start and join them; a thread still running after `timeout` (a trie corrupted by a race can
    loop forever in a kernel) fails the test instead of hanging it (daemon threads)."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a thread hangs: concurrent updates corrupted the trie"


def test_one_cache_shared_by_threads():
    """Threads generating on their own model copies (one model's generate() swaps its attention
    implementation for the call: not for concurrent calls) through one SuffixCache, while another
    thread adds outputs: every output is plain greedy's, the cache ends consistent."""
    cache = SuffixCache(max_tree_depth=10, max_cached_requests=7)
    reference_model = build_tiny_llama()
    jobs = [repeated_span_batch(2 + i % 2, seed=40 + i) for i in range(6)]
    expected = [
        plain_generate(reference_model, **inputs, max_new_tokens=24, do_sample=False) for inputs in jobs
    ]
    models = [hf_specdec.enable(build_tiny_llama()) for _ in range(3)]
    config = suffix_config(4, suffix_cache=cache, suffix_max_tree_depth=10, cpu_linear_backend="torch")
    results, errors = {}, []
    start = threading.Barrier(4)

    def generate(worker: int) -> None:
        try:
            start.wait()
            for job in range(worker, len(jobs), 3):
                results[job] = models[worker].generate(
                    **jobs[job],
                    max_new_tokens=24,
                    do_sample=False,
                    speculative_config=config,
                    return_dict_in_generate=True,
                )
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def add() -> None:  # for as long as the calls run: their rows' nodes are evicted under them
        rng, rounds = np.random.default_rng(0), 0
        start.wait()
        while rounds < 20 or any(thread.is_alive() for thread in threads):
            cache.add_outputs([rng.integers(3, 128, size=int(rng.integers(1, 60))) for _ in range(2)])
            rounds += 1

    threads = [threading.Thread(target=generate, args=(w,), daemon=True) for w in range(3)]
    run_threads([*threads, threading.Thread(target=add, daemon=True)])
    assert not errors, errors
    for job, out in sorted(results.items()):
        assert torch.equal(out.sequences, expected[job]), job
    assert len(results) == len(jobs)
    assert sum(out.spec_metrics["num_accepted_tokens"] for out in results.values()) > 0
    assert len(cache) == 7
    assert trie_contents(cache._trie) == ReferenceTrie(cache.outputs(), 10).contents()
    assert cache.num_nodes == rebuilt(cache.outputs(), 10).num_nodes


def test_reads_and_writes_wait_for_the_lock():
    """propose (which reads the global trie) and add_outputs block while another thread holds the lock."""
    cache = SuffixCache(max_tree_depth=4)
    cache.add_outputs([[1, 2, 3]])
    proposer = SuffixProposer(2, 4, 1.0, 0.0, cache)
    done = []
    calls = [
        lambda: done.append(propose(proposer, [[9, 1, 2]])),
        lambda: done.append(cache.add_outputs([[4, 5]])),
        lambda: done.append(cache.outputs()),
    ]
    for call in calls:
        with cache._lock:
            thread = threading.Thread(target=call, daemon=True)
            thread.start()
            thread.join(0.2)
            assert thread.is_alive() and not done
        thread.join(10)
        assert len(done) == 1
        done.clear()


def test_concurrent_add_outputs():
    """Four threads adding (and so evicting) long outputs at once: the kernels run without the GIL,
    only the cache's lock keeps them apart."""
    cache = SuffixCache(max_tree_depth=6, max_cached_requests=9)
    start = threading.Barrier(4)

    def add(seed: int) -> None:
        rng = np.random.default_rng(seed)
        start.wait()
        for _ in range(150):
            cache.add_outputs([rng.integers(0, 5, size=int(rng.integers(1, 400)))])

    run_threads([threading.Thread(target=add, args=(seed,), daemon=True) for seed in range(4)])
    assert len(cache) == 9
    assert trie_contents(cache._trie) == ReferenceTrie(cache.outputs(), 6).contents()
    assert cache.num_nodes == rebuilt(cache.outputs(), 6).num_nodes


# --- 6. sampling --------------------------------------------------------------------------------


def test_sampling_follows_the_target_distribution():
    """Suffix drafts (fixed tokens, from the rows' own context and earlier calls' outputs) under
    sampling: 4000 samples of 3 tokens pass the chi-square test against the exact distribution."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    config = suffix_config(3, suffix_max_spec_factor=2.0, suffix_min_token_prob=0.0)
    samples, metrics = speculative_samples(model, sampling, config, num_samples=4000, seed=1234)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    assert 0 < accepted < sum(m["num_draft_tokens"] for m in metrics)
    assert len(getattr(model, MODEL_CACHE_ATTRIBUTE)) > 0  # later calls also drafted from earlier ones
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) > 1e-3


# --- 7. bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("suffix_max_tree_depth", 0),
        ("suffix_max_tree_depth", 2.0),
        ("suffix_max_tree_depth", True),
        ("suffix_max_cached_requests", -1),
        ("suffix_max_cached_requests", None),
        ("suffix_max_spec_factor", 0),
        ("suffix_max_spec_factor", -1.0),
        ("suffix_max_spec_factor", float("inf")),
        ("suffix_max_spec_factor", float("nan")),
        ("suffix_max_spec_factor", "2"),
        ("suffix_min_token_prob", -0.1),
        ("suffix_min_token_prob", 1.5),
        ("suffix_min_token_prob", float("nan")),
        ("suffix_min_token_prob", False),
        ("suffix_first", 1),
        ("suffix_cache", "cache"),
        ("suffix_cache", {"max_tree_depth": 4}),
    ],
)
def test_invalid_suffix_option_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        SpeculativeConfig(method="suffix", **{field: value})


def test_invalid_combinations():
    cache = SuffixCache()
    with pytest.raises(ValueError, match="speculative_config.suffix_cache.*method='ngram'"):
        SpeculativeConfig(method="ngram", suffix_cache=cache)
    with pytest.raises(ValueError, match="speculative_config.suffix_cache"):
        SpeculativeConfig(method="draft_model", model="m", suffix_cache=cache)
    with pytest.raises(ValueError, match="speculative_config.suffix_first"):
        SpeculativeConfig(method="suffix", suffix_first=True)
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="suffix", model="m")
    # allowed: the cache with suffix_first in front of another method
    assert (
        SpeculativeConfig(method="draft_model", model="m", suffix_first=True, suffix_cache=cache).suffix_cache
        is cache
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tree_depth": 0}, "max_tree_depth"),
        ({"max_tree_depth": 1.5}, "max_tree_depth"),
        ({"max_tree_depth": True}, "max_tree_depth"),
        ({"max_cached_requests": -1}, "max_cached_requests"),
    ],
)
def test_invalid_cache(kwargs, field):
    with pytest.raises(ValueError, match=f"SuffixCache.{field}"):
        SuffixCache(**kwargs)


def test_invalid_outputs():
    cache = SuffixCache(max_tree_depth=4)
    for bad in ([[1.5, 2.0]], [[-1, 2]], [[[1, 2]]], [[2**31]]):
        with pytest.raises(ValueError, match="SuffixCache.add_outputs"):
            cache.add_outputs(bad)
    assert len(cache) == 0 and cache.num_nodes == 1
    cache.add_outputs([[], np.array([3, 4], dtype=np.int64), torch.tensor([5]).tolist()])
    assert [o.tolist() for o in cache.outputs()] == [[3, 4], [5]]
