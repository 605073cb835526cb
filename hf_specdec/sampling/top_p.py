"""transformers' top-p warper run over the tokens still in play instead of the whole vocabulary.

`TopPLogitsWarper` sorts every row whole to find the top tokens holding `top_p` of the mass. A
speculative step warps every verified position (k + 1 per row), and after top-k (transformers'
default 50, Qwen's 20) a row holds a few dozen finite scores among 50k-250k -inf, and sorting them
all made Qwen's processors at 8 rows, k = 8 cost 531 ms a step on a 2-core CPU, 171 ms now
(docs/measurements.md, "Sampled top-p"). Here the warper itself runs on a narrow row: each row's finite scores at the end
of a row of -inf, as wide as the vocabulary less a multiple of 64 leading columns. Its result is the
whole-row warper's, bit for bit, on the CPU in float32:

- the sort puts the -inf first and the finite scores after them ascending; where no two finite
  scores are equal that order is unique, so the narrow row sorts into the whole row's last
  columns (rows with equal finite scores take the whole-row warper: an unstable sort may order
  equal scores differently in rows of another length);
- softmax's max is exact and its exp elementwise; its sum adds the row lane by lane in vector
  registers (at most 16 floats wide), and exp(-inf) = 0 adds nothing, so dropping 64 * j leading
  -inf columns keeps every finite score in its lane and the sum the same (at least 64 columns of
  -inf stay ahead of the finite scores); cumsum adds along the row, where the zeros add nothing;
- the -inf tokens stay -inf however the warper decides them (its filter value must be -inf).

Elsewhere (CUDA, other dtypes, NaN or +inf scores, most of the row finite) the whole-row warper
runs, and everywhere where a torch adds otherwise (`tokens_in_play.narrow_rows_agree`, checked once per
process).
`tests/test_top_p.py` checks the narrow path against it bit for bit.
"""

from __future__ import annotations

import math

import torch
from transformers.generation.logits_process import TopPLogitsWarper

from .tokens_in_play import LANE_COLUMNS, finite_entries, narrow_rows_agree


def warp_top_p(
    warper: TopPLogitsWarper, input_ids: torch.Tensor, scores: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """`warper(input_ids, scores)`, over each row's finite scores where that gives the same result (module
    docstring); `in_place`: `scores` may be written (the caller made it and reads it no more)."""
    vocab = scores.shape[-1]
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.ndim != 2 or warper.filter_value != -math.inf:
        return warper(input_ids, scores)
    if not len(scores) or not torch.isfinite(scores.amax(dim=1)).all():  # NaN (amax keeps it), +inf, a row of -inf
        return warper(input_ids, scores)
    if not narrow_rows_agree():
        return warper(input_ids, scores)
    rows, columns = finite_entries(scores)  # each row's finite scores, in column order
    counts = torch.bincount(rows, minlength=len(scores))
    most = int(counts.max())
    if 4 * (most + LANE_COLUMNS) > vocab:
        return warper(input_ids, scores)
    width = vocab - LANE_COLUMNS * ((vocab - most - LANE_COLUMNS) // LANE_COLUMNS)
    first = torch.cumsum(counts, 0) - counts  # where each row's scores start in `rows` / `columns`
    narrow_columns = torch.arange(len(rows)) - first[rows] + (width - counts[rows])
    narrow = torch.full((len(scores), width), -math.inf)
    narrow[rows, narrow_columns] = scores[rows, columns]
    ascending = narrow.sort(dim=1).values
    tied = ((ascending[:, 1:] == ascending[:, :-1]) & (ascending[:, 1:] > -math.inf)).any(dim=1)
    warped = warper(input_ids, narrow)
    out = scores if in_place else scores.clone()
    if tied.any():
        out[tied] = warper(input_ids, scores[tied])  # (top-p reads no input_ids)
        kept = ~tied[rows]
        rows, columns, narrow_columns = rows[kept], columns[kept], narrow_columns[kept]
    out[rows, columns] = warped[rows, narrow_columns]
    return out
