"""Draft-model drafter (seed §12.4.1): a smaller causal LM sharing the target's tokenizer drafts
k tokens autoregressively, batched over rows.

The draft keeps its own `PagedKVCache`, driven exactly like the loop drives the target's. Per row
we remember which tokens the draft cache holds; each step the longest prefix of those that
matches the row's context (capped at the context length - 1, so at least one token is fed) is
kept and the rest rolled back. Rejected drafts are therefore dropped, accepted drafts already
cached are reused, and the row feeds only its new tokens (usually the bonus token, or the last
accepted draft and the bonus token when every draft passed).

With a `TreeSpec` the draft grows an EAGLE-2 tree per row instead (`tree_growth.py`): it feeds
the row's new tokens as above, its logits at the last one give the root's `topk` children, and each
depth feeds the frontier nodes of every row in one packed forward over the draft cache with a tree
mask (a node sees the context, its fed ancestors and itself; positions: the row's last context
position + depth), whose logits give the next depth's candidates. Children are ranked by the
log-softmax of the draft's logits, after the position-free warpers when the target samples (the
distribution chain drafts are sampled from). Tree drafts are deterministic candidates:
`draft_probs` stays None (one-hot q) in sampling mode too. The draft cache then holds the context
and the fed nodes; only the context is remembered as cached, so the next call's catch-up rolls the
nodes back before feeding.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel

from ..cache.architectures import check_architecture
from ..cache.forward import forward_tokens
from ..cache.own_attention import OwnAttentionCache, encoder_input_name
from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..config import TreeSpec
from ..models.auto_class import generation_model_class
from ..transfer import to_device
from .base import DraftProposal, ProposeRequest
from .drafting import (
    DraftSampling,
    DraftTokenPicker,
    autoregressive_drafts,
    drafter_pool_blocks,
    stack_draft_probs,
)
from .on_disk import load_cached
from .tree_growth import TreeGrowth, max_fed_nodes, ranked_children

_NO_DRAFTS = np.zeros(0, dtype=np.int64)

# drafts loaded from a path / Hub id, per target, so repeated generate() calls load them once;
# read again when the folder's files change (`on_disk.load_cached`)
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (draft, target) pairs already checked: the tokenizer comparison reads files
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_draft_model(spec: PreTrainedModel | str | os.PathLike, target: PreTrainedModel) -> PreTrainedModel:
    """The draft `speculative_config.model` names: a loaded model, a folder or a Hub id.

    A folder or Hub id is loaded once per target, in the target's dtype and on its device, and
    again when the folder's checkpoint files change (a draft retrained into the same folder); a
    Hub id comes from the local Hugging Face cache when it is there (no network needed), else the Hub.
    """
    if isinstance(spec, PreTrainedModel):
        return spec.eval()
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(
            f"speculative_config.model must be a folder, a Hub id or a loaded model for method='draft_model', "
            f"got {type(spec).__name__}"
        )
    key = os.fspath(spec)

    def load() -> PreTrainedModel:
        try:
            auto = generation_model_class(key, local_files_only=True)
            model = auto.from_pretrained(key, dtype=target.dtype, local_files_only=True)
        except OSError:
            model = generation_model_class(key).from_pretrained(key, dtype=target.dtype)
        return model.to(target.device).eval()

    return load_cached(_LOADED.setdefault(target, {}), key, spec, load)


def _special_ids(model: PreTrainedModel, name: str) -> frozenset[int] | None:
    """A special token id (or ids) from the model's config, else its generation config; None if unset."""
    value = getattr(model.config.get_text_config(), name, None)
    if value is None and getattr(model, "generation_config", None) is not None:
        value = getattr(model.generation_config, name, None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return frozenset(value) if isinstance(value, (list, tuple, set, frozenset)) else frozenset([int(value)])


def _vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits (what the rejection sampler compares), else config.vocab_size."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.get_text_config().vocab_size)


def _local_tokenizer(model: PreTrainedModel):
    """The model's tokenizer when its files are on this machine; None otherwise."""
    path = getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer files, or none readable: the config checks still apply
        return None


def check_draft_compatible(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    """Raise ValueError naming every difference that makes the draft's tokens mean something else.

    Compared: logits width (vocabulary size), bos / eos / pad ids where both models define them,
    and, when both tokenizers can be loaded from local files, their vocabularies and special tokens.
    """
    checked = _CHECKED.setdefault(draft, weakref.WeakSet())
    if target in checked:
        return
    check_architecture(draft, role="speculative_config.model: the draft")
    if draft.config.is_encoder_decoder != target.config.is_encoder_decoder:
        kinds = {True: "an encoder-decoder model", False: "a decoder-only model"}
        raise ValueError(
            f"speculative_config.model: the draft is {kinds[draft.config.is_encoder_decoder]} and the target "
            f"{kinds[target.config.is_encoder_decoder]}; an encoder-decoder target needs an encoder-decoder draft "
            "reading the same source (and a decoder-only target a decoder-only draft)"
        )
    problems = []
    draft_vocab, target_vocab = _vocab_size(draft), _vocab_size(target)
    if draft_vocab != target_vocab:
        problems.append(f"vocabulary size {draft_vocab} (target: {target_vocab})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        draft_ids, target_ids = _special_ids(draft, name), _special_ids(target, name)
        if draft_ids is not None and target_ids is not None and draft_ids != target_ids:
            problems.append(f"{name} {sorted(draft_ids)} (target: {sorted(target_ids)})")
    if not problems:
        draft_tokenizer, target_tokenizer = _local_tokenizer(draft), _local_tokenizer(target)
        if draft_tokenizer is not None and target_tokenizer is not None:
            draft_vocab_map, target_vocab_map = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
            if draft_vocab_map != target_vocab_map:
                differing = len(set(draft_vocab_map.items()) ^ set(target_vocab_map.items()))
                problems.append(f"tokenizer vocabulary ({differing} token/id pairs differ)")
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                a, b = getattr(draft_tokenizer, name, None), getattr(target_tokenizer, name, None)
                if a is not None and b is not None and str(a) != str(b):
                    problems.append(f"tokenizer {name} {str(a)!r} (target: {str(b)!r})")
    if problems:
        raise ValueError(
            "speculative_config.model does not share the target's tokenizer; the draft differs in: "
            + "; ".join(problems)
        )
    checked.add(target)


class DraftModelProposer:
    """Drafts with a separate small causal LM over its own paged KV cache.

    Args:
        draft_model: the drafter, already checked against the target (`check_draft_compatible`).
        num_speculative_tokens: k.
        sampling: greedy or sampled drafts (`DraftSampling.from_generate`).
        block_size: tokens per block of the draft's KV cache.
        num_blocks: size of the draft's block pool; None sizes it at the first step from the
            rows' prompt lengths and `max_length`.
        max_length: the longest a row may get (prompt + new tokens), for sizing the pool.
        output_device: where `draft_probs` go (the target's device).
        tree: draft a tree per row (`TreeSpec`, see the module docstring) instead of a chain.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        num_speculative_tokens: int,
        sampling: DraftSampling | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_length: int | None = None,
        output_device: torch.device | str | None = None,
        tree: TreeSpec | None = None,
    ):
        if num_blocks is None and max_length is None:
            raise ValueError("DraftModelProposer needs num_blocks or max_length to size its KV cache")
        self.model = draft_model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_length = max_length
        self.output_device = torch.device(output_device) if output_device is not None else draft_model.device
        self.tree = tree
        self.picker = DraftTokenPicker(sampling or DraftSampling(), draft_model.device)
        self.cache: PagedKVCache | None = None
        self.cached_tokens: dict[int, np.ndarray] = {}  # per row: the tokens the draft cache holds
        # an encoder-decoder draft: encoder outputs not yet handed to its cache, (rows, output, mask) (`encode_sources`)
        self.encoder_states: list[tuple[list[int], object, torch.Tensor | None]] = []

    def encode_sources(
        self, rows: Sequence[int], inputs: torch.Tensor, attention_mask: torch.Tensor | None,
        generation_config: GenerationConfig,
    ) -> None:  # fmt: skip
        """An encoder-decoder draft's own encoder over `rows`' sources (generate()'s encoder inputs, as
        transformers' assisted generation runs its assistant's; or an engine request's as it joins): each row's
        output is what its decoder reads from its next proposal on."""
        device = self.model.device
        mask = None if attention_mask is None else attention_mask.to(device)
        with torch.no_grad():
            prepared = self.model._maybe_prepare_encoder_kwargs_for_generation(
                inputs.to(device), {} if mask is None else {"attention_mask": mask}, encoder_input_name(self.model),
                generation_config,
            )  # fmt: skip
        self.encoder_states.append((list(rows), prepared["encoder_outputs"], mask))

    def _hand_over_sources(self, cache: PagedKVCache) -> None:
        for rows, outputs, mask in self.encoder_states:
            cache.set_encoder_states(rows, outputs, mask)
        self.encoder_states.clear()

    def _ensure_cache(self, token_ids: list[np.ndarray]) -> PagedKVCache:
        if self.cache is None:
            # past its context a row's cache holds its chain drafts but the last, or its fed tree nodes
            past_context = self.k if self.tree is None else max(self.k, max_fed_nodes(self.tree))
            num_blocks = self.num_blocks or drafter_pool_blocks(
                token_ids, self.max_length, past_context, self.block_size
            )
            cache = PagedKVCache.for_model(self.model, num_blocks=num_blocks, block_size=self.block_size)
            if self.tree is not None and cache.recurrent is not None:
                raise ValueError(
                    "speculative_config.tree is not supported with a draft model that has recurrent layers: "
                    "their state follows one path, a tree has many"
                )
            if self.tree is not None and isinstance(cache, OwnAttentionCache):
                raise ValueError(
                    "speculative_config.tree is not supported with a draft model that runs on its own attention "
                    "(it builds its own causal mask, which a tree's mask would replace)"
                )
            self.cache = cache
        if self.encoder_states:
            self._hand_over_sources(self.cache)
        return self.cache

    def _catch_up(self, row: int, context: np.ndarray) -> np.ndarray:
        """Roll the row's draft cache back to its longest prefix still in the context; return the rest."""
        cached = self.cached_tokens.get(row)
        kept = 0
        if cached is not None:
            limit = min(len(cached), len(context) - 1)
            mismatch = np.flatnonzero(cached[:limit] != context[:limit])
            kept = int(mismatch[0]) if mismatch.size else limit
            self.cache.rollback(row, kept)
        return context[kept:]

    def propose(self, request: ProposeRequest) -> DraftProposal:
        cache = self._ensure_cache(request.token_ids)
        max_draft = [min(int(m), self.k) for m in request.max_draft_tokens]
        feeds = [
            self._catch_up(row, np.asarray(tokens)) if m > 0 else np.empty(0, dtype=np.int64)
            for row, tokens, m in zip(request.rows, request.token_ids, max_draft)
        ]
        if self.tree is not None:
            return self._propose_tree(request, feeds, max_draft)
        with torch.no_grad(), use_paged_attention(self.model):
            drafts, probs = autoregressive_drafts(
                self.model,
                cache,
                request.rows,
                feeds,
                max_draft,
                self.picker,
                self.model.device,
            )
        for row, tokens, draft in zip(request.rows, request.token_ids, drafts):
            if len(draft):  # the cache now holds the context and every draft but the last
                self.cached_tokens[row] = np.concatenate([np.asarray(tokens, dtype=np.int64), draft[:-1]])
        return DraftProposal(draft_token_ids=drafts, draft_probs=stack_draft_probs(probs, self.output_device))

    @torch.no_grad()
    def _propose_tree(self, request: ProposeRequest, feeds: list[np.ndarray], max_draft: list[int]) -> DraftProposal:
        """Every drafting row's tree (module docstring); `feeds`: each row's tokens the cache lacks."""
        drafts = [_NO_DRAFTS] * len(request.rows)
        parents = [_NO_DRAFTS] * len(request.rows)
        active = [i for i, m in enumerate(max_draft) if m > 0]
        if not active:
            return DraftProposal(draft_token_ids=drafts, draft_parents=parents)
        cache, device, topk = self.cache, self.model.device, self.tree.topk
        rows = [int(request.rows[i]) for i in active]
        contexts = [np.array(request.token_ids[i], dtype=np.int64) for i in active]  # copies: the loop's buffer changes
        growth = TreeGrowth(
            self.tree.for_step(request.max_tree_nodes), np.array([max_draft[i] for i in active], dtype=np.int64)
        )
        base = np.array([len(context) - 1 for context in contexts], dtype=np.int64)  # a depth-d node goes at base + d
        counts = np.array([len(feeds[i]) for i in active], dtype=np.int64)
        positions = np.concatenate([np.arange(last + 1 - n, last + 1) for last, n in zip(base, counts)])
        tokens = np.concatenate([np.asarray(feeds[i], dtype=np.int64) for i in active])
        with use_paged_attention(self.model):
            # the rows' new tokens; the logits at each row's last context token give the root's children
            input_ids, position_ids = to_device([tokens, positions], device)
            logits = forward_tokens(self.model, cache, rows, counts.tolist(), input_ids, position_ids, np.cumsum(counts) - 1)
            growth.expand([(j, -1) for j in range(len(rows))], *ranked_children(self.picker.warp(logits), topk))
            for depth in range(1, growth.max_depth):
                frontier = growth.frontier(depth)
                if not frontier:
                    break
                frontier_rows, node_counts, tree_mask = growth.feed(frontier)
                input_ids, position_ids = to_device(
                    [
                        np.array([growth.nodes[j][c].token for j, c in frontier], dtype=np.int64),
                        np.array([base[j] + depth for j, _ in frontier], dtype=np.int64),
                    ],
                    device,
                )
                logits = forward_tokens(
                    self.model, cache, [rows[j] for j in frontier_rows], node_counts, input_ids, position_ids,
                    np.arange(len(frontier)), tree_mask=tree_mask,
                )
                growth.expand(frontier, *ranked_children(self.picker.warp(logits), topk))
        tree_tokens, tree_parents = growth.trees()
        for j, i in enumerate(active):
            drafts[i], parents[i] = tree_tokens[j], tree_parents[j]
            self.cached_tokens[rows[j]] = contexts[j]  # the fed nodes past it are rolled back next call
        return DraftProposal(draft_token_ids=drafts, draft_parents=parents)

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        for row in rows:
            self.cached_tokens.pop(row, None)
            if self.cache is not None:
                self.cache.free_row(row)
        self.picker.release(rows)
