"""Grammar-constrained requests (JSON schema, regex, EBNF) under speculation, through xgrammar.

Users constrain plain `generate()` with xgrammar's transformers processor,
`xgrammar.contrib.hf.LogitsProcessor(compiled_grammar)`, in `logits_processor=[...]`, and pass the
very same list here. That processor keeps one `GrammarMatcher` per row and feeds it the last token
at every call, which assumes one call per generated token over the whole batch. A speculative step
scores several positions per row in one call (each with its own prefix: the row's tokens and the
drafts before it), and most drafts may be rejected. So inside the loop the processor is replaced by
`SpeculativeGrammar`, built from its compiled grammars, which:

- at a verify, walks each row's drafts through the row's matcher, masking every position with the
  tokens the grammar allows after the drafts before it (`fill_next_token_bitmask`), then rolls the
  matcher back over the drafts (`GrammarMatcher.rollback`): a draft the grammar forbids gets
  probability 0 at its position, so it is never accepted, and the positions after it are never
  reached;
- after the rejection sampler, feeds the matcher only the tokens the row really emitted;
- masks a draft tree's nodes each for the path to it (each node's prefix has a buffer row of its
  own: `loop/tree_verify.tree_prefixes`); a forbidden node has probability 0, so neither it nor
  anything below it is accepted;
- before the verify, cuts each row's chain of drafts at the first one its grammar forbids
  (`logits_processing.cut_forbidden_drafts`; trees are not cut), so no target compute goes to positions that cannot be reached. That is
  exact where the forbidden draft is not a sample of the drafter's own distribution (deterministic
  drafts, greedy rows): its position then yields a token drawn from the masked p either way. For
  drafts sampled from q it is not (a rejection there draws from the residual of p and q, not from
  p), so those are left whole and rejected by the masked verify.

So each position is masked exactly as plain constrained generate() masks it for the same prefix:
greedy output is identical and sampled output follows the constrained distribution. Other grammar
processors (outlines, llguidance) keep state we cannot roll back and are refused
(`logits_processing.check_supported_processors`).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessorList


def is_xgrammar_processor(processor: object) -> bool:
    """Whether `processor` is xgrammar's transformers LogitsProcessor (without importing xgrammar)."""
    return type(processor).__module__ == "xgrammar.contrib.hf" and type(processor).__name__ == "LogitsProcessor"


class SpeculativeGrammar:
    """The speculative stand-in for xgrammar's transformers processor: a matcher per batch row.

    `grammars`: one xgrammar `CompiledGrammar` per row. `prompt_width`: the columns of the
    (left-padded) prompt in the loop's token buffer; the matcher of a row holds the `consumed[row]`
    tokens after them that the row has emitted. The engine builds one per request
    (`SpeculativeEngine.add_request(..., grammar=)`), a batch of one row.
    """

    def __init__(self, grammars: list, prompt_width: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = grammars[0].tokenizer_info.vocab_size
        self.matchers = [xgr.GrammarMatcher(grammar) for grammar in grammars]
        self.prompt_width = prompt_width
        self.consumed = np.zeros(len(grammars), dtype=np.int64)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    @classmethod
    def from_processor(cls, processor: object, batch_size: int, prompt_width: int) -> SpeculativeGrammar:
        """The stand-in for xgrammar's processor `processor` in a generate() call of `batch_size` rows."""
        if processor.matchers:
            raise ValueError(
                "this xgrammar LogitsProcessor was already used by an earlier generate() call; xgrammar's "
                "processor is single-use: build a new one for each call"
            )
        grammars = processor.compiled_grammars
        if len(grammars) == 1:
            grammars = grammars * batch_size
        if len(grammars) != batch_size:
            raise ValueError(
                f"the xgrammar LogitsProcessor holds {len(grammars)} grammars for a batch of {batch_size} rows; "
                "allowed: one grammar, or one per row"
            )
        return cls(grammars, prompt_width)

    def process(
        self, scores: torch.Tensor, token_buffer: torch.Tensor, buffer_rows: np.ndarray, prefix_lens: np.ndarray,
        batch_rows: np.ndarray,
    ) -> torch.Tensor:  # fmt: skip
        """`scores` masked per position i: batch row `batch_rows[i]`'s matcher, walked over the drafts in
        `token_buffer[buffer_rows[i], :prefix_lens[i]]` (a chain's positions share a buffer row and are
        walked in one pass; a tree's nodes each have one, holding the path to the node)."""
        out = scores.clone()
        masks = torch.zeros((len(buffer_rows), self._bitmask.shape[1]), dtype=self._bitmask.dtype)
        masked = np.zeros(len(buffer_rows), dtype=bool)
        for buffer_row in np.unique(buffer_rows):
            positions = np.flatnonzero(buffer_rows == buffer_row)
            positions = positions[np.argsort(prefix_lens[positions], kind="stable")]
            row = int(batch_rows[positions[0]])
            matcher, start = self.matchers[row], self.prompt_width + int(self.consumed[row])
            fed, alive, last = 0, True, None
            for position in positions:
                wanted = int(prefix_lens[position]) - start  # drafts before this position
                while alive and fed < wanted:
                    token = int(token_buffer[buffer_row, start + fed])
                    alive = not matcher.is_terminated() and matcher.accept_token(token)
                    fed += int(alive)
                if alive and not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(self._bitmask, 0)
                    last = self._bitmask[0].clone()
                # past a forbidden draft the positions are never reached: they keep the last mask
                if last is not None:
                    masks[position], masked[position] = last, True
            if fed:
                matcher.rollback(fed)
        if masked.any():
            index = torch.from_numpy(np.flatnonzero(masked))
            rows = out[index].cpu()
            self._xgr.apply_token_bitmask_inplace(rows, masks[index])  # as xgrammar's processor applies it
            out[index.to(out.device)] = rows.to(out.device)
        return out

    def allowed_drafts(self, row: int, prefix: torch.Tensor, drafts: np.ndarray) -> int:
        """How many of the row's leading drafts its grammar allows (the matcher, which holds the row's
        tokens, is left as it was; `prefix`, those tokens, is not read)."""
        matcher, fed = self.matchers[row], 0
        for token in drafts.tolist():
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            fed += 1
        if fed:
            matcher.rollback(fed)
        return fed

    def accept_emitted(self, row: int, tokens: torch.Tensor) -> None:
        """The row emitted `tokens` (each allowed by the mask it was drawn under): feed them."""
        matcher = self.matchers[row]
        for token in tokens.tolist():
            if not matcher.is_terminated() and not matcher.accept_token(int(token)):
                raise RuntimeError(f"row {row} emitted token {token}, which its grammar does not allow here")
        self.consumed[row] += len(tokens)


def with_speculative_grammars(
    logits_processor: LogitsProcessorList, batch_size: int, prompt_width: int
) -> LogitsProcessorList:
    """The processors with every xgrammar processor replaced, in place in the order, by its
    `SpeculativeGrammar` (the same list object back when there is none)."""
    if not any(is_xgrammar_processor(p) for p in logits_processor):
        return logits_processor
    return LogitsProcessorList(
        SpeculativeGrammar.from_processor(p, batch_size, prompt_width) if is_xgrammar_processor(p) else p
        for p in logits_processor
    )


def row_grammars(logits_processor: LogitsProcessorList, row: int) -> list[tuple[SpeculativeGrammar, int]]:
    """The grammars constraining batch row `row`, each with the row's index in it: the batch's
    (generate()), or its request's own (the engine's per-row processors: a batch of one)."""
    from .logits_processing import RowLogitsProcessors  # here: that module imports this one

    found = []
    for processor in logits_processor:
        if isinstance(processor, SpeculativeGrammar):
            found.append((processor, row))
        elif isinstance(processor, RowLogitsProcessors):
            found.extend((g, 0) for g in processor.by_row.get(row, ()) if isinstance(g, SpeculativeGrammar))
    return found
