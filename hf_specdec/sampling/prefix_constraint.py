"""`generate(prefix_allowed_tokens_fn=...)` under speculation.

Plain `generate()` wraps the function in transformers' `PrefixConstrainedLogitsProcessor`, which
calls `prefix_allowed_tokens_fn(batch_id, input_ids[row])` for every row at every step and keeps
only the tokens it returns. A speculative step scores several positions per row, each after the
drafts before it, so inside the loop the processor is replaced by `SpeculativePrefixConstraint`:

- every verified position gets the function's answer for its own prefix (the row's tokens, left
  padding included, and the drafts before it) and the row's batch index, masked as transformers
  masks it (`scores + mask`; a position whose allowed tokens are all `-inf` already gets them at 0);
- a position after a draft its own position does not allow is never reached (that draft has
  probability 0, so it is never accepted): the function is not called there, as plain `generate()`
  never calls it with such a prefix (a trie of allowed sequences has no answer for it);
- before the verify, a chain of deterministic drafts is cut at the first draft not allowed, and
  before a drafted position for which the function allows nothing (`allowed_drafts`), so such a
  position is only scored once it is a row's next token, where plain `generate()` raises too.
  Drafts sampled from a drafter's own distribution, and draft trees, are not cut (cutting them on
  their value would change the output distribution, see `grammar.py`): there a position the
  function allows nothing at raises as soon as it is verified.

With `num_return_sequences` > 1 transformers forces an unsatisfiable constraint's tokens only when
all of a prompt's sequences are unsatisfiable at the same step; speculation advances them
separately, so that is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

AllowedTokensFn = Callable[[int, torch.Tensor], list[int]]


class SpeculativePrefixConstraint:
    """The speculative stand-in for `PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, 1)`."""

    def __init__(self, prefix_allowed_tokens_fn: AllowedTokensFn):
        self.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn

    @classmethod
    def from_processor(cls, processor: PrefixConstrainedLogitsProcessor) -> SpeculativePrefixConstraint:
        if processor._num_beams != 1:
            raise ValueError(
                f"prefix_allowed_tokens_fn with num_return_sequences={processor._num_beams} (a "
                f"PrefixConstrainedLogitsProcessor built for {processor._num_beams} sequences per prompt) is not supported with "
                "speculative decoding: transformers forces an unsatisfiable constraint's tokens only when all of a "
                "prompt's sequences are unsatisfiable at once, and speculation advances them separately; allowed: "
                "num_return_sequences=1 (repeat the prompt in the batch instead)"
            )
        return cls(processor._prefix_allowed_tokens_fn)

    def allowed(self, batch_id: int, prefix: torch.Tensor) -> list[int]:
        tokens = self.prefix_allowed_tokens_fn(batch_id, prefix)
        if len(tokens) == 0:  # transformers' message
            raise ValueError(
                f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}.This means that the "
                "constraint is unsatisfiable. Please check your implementation of `prefix_allowed_tokens_fn` "
            )
        return tokens

    def process(
        self, scores: torch.Tensor, token_buffer: torch.Tensor, buffer_rows: np.ndarray, prefix_lens: np.ndarray,
        batch_rows: np.ndarray,
    ) -> torch.Tensor:  # fmt: skip
        """`scores` masked at each position i for `token_buffer[buffer_rows[i], :prefix_lens[i]]` and batch
        row `batch_rows[i]`; a row's shortest prefix is its tokens, the rest follow drafts (a chain's
        positions share the row's buffer row; a tree's nodes each have one holding the path to them)."""
        mask = torch.zeros_like(scores)
        committed = {int(row): int(prefix_lens[batch_rows == row].min()) for row in np.unique(batch_rows)}
        allowed_after: dict[tuple, set[int] | None] = {}  # (batch row, drafts) -> tokens allowed next; None: unreached
        for i in np.argsort(prefix_lens, kind="stable"):  # a position after its parent
            row, length = int(batch_rows[i]), int(prefix_lens[i])
            prefix = token_buffer[int(buffer_rows[i]), :length]
            drafts = tuple(prefix[committed[row] :].tolist())
            reached = not drafts or drafts[-1] in (allowed_after[(row, drafts[:-1])] or ())
            allowed = self.allowed(row, prefix.to(scores.device)) if reached else None
            allowed_after[(row, drafts)] = None if allowed is None else {int(t) for t in allowed}
            if allowed is not None:  # as transformers builds its mask; unreached positions stay as they are
                mask[i] = -torch.inf
                mask[i, allowed] = 0
        processed = scores + mask
        unsatisfiable = processed.amax(dim=-1, keepdim=True).isneginf()  # every allowed token already -inf
        return torch.where(unsatisfiable, mask, processed)

    def allowed_drafts(self, batch_id: int, prefix: torch.Tensor, drafts: np.ndarray) -> int:
        """How many of the row's leading drafts to verify: up to the first one not allowed after `prefix`
        (the row's tokens) and the drafts before it, and short of a drafted position allowing nothing."""
        for count in range(len(drafts) + 1):
            drafted = torch.from_numpy(drafts[:count]).to(prefix.device)
            allowed = self.prefix_allowed_tokens_fn(batch_id, torch.cat([prefix, drafted]))
            if len(allowed) == 0:
                return max(count - 1, 0)
            if count == len(drafts) or int(drafts[count]) not in {int(t) for t in allowed}:
                return count
        return len(drafts)


def with_speculative_prefix_constraints(logits_processor: LogitsProcessorList) -> LogitsProcessorList:
    """The processors with transformers' `PrefixConstrainedLogitsProcessor` replaced, in place in the order,
    by its `SpeculativePrefixConstraint` (the same list object back when there is none)."""
    if not any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor):
        return logits_processor
    return LogitsProcessorList(
        SpeculativePrefixConstraint.from_processor(p) if isinstance(p, PrefixConstrainedLogitsProcessor) else p
        for p in logits_processor
    )
