"""MTP drafter (seed §12.4.3): models trained with multi-token prediction layers (DeepSeek-V3's
`num_mtp_layers`) draft with those layers, through transformers' own `MtpModel` (its
`forward_layer` runs one MTP layer: enorm / hnorm / eh_proj / the decoder block / post norm;
embedding and head are the target's).

An MTP layer at position p reads the target's final hidden state at p - 1 and the embedding of
token p, and predicts token p + 1 (transformers feeds it `position_ids` p). So for a row whose
context has n tokens it holds entries for positions 1..n-1 (entry p at cache index p - 1), fed
from the target hidden states of positions 0..n-2: exactly the positions that became accepted
context at each verify, which the loop captures (`target_feature_layers` = the final norm's
output, `ProposeRequest.target_features`). Its output at position n-1 gives the first draft.

k may exceed the number of MTP layers (DeepSeek-V3 has one): the last layer is reused
recursively, as vLLM does: draft j + 1 comes from that layer at position n - 1 + j, fed draft j
and the layer's own output at the position before, in place of the target's hidden state (the
output after the layer's post norm, which is what `MtpModel.forward` passes from one layer to
the next). These speculative entries are rolled back after drafting; the real ones (positions up
to n - 1) stay. The MTP layers' KV is paged like the target's (a `PagedKVCache`, holding
its MLA latents for DeepSeek), with its own block pool.

Batched over rows like the other drafters: one varlen forward for every row's new entries, then
one token per row per recursive step. No drafts at a row's first step: the target has not run yet.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from transformers.modeling_layers import MtpModel

from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..profiling import timed_forward
from ..transfer import to_device
from .base import DraftProposal, ProposeRequest
from .drafting import (
    DraftSampling,
    DraftTokenPicker,
    collect_drafts,
    drafter_pool_blocks,
    rows_to_feed,
    stack_draft_probs,
)
from .on_disk import load_cached

# MTP modules read from a target's checkpoint, per target, so repeated generate() calls load them once;
# read again when the checkpoint's files change (`on_disk.load_cached`)
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def num_mtp_layers_of(target: PreTrainedModel) -> int:
    """The MTP layers the target's config declares; ValueError when it declares none."""
    config = target.config.get_text_config()
    count = getattr(config, "num_mtp_layers", None)
    if not count:
        raise ValueError(
            f"speculative_config.method='mtp' needs a model whose config declares MTP layers (num_mtp_layers >= 1, "
            f"e.g. DeepSeek-V3); this {getattr(config, 'model_type', type(target).__name__)!r} model has "
            f"num_mtp_layers={count!r}: pass its assistant model (Gemma 4's) as speculative_config.model if it has "
            "one, or use method='draft_model', 'layer_skip' or 'ngram'."
        )
    return int(count)


def load_mtp_model(spec: MtpModel | None, target: PreTrainedModel) -> MtpModel:
    """transformers' `MtpModel` for the target: `spec` when it is one, else read from the target's
    checkpoint (`target.config.name_or_path`): once per target, and again when that checkpoint's
    files change (MTP layers retrained into the same folder)."""
    from transformers.modeling_layers import MtpModel

    num_layers = num_mtp_layers_of(target)
    if spec is None:

        def load() -> MtpModel:
            try:
                return MtpModel.from_pretrained(target, device_map={"": target.device}).eval()
            except Exception as error:
                raise ValueError(
                    f"speculative_config.method='mtp': could not load the MTP layers from the target's checkpoint "
                    f"({target.config.name_or_path!r}): {error}. Pass a loaded `MtpModel` as speculative_config.model."
                ) from error

        return load_cached(_LOADED, target, target.config.name_or_path or None, load)
    if not isinstance(spec, MtpModel):
        raise ValueError(
            "speculative_config.model for method='mtp' must be None (read the MTP layers from the target's "
            "checkpoint), a transformers MtpModel built for the target, or an assistant model (Gemma 4's: a "
            f"loaded model, its folder or a Hub id in the local cache), got {spec if isinstance(spec, str) else type(spec).__name__!r}"
        )
    if (
        len(spec.layers) != num_layers
        or spec.config.hidden_size != target.config.get_text_config().hidden_size
    ):
        raise ValueError(
            f"speculative_config.model: this MtpModel ({len(spec.layers)} layers, hidden size "
            f"{spec.config.hidden_size}) was not built for the target (num_mtp_layers={num_layers})"
        )
    return spec.eval()


class MtpProposer:
    """Drafts with the target's own MTP layers, on their own paged KV cache.

    Args:
        target: the target model (its final hidden states feed the first MTP layer).
        mtp_model: transformers' `MtpModel` for the target (`load_mtp_model`).
        num_speculative_tokens: k; beyond the number of MTP layers the last one is reused.
        sampling: greedy or sampled drafts (`DraftSampling.from_generate`).
        block_size / num_blocks / max_length: the MTP cache's pool, as `DraftModelProposer`.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        mtp_model,
        num_speculative_tokens: int,
        sampling: DraftSampling | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_length: int | None = None,
    ):
        if num_blocks is None and max_length is None:
            raise ValueError("MtpProposer needs num_blocks or max_length to size its KV cache")
        num_layers = len(mtp_model.layers)
        if num_layers != 1:
            # with several MTP layers, layer d's real entries at position p need layer d-1's output
            # at p - 1, which this drafter does not keep across steps yet
            raise NotImplementedError(
                f"speculative_config.method='mtp' supports models with one MTP layer (DeepSeek-V3); "
                f"this one has num_mtp_layers={num_layers}"
            )
        self.mtp = mtp_model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_length = max_length
        self.device = target.device
        # hidden_states index L: the target's final norm output, the lm_head input
        self.target_feature_layers = (target.config.get_text_config().num_hidden_layers,)
        self.picker = DraftTokenPicker(sampling or DraftSampling(), self.device)
        self.cache: PagedKVCache | None = None

    def _ensure_cache(self, token_ids: list[np.ndarray]) -> PagedKVCache:
        if self.cache is None:
            num_blocks = self.num_blocks or drafter_pool_blocks(
                token_ids, self.max_length, self.k, self.block_size
            )
            self.cache = PagedKVCache.for_model(self.mtp, num_blocks=num_blocks, block_size=self.block_size)
        return self.cache

    def _layer_forward(
        self,
        rows: list[int],
        tokens: np.ndarray | torch.Tensor,
        hidden: torch.Tensor,
        positions: np.ndarray,
        lengths: list[int],
    ) -> torch.Tensor:
        """One packed forward of the last MTP layer for `rows` (`tokens`: host ids, or drafts still on
        the device); returns its output `[tokens, hidden]`."""
        metadata = self.cache.prepare_forward(rows, lengths)
        if isinstance(tokens, np.ndarray):
            tokens, position_ids = to_device([tokens, positions], self.device)
        else:
            (position_ids,) = to_device([positions], self.device)
        with timed_forward(self.device):
            return self.mtp.forward_layer(
                len(self.mtp.layers) - 1,
                hidden[None],
                position_ids[None],
                self.cache,
                input_ids=tokens[None],
                paged_metadata=metadata,
            )[0]

    def propose(self, request: ProposeRequest) -> DraftProposal:
        if request.target_features is None:
            raise RuntimeError(
                "MtpProposer needs the target's hidden states (ProposeRequest.target_features)"
            )
        cache = self._ensure_cache(request.token_ids)
        rows, contexts = (
            [int(r) for r in request.rows],
            [np.asarray(t, dtype=np.int64) for t in request.token_ids],
        )
        max_draft = [min(int(m), self.k) for m in request.max_draft_tokens]
        fed = rows_to_feed(request)  # rows drafting, and rows whose waiting states reached the cap
        for i in fed:
            waiting, held = request.target_features.count(rows[i]), cache.seq_lens.get(rows[i], 0)
            if waiting != len(contexts[i]) - 1 - held:  # held: entries for positions 1..held
                raise RuntimeError(
                    f"MTP drafter out of step for row {rows[i]}: {waiting} new target hidden states for "
                    f"{len(contexts[i]) - 1 - held} new positions"
                )

        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        if fed:
            hidden = [request.target_features.take(rows[i]) for i in fed]
            with torch.no_grad(), use_paged_attention(self.mtp):
                self._draft(rows, contexts, fed, hidden, max_draft, drafts, probs)
        draft_arrays = [np.array(d, dtype=np.int64) for d in drafts]
        per_row_probs = [torch.stack(p) if p else None for p in probs]
        return DraftProposal(
            draft_token_ids=draft_arrays, draft_probs=stack_draft_probs(per_row_probs, self.device)
        )

    def _draft(
        self,
        rows: list[int],
        contexts: list[np.ndarray],
        fed: list[int],
        hidden: list[torch.Tensor],
        max_draft: list[int],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Feed the rows at indices `fed` their target hidden states `hidden` (one `[m, H]` each),
        then fill `drafts` / `probs` for those of them that may draft; the MTP cache keeps only
        real entries."""
        cache = self.cache
        # 1. the real entries: positions held+1..n-1, token p with the target's hidden state at p - 1
        fed_rows = [rows[i] for i in fed]
        starts = [cache.seq_lens.get(row, 0) + 1 for row in fed_rows]
        ends = [len(contexts[i]) for i in fed]  # exclusive: position n - 1 is the last real one
        tokens = np.concatenate([contexts[i][s:e] for i, s, e in zip(fed, starts, ends)])
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
        lengths = [e - s for s, e in zip(starts, ends)]
        real_lengths = {row: end - 1 for row, end in zip(fed_rows, ends)}
        try:
            output = self._layer_forward(fed_rows, tokens, torch.cat(hidden).to(self.device), positions, lengths)
            drafting = [j for j, i in enumerate(fed) if max_draft[i] > 0]
            (last,) = to_device([np.cumsum(lengths)[drafting] - 1], self.device)
            previous = output.index_select(0, last)  # each drafting row's output at position n - 1
            active = [fed[j] for j in drafting]
            step_positions = np.array(ends, dtype=np.int64)[drafting] - 1
            # which rows draft again follows from max_draft alone: the drafts stay on the device
            # and come back in one transfer at the end, not one sync per draft step
            steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
            while active:
                with timed_forward(self.device):
                    logits = self.mtp._project_to_logits(previous)
                picked, q = self.picker.pick(logits, [rows[i] for i in active])
                steps.append((active, picked, q))
                keep = [j for j, i in enumerate(active) if len(steps) < max_draft[i]]
                # 2. recursion: the draft at the next position, with the layer's own previous output
                active = [active[j] for j in keep]
                if not active:
                    break
                step_positions = step_positions[keep] + 1
                (keep_index,) = to_device([np.array(keep, dtype=np.int64)], self.device)
                previous = self._layer_forward(
                    [rows[i] for i in active],
                    picked.index_select(0, keep_index),
                    previous.index_select(0, keep_index),
                    step_positions,
                    [1] * len(active),
                )
            collect_drafts(steps, drafts, probs)
        finally:
            for row, length in real_lengths.items():  # drop the speculative entries
                cache.rollback(row, length)

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        for row in rows:
            if self.cache is not None:
                self.cache.free_row(int(row))
        self.picker.release(rows)
