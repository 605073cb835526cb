"""EAGLE / EAGLE-3 drafter (seed §12.4.2): k greedy steps of a feature-level head.

Per row the head keeps its own paged KV cache, one entry per context position i, holding the
pair (target feature of position i, token i + 1). Each call:

1. the loop's queue (`ProposeRequest.target_features`) holds the features of the positions
   accepted since the head last fed the row (the pending token(s) and the accepted drafts). A
   row that may not draft this call (k = 0: auto k, a batch-size limit, an n-gram match in front,
   the end of its budget) leaves them there: it catches up in one forward when it drafts again,
   rather than paying a head forward every step (`rows_to_feed`: up to `MAX_PENDING_POSITIONS`).
   With m waiting features, feature j belongs to position len-1-m+j and is paired with token
   len-m+j. The row's head cache is rolled back to len-1-m first, which drops the speculative
   entries of the previous call's rejected drafts;
2. step 1 runs every fed row's m new pairs in one packed forward; the last position's output
   gives draft 1;
3. steps 2..k run one pair per row (the head's own output as the feature, the previous draft as
   the token), every row in one forward; k == 1 returns after step 1.

Drafts are argmax, so they are deterministic: `draft_probs=None` (one-hot q) keeps the
rejection sampler exact in sampling mode (seed §12.2.3), as in vLLM.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..config import SpeculativeConfig, TreeSpec
from ..heads.eagle_heads import EagleHead, load_eagle_head
from ..models.feature_capture import decoder_parts
from ..profiling import timed_forward
from ..transfer import to_device
from .base import DraftProposal, ProposeRequest
from .drafting import drafter_pool_blocks, rows_to_feed
from .on_disk import load_cached
from .tree_growth import TreeGrowth, ranked_children

_NO_DRAFTS = np.zeros(0, dtype=np.int64)
# heads loaded from a folder / Hub id, per target, so repeated generate() calls load them once;
# read again when the folder's files change (`on_disk.load_cached`)
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tree_parents(drafts: list[np.ndarray], active: list[int], parents: list[np.ndarray]) -> list[np.ndarray]:
    """Every request row's parents: the drafted rows' trees, empty for the others."""
    out = [np.zeros(0, dtype=np.int64) for _ in drafts]
    for j, i in enumerate(active):
        out[i] = parents[j]
    return out


class EagleProposer:
    """Drafts with an `EagleHead` bound to the target; `target_feature_layers` tells the loop what to capture."""

    def __init__(
        self,
        head: EagleHead,
        target_model: torch.nn.Module,
        num_speculative_tokens: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_length: int | None = None,
        tree: TreeSpec | None = None,
    ):
        """`head` must be bound to `target_model` (`EagleHead.bind_target`). `tree`: draft a tree per
        row (`_draft_tree`) instead of a chain. The head's KV pool has
        `num_blocks` blocks, or is sized at the first call from the rows and `max_length` (the
        longest a row may get); without either it starts small. It doubles whenever it runs out.
        """
        self.head = head.eval()
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_length = max_length
        self.tree = tree
        decoder_layers, _ = decoder_parts(target_model)
        self.target_feature_layers: tuple[int, ...] = head.feature_layers_for(len(decoder_layers))
        self.cache: PagedKVCache | None = None

    @classmethod
    def from_config(
        cls, config: SpeculativeConfig, target_model: torch.nn.Module, max_length: int | None = None
    ) -> EagleProposer:
        """`config.model` is a loaded `EagleHead` (moved to the target's device / dtype and bound
        to it), a folder or a Hub id (loaded once per target, source and method, and again when
        the folder's files change)."""
        source = config.model
        if isinstance(source, EagleHead):
            if source.method != config.method:
                raise ValueError(
                    f"speculative_config.method={config.method!r} but the given head is an {source.method!r} head"
                )
            head = source.to(device=target_model.device, dtype=target_model.dtype).bind_target(target_model)
        elif isinstance(source, (str, os.PathLike)):
            head = load_cached(
                _LOADED.setdefault(target_model, {}),
                (config.method, os.fspath(source)),
                source,
                lambda: load_eagle_head(source, target=target_model, method=config.method),
            )
        else:
            raise ValueError(
                f"speculative_config.model must be a folder, a Hub id or an EagleHead for method={config.method!r}, "
                f"got {type(source).__name__}"
            )
        return cls(
            head,
            target_model,
            config.max_draft_tokens,
            block_size=config.block_size,
            num_blocks=config.num_kv_blocks,
            max_length=max_length,
            tree=config.tree,
        )

    # --- the Proposer protocol -------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, request: ProposeRequest) -> DraftProposal:
        drafts = [_NO_DRAFTS] * len(request.rows)
        active = rows_to_feed(request)
        if not active:
            return DraftProposal(draft_token_ids=drafts, draft_parents=None if self.tree is None else list(drafts))
        head = self.head
        device = head.fc.weight.device
        rows = [int(request.rows[i]) for i in active]
        features = [request.target_features.take(row) for row in rows]
        lengths = [len(request.token_ids[i]) for i in active]
        counts = [int(f.shape[0]) for f in features]
        wanted = np.minimum(np.array([request.max_draft_tokens[i] for i in active], dtype=np.int64), self.k)
        self._ensure_cache([request.token_ids[i] for i in active])

        # 1. forget speculative entries, then the m new (feature, token) pairs of every fed row at once
        for row, length, count in zip(rows, lengths, counts):
            if count > length - 1:
                raise RuntimeError(f"EAGLE drafter: row {row} got {count} features for a context of {length} tokens")
            self._rollback(row, length - 1 - count)
        tokens = np.concatenate([request.token_ids[i][n - m : n] for i, n, m in zip(active, lengths, counts)])
        positions = np.concatenate([np.arange(n - 1 - m, n - 1) for n, m in zip(lengths, counts)])
        token_ids, position_ids = to_device([tokens.astype(np.int64), positions], device)
        hidden = self._forward(
            rows,
            counts,
            token_ids,
            torch.cat(features).to(device=device, dtype=head.fc.weight.dtype),
            position_ids,
            fuse_features=True,
        )
        drafting = np.flatnonzero(wanted >= 1)
        if self.tree is not None:
            root_hidden = hidden[to_device([np.cumsum(counts) - 1], device)[0]]
            tokens, parents = self._draft_tree(rows, root_hidden, wanted, self.tree.for_step(request.max_tree_nodes))
            for j, i in enumerate(active):
                drafts[i] = tokens[j]
            return DraftProposal(draft_token_ids=drafts, draft_parents=_tree_parents(drafts, active, parents))
        # drafts stay on the device until every step ran: one transfer, not one sync per step
        out = torch.zeros((len(active), self.k), dtype=torch.long, device=device)
        if len(drafting):
            last = np.cumsum(counts)[drafting] - 1  # each drafting row's last pair
            last_index, drafting_index = to_device([last, drafting], device)
            hidden = hidden[last_index]
            draft = self._greedy(hidden)
            out[drafting_index, 0] = draft

        # 2..k: one (own output as feature, previous draft) pair per row still drafting
        for step in range(1, int(wanted.max(initial=0))):
            still = np.flatnonzero(wanted > step)
            still_rows = [rows[j] for j in still]
            keep, positions, still_index = to_device(
                [
                    np.flatnonzero(np.isin(drafting, still)),
                    np.array([self.cache.seq_lens[r] for r in still_rows], dtype=np.int64),
                    still,
                ],
                device,
            )
            hidden, draft, drafting = hidden[keep], draft[keep], still
            hidden = self._forward(still_rows, [1] * len(still), draft, hidden, positions, fuse_features=False)
            draft = self._greedy(hidden)
            out[still_index, step] = draft

        out = out.cpu().numpy()
        for j, i in enumerate(active):
            drafts[i] = out[j, : wanted[j]].copy()
        return DraftProposal(draft_token_ids=drafts)

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        for row in rows:
            if self.cache is not None:
                self.cache.free_row(int(row))

    # --- internals -------------------------------------------------------------------------------
    def _forward(self, rows, counts, input_ids, features, positions, fuse_features: bool, tree_mask=None) -> torch.Tensor:
        """One packed head forward over `counts[i]` new pairs of each row; returns `[tokens, H]`."""
        self._grow_if_needed(rows, counts)
        metadata = self.cache.prepare_forward(rows, list(counts), tree_mask=tree_mask)
        with use_paged_attention(self.head), timed_forward(input_ids.device):
            hidden = self.head(
                input_ids[None],
                features[None],
                positions[None],
                fuse_features=fuse_features,
                cache=self.cache,
                paged_metadata=metadata,
            )
        return hidden[0]

    def _draft_tree(
        self, rows: list[int], root_hidden: torch.Tensor, wanted: np.ndarray, tree: TreeSpec
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per row, a draft tree (tokens, parents) grown from the head's output at its last context pair.

        EAGLE-2 (`tree_growth.py`): each depth feeds the frontier nodes of every row in one head
        forward, each node paired with its parent's head output as the feature (the root's: the
        output at the last context pair), and their outputs give the next depth's candidates. Row j
        goes at most `wanted[j]` deep. A node is fed at the position its chain draft of that depth
        would take.
        """
        growth, device = TreeGrowth(tree, wanted), root_hidden.device
        base = np.array([self.cache.seq_lens[r] for r in rows], dtype=np.int64) - 1  # a depth-d node goes at base + d
        hidden_of: dict[tuple[int, int], torch.Tensor] = {}  # (row, candidate) -> the head's output for it

        def expand(parents: list[tuple[int, int]], hidden: torch.Tensor) -> None:
            """The children of each (row, candidate or -1), from the head's output `hidden` for it."""
            with timed_forward(device):
                logits = self.head.compute_logits(hidden)
            tokens, scores = ranked_children(logits, self.tree.topk, self.head.draft_to_target)
            growth.expand(parents, tokens, scores)

        drafting = growth.drafting
        for j in drafting:
            hidden_of[(j, -1)] = root_hidden[j]
        expand([(j, -1) for j in drafting], root_hidden[to_device([np.array(drafting, dtype=np.int64)], device)[0]])
        for depth in range(1, growth.max_depth):
            frontier = growth.frontier(depth)
            if not frontier:
                break
            nodes = growth.nodes
            token_ids, position_ids = to_device(
                [np.array([nodes[j][c].token for j, c in frontier]), np.array([base[j] + depth for j, _ in frontier])], device
            )
            features = torch.stack([hidden_of[(j, nodes[j][c].parent)] for j, c in frontier])
            frontier_rows, counts, tree_mask = growth.feed(frontier)
            hidden = self._forward(
                [rows[j] for j in frontier_rows], counts, token_ids, features, position_ids,
                fuse_features=False, tree_mask=tree_mask,
            )
            for index, (j, c) in enumerate(frontier):
                hidden_of[(j, c)] = hidden[index]
            expand(frontier, hidden)
        return growth.trees()

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        with timed_forward(hidden.device):
            logits = self.head.compute_logits(hidden)
        return self.head.draft_to_target(logits.argmax(dim=-1))

    def _rollback(self, row: int, num_tokens: int) -> None:
        held = self.cache.seq_lens.get(row)
        if held is None:
            if num_tokens != 0:
                raise RuntimeError(
                    f"EAGLE drafter: row {row} arrives with features from position {num_tokens} on, but the head "
                    "never saw the positions before (the loop must pass every accepted position's features)"
                )
            return
        if held < num_tokens:
            raise RuntimeError(f"EAGLE drafter: row {row} holds {held} head positions, needs {num_tokens}")
        self.cache.rollback(row, num_tokens)

    def _ensure_cache(self, token_ids: list[np.ndarray]) -> None:
        if self.cache is not None:
            return
        num_blocks = self.num_blocks
        if num_blocks is None:
            if self.max_length is not None:
                # a row's head cache holds one pair per context position and its drafts: what a
                # draft model's cache holds at most
                num_blocks = drafter_pool_blocks(token_ids, self.max_length, self.k, self.block_size)
            else:
                num_blocks = 2 * sum(-(-(len(t) + 2 * self.k) // self.block_size) for t in token_ids)
        config = self.head.config
        self.cache = PagedKVCache(
            num_layers=len(self.head.layers),
            num_kv_heads=config.num_key_value_heads,
            head_dim=self.head.layers[0].self_attn.head_dim,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=self.head.fc.weight.dtype,
            device=self.head.fc.weight.device,
        )

    def _grow_if_needed(self, rows: list[int], counts: list[int]) -> None:
        """A pool too small for this forward is replaced by one twice as large, rows copied over.

        The drafter does not know the request's length up front (the loop sizes the target's pool),
        so its pool grows instead; doubling keeps the copies amortised O(1) per token.
        """
        cache = self.cache
        needed = sum(
            max(0, cache.blocks_for(cache.seq_lens.get(r, 0) + n) - len(cache.block_tables.get(r, [])))
            for r, n in zip(rows, counts)
        )
        free = cache.allocator.num_free
        if needed <= free:
            return
        total = cache.allocator.num_blocks
        bigger = PagedKVCache(
            num_layers=len(cache.layers),
            num_kv_heads=cache.layers[0].keys.shape[-2],
            head_dim=cache.layers[0].keys.shape[-1],
            num_blocks=max(2 * total, total - free + needed),
            block_size=cache.block_size,
            dtype=cache.layers[0].keys.dtype,
            device=cache.device,
        )
        for row, table in cache.block_tables.items():
            new_table = bigger.allocator.allocate(len(table))
            old_ids = torch.tensor(table, device=cache.device)
            new_ids = torch.tensor(new_table, device=cache.device)
            for old_layer, new_layer in zip(cache.layers, bigger.layers):
                new_layer.keys[new_ids] = old_layer.keys[old_ids]
                new_layer.values[new_ids] = old_layer.values[old_ids]
            bigger.block_tables[row] = new_table
            bigger.seq_lens[row] = cache.seq_lens[row]
        self.cache = bigger
