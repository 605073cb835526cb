"""SuffixDecoding: drafts from suffix tries over each row's tokens and over earlier outputs.

`method: "suffix"` (and the suffix stage of `suffix_first`), after SuffixDecoding (Oliaro et al.,
arXiv 2411.04975) as vLLM / Snowflake's Arctic Inference run it; the code here is our own.

**The structure.** A suffix trie truncated at depth D (`suffix_max_tree_depth`): every substring
of at most D tokens of a sequence is a path from the root, and each node counts the windows that
pass through it (`count`: how often that substring occurs) and the sum of its children's counts
(`total`: how often it occurs *followed by something*). Each node also keeps its most frequent
child (`best`; ties go to the child counted most recently), so following the most frequent
continuation costs one read per token. Nodes live in one int32 array (token, count, total, first
child, next sibling, best child), children in sibling lists (the most recently counted first), the
root's children in a dense array indexed by token id.

Two kinds of trie:

- **per row**, over the row's prompt and output, built when the row first asks for drafts and then
  extended as its tokens arrive: the loop hands every row's whole token list each step, and only
  the tail beyond what the trie has seen is new. Appending a token extends the D suffixes that end
  at the previous token (the node of each suffix length is kept: `active`), so a step costs O(D)
  per new token, never a rebuild;
- **global** (`SuffixCache`), over the outputs of earlier requests: a row's output is added when
  the row finishes (`release`), and evicted first-in first-out past `max_cached_requests` (the
  window paths are walked again and decremented; nodes that reach 0 are freed and reused). For
  each row the nodes of its context's suffixes in the global trie are followed incrementally too
  (re-found from the last D tokens whenever the cache changed since the row's last step).

**The draft.** For every suffix length m of the row's context that occurred before *with a
continuation*, the draft follows the most frequent child from that suffix's node, as long as the
product of the children's empirical probabilities (count / parent's total) stays at or above
`suffix_min_token_prob`, for at most min(k, floor(`suffix_max_spec_factor` x m), D - m) tokens. The
draft with the highest score (the sum of those probabilities: the expected number of accepted
tokens if the frequencies were the truth) wins, the longer match on a tie; the per-row trie's
best and the global trie's best are compared the same way (the row's own wins a tie). This is the
paper's path speculation (and Arctic Inference's default); unlike Arctic, the probabilities divide
by `total` rather than `count`, so the occurrence that is the row's own context (never followed by
anything yet) does not dilute them. Drafts are fixed tokens (a one-hot q): exactness is the
loop's rejection sampler's, as for `ngram`.

**Why numba and not `arctic-inference`.** Arctic Inference's suffix tree is C++ built from an
sdist whose build requires torch >= 2.10 (a second torch in the build) and which is tied to vLLM;
the work here is a few hundred integer updates per step, which numba compiles to the same kind of
loop (as `ngram.py` does), with no build step and no second torch.

**Ownership and threads.** The global cache is, by default, the target model's own: an attribute
`hf_specdec_suffix_cache` set on the model the first time a call uses it, kept across `generate()`
calls and resized to each call's `suffix_max_tree_depth` / `suffix_max_cached_requests`. A
`SuffixCache` passed as `suffix_cache` is used instead, with its own depth and size, and may be
shared by several models, calls and threads: every read and write of a cache holds its lock (numba
releases the GIL inside the kernels, so the lock is what keeps concurrent updates apart). The
per-row tries belong to one generate call and are never shared.

Memory: a trie has at most D nodes per token it holds, 24 bytes each (less where text repeats):
10,000 outputs of 256 tokens at D = 24 is at most ~1.5 GB; lower `suffix_max_cached_requests`
(or pass a smaller `SuffixCache`) on a small machine.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

import numba
import numpy as np

from .base import DraftProposal, ProposeRequest

# the fields of a node (columns of the int32 node array)
TOKEN, COUNT, TOTAL, FIRST, SIBLING, BEST = range(6)
NUM_FIELDS = 6
# meta (int64): rows of the node array ever used, head of the free list, live nodes
USED, FREE, LIVE = range(3)
MODEL_CACHE_ATTRIBUTE = "hf_specdec_suffix_cache"


# --- trie kernels --------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _child(nodes, root, node, token):
    """The child of `node` for `token`, or -1."""
    if node == 0:
        return root[token] if token < root.shape[0] else -1
    child = nodes[node, FIRST]
    while child >= 0:
        if nodes[child, TOKEN] == token:
            return child
        child = nodes[child, SIBLING]
    return -1


@numba.njit(nogil=True, cache=True)
def _bump(nodes, root, meta, node, token):
    """Count one more window through `node`'s child for `token` (created if missing); returns it.

    The child moves to the front of its siblings: they stay in the order of their last count, which
    is what `_rescan_best` breaks ties by (so a trie that lost its oldest windows picks the same
    best children as one built from the rest)."""
    if node == 0:
        child = _child(nodes, root, node, token)
    else:
        previous, child = -1, nodes[node, FIRST]
        while child >= 0 and nodes[child, TOKEN] != token:
            previous, child = child, nodes[child, SIBLING]
        if child >= 0 and previous >= 0:  # move to front
            nodes[previous, SIBLING] = nodes[child, SIBLING]
            nodes[child, SIBLING] = nodes[node, FIRST]
            nodes[node, FIRST] = child
    if child < 0:
        child = meta[FREE]
        if child >= 0:
            meta[FREE] = nodes[child, SIBLING]
        else:
            child = meta[USED]
            meta[USED] += 1
        meta[LIVE] += 1
        nodes[child, TOKEN] = token
        nodes[child, COUNT] = 0
        nodes[child, TOTAL] = 0
        nodes[child, FIRST] = -1
        nodes[child, BEST] = -1
        if node == 0:
            root[token] = child
            nodes[child, SIBLING] = -1
        else:
            nodes[child, SIBLING] = nodes[node, FIRST]
            nodes[node, FIRST] = child
    nodes[child, COUNT] += 1
    nodes[node, TOTAL] += 1
    best = nodes[node, BEST]
    if best < 0 or nodes[child, COUNT] >= nodes[best, COUNT]:
        nodes[node, BEST] = child
    return child


@numba.njit(nogil=True, cache=True)
def _extend(nodes, root, meta, active, num_active, tokens, depth):
    """Append `tokens` to the sequence whose suffix nodes are `active[:num_active]` (active[d - 1]:
    the node of its last d tokens). Returns the new number of active nodes."""
    for token in tokens:
        top = min(num_active, depth - 1)
        for d in range(top, 0, -1):  # longest first: active[d - 1] is read before it is replaced
            active[d] = _bump(nodes, root, meta, active[d - 1], token)
        active[0] = _bump(nodes, root, meta, 0, token)
        num_active = top + 1
    return num_active


@numba.njit(nogil=True, cache=True)
def _follow(nodes, root, active, num_active, tokens, depth):
    """`_extend` without writing: the nodes of the context's suffixes in a trie that does not hold
    the context (-1 past the longest suffix found). Returns how many lead (all >= 0)."""
    for token in tokens:
        top = min(num_active, depth - 1)
        found = 0
        for d in range(top, 0, -1):
            child = _child(nodes, root, active[d - 1], token)
            active[d] = child
            if child >= 0 and found == 0:
                found = d + 1
        first = _child(nodes, root, 0, token)
        active[0] = first
        num_active = 0 if first < 0 else max(found, 1)
    return num_active


@numba.njit(nogil=True, cache=True)
def _rescan_best(nodes, node):
    """The most frequent child, ties to the one counted most recently: the first of the most
    frequent in the sibling list (most recently counted first, see `_bump`)."""
    best = -1
    child = nodes[node, FIRST]
    while child >= 0:
        if best < 0 or nodes[child, COUNT] > nodes[best, COUNT]:
            best = child
        child = nodes[child, SIBLING]
    nodes[node, BEST] = best


@numba.njit(nogil=True, cache=True)
def _remove(nodes, root, meta, sequence, depth):
    """Take the windows of `sequence` (as `_extend` added them) out of the trie; nodes whose count
    reaches 0 go to the free list."""
    length = sequence.shape[0]
    for start in range(length):
        node = 0
        for position in range(start, min(start + depth, length)):
            token = sequence[position]
            previous = -1  # the sibling before `child` (to unlink it without a second walk)
            if node == 0:
                child = root[token]
            else:
                child = nodes[node, FIRST]
                while nodes[child, TOKEN] != token:
                    previous, child = child, nodes[child, SIBLING]
            nodes[child, COUNT] -= 1
            nodes[node, TOTAL] -= 1
            if nodes[child, COUNT] > 0:
                if node != 0 and nodes[node, BEST] == child:
                    _rescan_best(nodes, node)
                node = child
                continue
            # only this window passed through `child`: it and the rest of the path are a chain
            if node == 0:
                root[token] = -1
            else:
                if previous < 0:
                    nodes[node, FIRST] = nodes[child, SIBLING]
                else:
                    nodes[previous, SIBLING] = nodes[child, SIBLING]
                if nodes[node, BEST] == child:
                    _rescan_best(nodes, node)
            while child >= 0:
                below = nodes[child, FIRST]
                nodes[child, SIBLING] = meta[FREE]
                meta[FREE] = child
                meta[LIVE] -= 1
                child = below
            break


@numba.njit(nogil=True, cache=True)
def _best_path(nodes, active, num_active, depth, k, factor, min_prob, out, scratch):
    """The highest-scoring draft over every matched suffix length (see the module docstring),
    written to `out`; returns (its length, its score)."""
    best_count, best_score = 0, 0.0
    for m in range(1, num_active + 1):
        node = active[m - 1]
        if node < 0 or nodes[node, TOTAL] == 0:
            break  # a longer suffix cannot have occurred with a continuation either
        cap = min(k, int(m * factor + 1e-6), depth - m)
        count, score, prob = 0, 0.0, 1.0
        while count < cap:
            child = nodes[node, BEST]
            if child < 0:
                break
            prob = prob * nodes[child, COUNT] / nodes[node, TOTAL]
            if prob < min_prob:
                break
            scratch[count] = nodes[child, TOKEN]
            count += 1
            score += prob
            node = child
        if count > 0 and score >= best_score:
            out[:count] = scratch[:count]
            best_count, best_score = count, score
    return best_count, best_score


@numba.njit(nogil=True, cache=True)
def _draft(
    row_nodes, row_active, row_num_active, row_depth,
    global_nodes, global_active, global_num_active, global_depth,
    k, factor, min_prob, out, other, scratch,
):  # fmt: skip
    """The row trie's best draft against the global trie's (the row's wins a tie); returns its length."""
    count, score = _best_path(
        row_nodes, row_active, row_num_active, row_depth, k, factor, min_prob, out, scratch
    )
    if global_num_active > 0:
        other_count, other_score = _best_path(
            global_nodes, global_active, global_num_active, global_depth, k, factor, min_prob, other, scratch
        )
        if other_score > score:
            out[:other_count] = other[:other_count]
            count = other_count
    return count


# --- tries and the global cache -----------------------------------------------------------------


class _Trie:
    """The arrays of one trie; grown (doubled) by `reserve` before a kernel may add nodes."""

    def __init__(self, capacity: int = 1024, vocab: int = 1024):
        self.nodes = np.full((max(capacity, 2), NUM_FIELDS), -1, dtype=np.int32)
        self.nodes[0, COUNT] = self.nodes[0, TOTAL] = 0  # node 0: the root
        self.root = np.full(max(vocab, 1), -1, dtype=np.int32)
        self.meta = np.array([1, -1, 1], dtype=np.int64)

    def reserve(self, new_nodes: int, max_token: int) -> None:
        need = int(self.meta[USED]) + new_nodes
        if need > self.nodes.shape[0]:
            grown = np.full((max(need, 2 * self.nodes.shape[0]), NUM_FIELDS), -1, dtype=np.int32)
            grown[: self.nodes.shape[0]] = self.nodes
            self.nodes = grown
        if max_token >= self.root.shape[0]:
            grown = np.full(max(max_token + 1, 2 * self.root.shape[0]), -1, dtype=np.int32)
            grown[: self.root.shape[0]] = self.root
            self.root = grown

    def extend(self, active: np.ndarray, num_active: int, tokens: np.ndarray, depth: int) -> int:
        if len(tokens) == 0:
            return num_active
        self.reserve(len(tokens) * depth, int(tokens.max()))
        return _extend(self.nodes, self.root, self.meta, active, num_active, tokens, depth)

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return int(self.meta[LIVE])


def _as_tokens(sequence, where: str) -> np.ndarray:
    tokens = np.asarray(sequence)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(
            f"{where}: each output must be a 1-D sequence of token ids, got {tokens.dtype} {tokens.shape}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{where}: token ids must be in 0..2**31-1")
    return tokens.astype(np.int32)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"SuffixCache.{name}={value!r} is invalid; allowed: an integer >= {minimum}")
    return int(value)


class SuffixCache:
    """The global suffix trie: outputs of earlier requests, most recent `max_cached_requests` kept.

    By default each model keeps its own (`speculative_config` method "suffix" or `suffix_first`);
    pass one as `speculative_config["suffix_cache"]` to share it between models and calls, or to
    warm it from a dataset with `add_outputs`. Thread-safe: every method holds the cache's lock.

    Args:
        max_tree_depth: the longest substring held (and so the longest suffix matched plus its
            draft); a call drafts from min(this, its `suffix_max_tree_depth`).
        max_cached_requests: how many outputs are kept; adding more evicts the oldest (FIFO).
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000):
        self._max_tree_depth = _check_int("max_tree_depth", max_tree_depth, 1)
        self._max_cached_requests = _check_int("max_cached_requests", max_cached_requests, 0)
        self._lock = threading.RLock()
        self._trie = _Trie()
        self._outputs: deque[np.ndarray] = deque()
        self.version = 0  # changes with every update: rows re-find their nodes then

    @property
    def max_tree_depth(self) -> int:
        return self._max_tree_depth

    @property
    def max_cached_requests(self) -> int:
        return self._max_cached_requests

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_nodes(self) -> int:
        """Live trie nodes (24 bytes each), the root included."""
        return self._trie.num_nodes

    def outputs(self) -> list[np.ndarray]:
        """The cached outputs, oldest first (copies)."""
        with self._lock:
            return [tokens.copy() for tokens in self._outputs]

    def add_outputs(self, outputs: Iterable[Sequence[int] | np.ndarray]) -> None:
        """Add each output (a sequence of token ids: one request's generated tokens) as one cached
        request, evicting the oldest past `max_cached_requests`. Empty outputs are skipped."""
        sequences = [_as_tokens(tokens, "SuffixCache.add_outputs") for tokens in outputs]
        with self._lock:
            if self._max_cached_requests == 0:
                return
            scratch = np.zeros(self._max_tree_depth, dtype=np.int32)
            for tokens in sequences:
                if len(tokens) == 0:
                    continue
                self._trie.extend(scratch, 0, tokens, self._max_tree_depth)
                self._outputs.append(tokens)
                self.version += 1
            self._evict()

    def reconfigure(self, max_tree_depth: int | None = None, max_cached_requests: int | None = None) -> None:
        """A new depth (the trie is rebuilt from the cached outputs) and / or size (the oldest
        outputs past it are evicted)."""
        if max_tree_depth is not None:  # both checked before either changes anything
            max_tree_depth = _check_int("max_tree_depth", max_tree_depth, 1)
        if max_cached_requests is not None:
            max_cached_requests = _check_int("max_cached_requests", max_cached_requests, 0)
        with self._lock:
            if max_cached_requests is not None:
                self._max_cached_requests = max_cached_requests
                self._evict()
            if max_tree_depth is not None and max_tree_depth != self._max_tree_depth:
                self._max_tree_depth = max_tree_depth
                outputs, self._outputs, self._trie = list(self._outputs), deque(), _Trie()
                self.add_outputs(outputs)
                self.version += 1

    def clear(self) -> None:
        with self._lock:
            self._outputs.clear()
            self._trie = _Trie()
            self.version += 1

    def _evict(self) -> None:
        while len(self._outputs) > self._max_cached_requests:
            _remove(
                self._trie.nodes,
                self._trie.root,
                self._trie.meta,
                self._outputs.popleft(),
                self._max_tree_depth,
            )
            self.version += 1


_MODEL_CACHE_LOCK = threading.Lock()


def model_suffix_cache(model, max_tree_depth: int, max_cached_requests: int) -> SuffixCache:
    """The model's own cache (created on first use, an attribute of the model), resized to these settings."""
    with _MODEL_CACHE_LOCK:
        cache = getattr(model, MODEL_CACHE_ATTRIBUTE, None)
        if not isinstance(cache, SuffixCache):
            cache = SuffixCache(max_tree_depth, max_cached_requests)
            setattr(model, MODEL_CACHE_ATTRIBUTE, cache)
    cache.reconfigure(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
    return cache


# --- the drafter ---------------------------------------------------------------------------------


class _Row:
    """One row's trie, its tokens so far, and its suffixes' nodes in the global trie."""

    def __init__(self, tokens: np.ndarray, depth: int):
        self.trie = _Trie(
            capacity=(len(tokens) + 64) * depth + 1, vocab=int(tokens.max()) + 1 if len(tokens) else 1
        )
        self.active = np.zeros(depth, dtype=np.int32)
        self.num_active = self.trie.extend(self.active, 0, tokens, depth)
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.global_active = np.zeros(0, dtype=np.int32)
        self.global_num_active = 0
        self.global_key = None  # (cache, version, depth) the global nodes were found for

    def append(self, new: np.ndarray, depth: int) -> None:
        self.num_active = self.trie.extend(self.active, self.num_active, new, depth)
        self.tokens = np.concatenate([self.tokens, new])

    def follow_global(self, cache: SuffixCache, new: np.ndarray, depth: int) -> None:
        """Bring the global nodes up to date (under the cache's lock)."""
        trie, key = cache._trie, (cache, cache.version, depth)
        if key != self.global_key:  # the cache changed: re-find from the last `depth` tokens
            self.global_active = np.full(depth, -1, dtype=np.int32)
            self.global_num_active = 0
            new = self.tokens[-depth:]
        if len(new):
            self.global_num_active = _follow(
                trie.nodes, trie.root, self.global_active, self.global_num_active, new, depth
            )
        self.global_key = key


class SuffixProposer:
    """SuffixDecoding drafts for every row of a step: see the module docstring.

    Args:
        num_speculative_tokens: the most drafts per row (the loop's request may ask fewer).
        max_tree_depth / max_spec_factor / min_token_prob: `suffix_max_tree_depth`,
            `suffix_max_spec_factor`, `suffix_min_token_prob`.
        cache: the global cache of earlier outputs; None: none (the rows' own tries only).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        cache: SuffixCache | None = None,
    ):
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.factor = float(max_spec_factor)
        self.min_prob = float(min_token_prob)
        self.cache = cache
        self._rows: dict[int, _Row] = {}
        self._empty = _Trie(capacity=2, vocab=1)  # stands in for the global trie when there is none
        _compile()

    @classmethod
    def from_config(cls, config, target_model=None) -> SuffixProposer:
        """The drafter a `SpeculativeConfig` describes; its cache: `config.suffix_cache`, else the
        model's own (none with `suffix_max_cached_requests=0`)."""
        cache = config.suffix_cache
        if cache is None and config.suffix_max_cached_requests > 0 and target_model is not None:
            cache = model_suffix_cache(
                target_model, config.suffix_max_tree_depth, config.suffix_max_cached_requests
            )
        return cls(
            config.max_draft_tokens,
            config.suffix_max_tree_depth,
            config.suffix_max_spec_factor,
            config.suffix_min_token_prob,
            cache,
        )

    def propose(self, request: ProposeRequest) -> DraftProposal:
        out = np.zeros((len(request.rows), self.k), dtype=np.int32)
        other, scratch = np.zeros(self.k, dtype=np.int32), np.zeros(self.k, dtype=np.int32)
        counts = [0] * len(request.rows)
        news = [self._update(row, tokens) for row, tokens in zip(request.rows, request.token_ids)]
        cache = self.cache
        with cache._lock if cache is not None else _NO_LOCK:
            global_depth = min(self.depth, cache.max_tree_depth) if cache is not None else 1
            global_trie = cache._trie if cache is not None and len(cache) else self._empty
            for i, (row, new, max_draft) in enumerate(zip(request.rows, news, request.max_draft_tokens)):
                state = self._rows[row]
                if global_trie is not self._empty:
                    state.follow_global(cache, new, global_depth)
                    global_active, global_num_active = state.global_active, state.global_num_active
                else:
                    state.global_key = None
                    global_active, global_num_active = self._empty.root, 0
                k = min(int(max_draft), self.k)
                if k <= 0:
                    continue
                counts[i] = _draft(
                    state.trie.nodes, state.active, state.num_active, self.depth,
                    global_trie.nodes, global_active, global_num_active, global_depth,
                    k, self.factor, self.min_prob, out[i], other, scratch,
                )  # fmt: skip
        return DraftProposal(draft_token_ids=[out[i, :n].astype(np.int64) for i, n in enumerate(counts)])

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        """Finished rows: their outputs go to the cache: `token_ids` (each row's final tokens, as the
        loop passes them) after the prompt, else what this drafter saw of them (all but the last step's)."""
        finals = token_ids if token_ids is not None else [None] * len(rows)
        outputs = []
        for row, final in zip(rows, finals):
            state = self._rows.pop(row, None)
            if state is not None:
                outputs.append((state.tokens if final is None else np.asarray(final))[state.prompt_len :])
        if self.cache is not None:
            self.cache.add_outputs(outputs)

    def _update(self, row: int, tokens: np.ndarray) -> np.ndarray:
        """Bring the row's trie up to `tokens`; returns the tokens that were new to it."""
        tokens = np.asarray(tokens).astype(np.int32)
        state = self._rows.get(row)
        seen = 0 if state is None else len(state.tokens)
        if state is None or len(tokens) < seen or (seen and tokens[seen - 1] != state.tokens[seen - 1]):
            # a new row (or, defensively, one whose history changed): its tokens so far are its prompt
            self._rows[row] = _Row(tokens, self.depth)
            return tokens
        new = tokens[seen:]
        state.append(new, self.depth)
        return new


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()
_COMPILED = False


def _compile() -> None:
    """Compile the kernels now (once per process), not on the user's first step."""
    global _COMPILED
    if _COMPILED:
        return
    cache = SuffixCache(max_tree_depth=4, max_cached_requests=1)
    cache.add_outputs([[1, 2, 3, 1, 2]])
    cache.add_outputs([[1, 2, 4]])  # evicts the first: _remove
    proposer = SuffixProposer.__new__(SuffixProposer)
    proposer.k, proposer.depth, proposer.factor, proposer.min_prob, proposer.cache = 2, 4, 1.0, 0.1, cache
    proposer._rows, proposer._empty = {}, _Trie(capacity=2, vocab=1)
    context = np.array([1, 2, 4, 1, 2], dtype=np.int64)
    proposer.propose(ProposeRequest(rows=[0], token_ids=[context], max_draft_tokens=[2]))
    proposer.propose(ProposeRequest(rows=[0], token_ids=[np.append(context, 4)], max_draft_tokens=[2]))
    _COMPILED = True
