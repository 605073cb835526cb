"""The tokens still in play after a request's filters: each logits row narrowed to its 64-column blocks
that hold a finite score.

After top-k (transformers' default 50, Qwen's 20) a row of 50k-260k scores holds a few dozen finite
ones; passes over the whole row then cost most of a sampled step's sampler time at large
vocabularies (docs/measurements.md, "Sampled steps over the tokens in play"). Two uses:

- `finite_entries`: the finite scores' (row, column) pairs, found through the blocks' maxima (top-p's
  narrow row, `top_p.py`), not by comparing and compacting every column;
- `tokens_in_play` / `TokensInPlay`: the rejection sampler's softmax and exponential race run over
  each sampled row's blocks in play (`rejection_reference.py`). Such a row keeps each column's place
  modulo 64, and torch's CPU softmax then gives its columns the whole row's probabilities bit for bit:
  the max is exact and exp elementwise; the sum adds the row lane by lane in vector registers (at
  most 16 floats wide, so lanes are columns modulo 16 or a divisor of 64), the dropped blocks add
  exp(-inf) = 0 to each lane, which changes no partial sum, and the kept blocks add in their order.
  `narrow_rows_agree` checks this once per process (and top-p's sorted variant of it); where a torch
  adds otherwise, every row takes the whole-row path.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from .metadata import SpecDecodeMetadata

LANE_COLUMNS = 64  # a multiple of every CPU vector width softmax's sum may use (16 floats at most)
# below this many noise draws a step (sampled rows x vocabulary) the whole rows cost no more than the narrow
# layout's own indexing (SmolLM2's 49k vocabulary, one row: 0.9-1.0 ms whole, 1.0-1.2 narrow; 2 cores)
MIN_WHOLE_ROW_DRAWS = 100_000


def finite_block_maxima(scores: torch.Tensor) -> torch.Tensor | None:
    """`[rows, vocab / 64]` the largest score in each 64-column block of each row, or None where the
    blocks do not apply (not a contiguous CPU float32 matrix, a vocabulary that is no multiple of 64, a
    NaN or +inf score, a row without a finite score)."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.ndim != 2 or not len(scores):
        return None
    rows, vocab = scores.shape
    if vocab % LANE_COLUMNS or not scores.is_contiguous():
        return None
    block_maxima = scores.view(rows, vocab // LANE_COLUMNS, LANE_COLUMNS).amax(dim=-1)
    if not torch.isfinite(block_maxima.amax(dim=1)).all():  # NaN (amax keeps it), +inf, a row of -inf
        return None
    return block_maxima


def finite_entries(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scores > -inf).nonzero(as_tuple=True)`: the finite scores' rows and columns, row by row in column
    order; through the 64-column blocks holding one where they apply (72 x 262k: 32 -> 4 ms, 2 cores)."""
    block_maxima = finite_block_maxima(scores)
    if block_maxima is None:
        return (scores > -math.inf).nonzero(as_tuple=True)
    block_rows, blocks = (block_maxima > -math.inf).nonzero(as_tuple=True)
    held = scores.view(len(scores), -1, LANE_COLUMNS)[block_rows, blocks]  # [blocks held, 64]
    within, offsets = (held > -math.inf).nonzero(as_tuple=True)
    return block_rows[within], blocks[within] * LANE_COLUMNS + offsets


@dataclass
class TokensInPlay:
    """Each row's narrow layout: the 64-column blocks in play at any of its verified positions, ascending,
    then padding to the widest row's count (greedy rows: padding only)."""

    columns: torch.Tensor  # [rows, width] int64: the vocabulary column of each narrow column (padding: 0)
    padding: torch.Tensor  # [rows, width] bool
    block_slots: torch.Tensor  # [rows, vocab / 64] int64: a block's place among the row's blocks, -1 if not in play
    row_of_position: torch.Tensor  # [logits rows] int64: the batch row of each verified position

    @property
    def num_columns(self) -> torch.Tensor:
        """`[rows]` narrow columns in play per row (the rest of a row is padding)."""
        return (~self.padding).sum(dim=1)

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """`[logits rows, width]`: each position's scores at its row's columns, -inf at the padding."""
        columns = self.columns[self.row_of_position]
        return logits.gather(1, columns).masked_fill_(self.padding[self.row_of_position], -math.inf)

    def narrow_columns(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Where each token sits in its row's narrow layout, -1 where its block is not in play."""
        slots = self.block_slots[rows, tokens // LANE_COLUMNS]
        return torch.where(slots >= 0, slots * LANE_COLUMNS + tokens % LANE_COLUMNS, -1)


def tokens_in_play(logits: torch.Tensor, metadata: SpecDecodeMetadata, sampled: torch.Tensor) -> TokensInPlay | None:
    """The sampled rows' blocks in play over their verified positions (`logits` laid out as `metadata` says),
    or None where the narrow layout does not apply or would not pay (few draws, or a row with more than half
    the vocabulary's blocks in play: no top-k, for one)."""
    if int(sampled.sum()) * logits.shape[-1] < MIN_WHOLE_ROW_DRAWS:
        return None
    block_maxima = finite_block_maxima(logits)
    if block_maxima is None or not narrow_rows_agree():
        return None
    num_rows, num_blocks = metadata.num_rows, block_maxima.shape[1]
    positions_per_row = torch.tensor(metadata.num_draft_tokens) + 1
    row_of_position = torch.repeat_interleave(torch.arange(num_rows), positions_per_row)
    row_blocks = torch.zeros(num_rows, num_blocks, dtype=torch.int32)
    row_blocks.index_add_(0, row_of_position, (block_maxima > -math.inf).to(torch.int32))
    in_play = (row_blocks > 0) & sampled.cpu()[:, None]
    blocks_per_row = in_play.sum(dim=1)
    widest = int(blocks_per_row.max())
    if not widest or 2 * widest > num_blocks:
        return None
    rows, blocks = in_play.nonzero(as_tuple=True)  # row by row, ascending
    slots = torch.arange(len(rows)) - (torch.cumsum(blocks_per_row, 0) - blocks_per_row)[rows]
    block_slots = torch.full((num_rows, num_blocks), -1, dtype=torch.int64)
    block_slots[rows, blocks] = slots
    narrow_blocks = torch.zeros(num_rows, widest, dtype=torch.int64)
    narrow_blocks[rows, slots] = blocks
    padding = torch.arange(widest)[None, :] >= blocks_per_row[:, None]
    offsets = torch.arange(LANE_COLUMNS)
    return TokensInPlay(
        columns=(narrow_blocks[:, :, None] * LANE_COLUMNS + offsets).reshape(num_rows, -1),
        padding=padding.repeat_interleave(LANE_COLUMNS, dim=1),
        block_slots=block_slots,
        row_of_position=row_of_position,
    )


@functools.cache
def narrow_rows_agree() -> bool:
    """Whether this torch's CPU softmax gives a narrow row's finite scores the whole row's probabilities bit
    for bit, on random rows of a few vocabulary sizes: rows of the blocks in play (unsorted, `TokensInPlay`)
    and, with cumsum, sorted rows cut to their last columns (top-p's narrow row). Where not, every row takes
    the whole-row path (warned once)."""
    generator = torch.Generator().manual_seed(0)
    agree = True
    for vocab in (1024, 4096, 32_768):  # rows of the blocks in play, the padding after them
        scores = torch.full((16, vocab), -math.inf)
        columns = torch.randint(0, vocab, (16, 24), generator=generator)
        scores.scatter_(1, columns, torch.randn(16, 24, generator=generator) * 4)
        blocks = torch.unique((columns // LANE_COLUMNS).flatten())
        in_play = (blocks[:, None] * LANE_COLUMNS + torch.arange(LANE_COLUMNS)).flatten()
        narrow = torch.cat([scores[:, in_play], torch.full((16, 2 * LANE_COLUMNS), -math.inf)], dim=1)
        agree &= torch.equal(narrow.softmax(-1)[:, : len(in_play)], scores.softmax(-1)[:, in_play])
    for vocab in (1000, 4099, 32_768):  # top-p's: sorted rows, the finite scores last, cut to the last columns
        ascending = (torch.randn(16, vocab, generator=generator) * 4).sort(dim=1).values
        ascending[:, :-24] = -math.inf  # top-k 24, sorted as the warper sorts it
        width = vocab - LANE_COLUMNS * ((vocab - 24 - LANE_COLUMNS) // LANE_COLUMNS)
        cumulative = ascending.softmax(-1).cumsum(-1)[:, -24:]
        agree &= torch.equal(ascending[:, -width:].softmax(-1).cumsum(-1)[:, -24:], cumulative)
    if not agree:
        warnings.warn(
            f"torch {torch.__version__}'s CPU softmax / cumsum add a narrow row otherwise than a whole one: top-p "
            "and the rejection sampler run over whole rows (slower, the same distributions)",
            stacklevel=2,
        )
    return agree
