"""Layer-skip self-speculation: the target drafts with its own first N layers, then its final
norm and lm_head (transformers' `assistant_early_exit` idea), batched over rows. No trained
drafter is needed; how often the early exit agrees with the full model sets the gain.

KV cache sharing. The draft's layers 0..N-1 *are* the target's layers 0..N-1, so the draft
reads and writes the target's own cache for those layers instead of keeping a copy:

- positions below a row's cached length L hold the K/V the target's verify forward wrote for
  tokens that were accepted: exactly what the draft's first N layers would compute for them
  (same weights, same tokens, same positions), so the draft attends to them as they are;
- the draft writes its own K/V for positions L.. (the pending token(s), then every draft but
  the last) into the row's slots beyond L, after reserving them with `prepare_forward`, and
  the proposer rolls the row back to L before returning, so the loop finds the cache as it
  left it;
- the verify forward then feeds the pending token(s) and all drafts at positions L..L+drafts,
  which covers every slot the draft wrote, and `PagedLayer.update` writes each layer's new
  K/V before attention reads the pool: the target never reads a value the draft wrote. The
  draft never touches layers N.. at all.

So the output depends on the target alone (greedy identity holds), and the draft costs no KV
memory: its extra slots are ones the verify of the same step would reserve anyway.

Hybrid models: the early layers' recurrent / convolution states advance as the draft feeds them, and
the same rollback crops them back (`recurrent.py`: each row's states record their past, up to the
k tokens a verify may reject). So a row drafts only while what it would feed (its pending token,
then every draft but the last) fits in that record: not at its first step, where the whole prompt is
pending; it catches up there and drafts from the next step on.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..models.feature_capture import decoder_parts, first_layers_only
from .base import DraftProposal, ProposeRequest
from .drafting import (
    DraftSampling,
    DraftTokenPicker,
    autoregressive_drafts,
    stack_draft_probs,
)


def check_early_exit_layer(model: PreTrainedModel, early_exit_layer: int | None) -> int:
    """The validated N: an int from 1 to the model's num_hidden_layers - 1."""
    num_layers = model.config.get_text_config().num_hidden_layers
    if len(decoder_parts(model)[0]) != num_layers:  # LongCat: two sublayers per entry of its layer list
        raise ValueError(
            f"speculative_config.method='layer_skip' needs one decoder layer per num_hidden_layers; "
            f"{type(model).__name__} lists {len(decoder_parts(model)[0])} for num_hidden_layers={num_layers}"
        )
    loops = getattr(model.config.get_text_config(), "n_recurrent_loops", None)
    if loops and loops > 1:  # Dory: its middle layers run again and again, its last ones counted from the end
        raise ValueError(
            f"speculative_config.method='layer_skip' needs one decoder layer per num_hidden_layers, each run once; "
            f"{type(model).__name__} runs some of its layers in {loops} loops (n_recurrent_loops)"
        )
    if isinstance(early_exit_layer, bool) or not isinstance(early_exit_layer, int):
        raise ValueError(
            f"speculative_config.early_exit_layer={early_exit_layer!r} is invalid for method='layer_skip'; "
            f"allowed: an integer from 1 to {num_layers - 1} (the model has {num_layers} layers)"
        )
    if not 1 <= early_exit_layer <= num_layers - 1:
        raise ValueError(
            f"speculative_config.early_exit_layer={early_exit_layer} is out of range; "
            f"allowed: 1 to {num_layers - 1} (the model has {num_layers} layers)"
        )
    return early_exit_layer


class LayerSkipProposer:
    """Drafts with the target's first `early_exit_layer` layers, on `target_cache`: the loop's own
    KV cache, which the draft shares for layers 0..N-1 (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        target_cache: PagedKVCache,
        early_exit_layer: int,
        num_speculative_tokens: int,
        sampling: DraftSampling | None = None,
    ):
        self.model = model
        self.cache = target_cache
        self.early_exit_layer = check_early_exit_layer(model, early_exit_layer)
        self.k = num_speculative_tokens
        self.picker = DraftTokenPicker(sampling or DraftSampling(), model.device)

    def propose(self, request: ProposeRequest) -> DraftProposal:
        max_draft = [min(int(m), self.k) for m in request.max_draft_tokens]
        # the target cache holds each row's first L tokens (all accepted); the draft feeds the rest
        held = {row: self.cache.seq_lens.get(row, 0) for row in request.rows}
        feeds = [np.asarray(tokens)[held[row] :] for row, tokens in zip(request.rows, request.token_ids)]
        most = self.cache.rollback_reach
        if most is not None:  # what a row feeds must fit in the rollback its states record
            max_draft = [m if len(feed) + m - 1 <= most else 0 for m, feed in zip(max_draft, feeds)]
        try:
            with (
                torch.no_grad(),
                use_paged_attention(self.model),
                first_layers_only(self.model, self.early_exit_layer),
            ):
                drafts, probs = autoregressive_drafts(
                    self.model,
                    self.cache,
                    request.rows,
                    feeds,
                    max_draft,
                    self.picker,
                    self.model.device,
                    request.position_offsets,
                )
        finally:
            # give the loop its cache back as it was: the draft's slots beyond L are the verify's to write
            for row, length in held.items():
                if row in self.cache.block_tables:
                    self.cache.rollback(row, length)
        return DraftProposal(draft_token_ids=drafts, draft_probs=stack_draft_probs(probs, self.model.device))

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        self.picker.release(rows)  # the loop frees the rows' blocks in its (shared) cache
