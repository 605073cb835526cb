"""transformers' most common processors without the full-size copies they return.

A speculative step processes every verified position (k + 1 per row): at 8 rows, k = 8 and Gemma 3's
262k vocabulary that is 72 x 262k scores, 75 MB, and each processor returns a fresh tensor that large.
Above 32 MB glibc maps every such allocation afresh, and on a 2-core CPU the page faults of writing it
cost 60-65 ms, against 7 ms for the same division in place (docs/measurements.md, "Sampled steps over the
tokens in play"). Where the loop owns the scores (`process_logits` made them: after a processor that
reads the prefix, such as the repetition penalty, or after the first warper), temperature and top-k run
as the warpers' own expression written into the scores (`warp_in_place`; their bodies are one line each,
and transformers has no in-place variant). A once-per-process check (`in_place_warpers_agree`) compares
them with the installed warpers and turns them off on a mismatch.

Tried and dropped: the repetition penalty run on its tokens' columns only (the same scores; 72 x 49k
positions 13.9 ms against 10.4 as it is, 152k 37 against 40, 262k 50 against 64-100: the copy of the
caller's logits it still needs is most of its time).
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper


def warp_in_place(processor, scores: torch.Tensor) -> torch.Tensor | None:
    """Temperature or top-k written into `scores` (which the caller owns); None for any other processor, or
    where the installed warpers compute otherwise."""
    if type(processor) not in (TemperatureLogitsWarper, TopKLogitsWarper) or not in_place_warpers_agree():
        return None
    return _write(processor, scores)


def _write(warper: TemperatureLogitsWarper | TopKLogitsWarper, scores: torch.Tensor) -> torch.Tensor:
    if type(warper) is TemperatureLogitsWarper:
        return scores.div_(warper.temperature)
    kth_best = torch.topk(scores, min(warper.top_k, scores.size(-1)))[0][..., -1, None]
    return scores.masked_fill_(scores < kth_best, warper.filter_value)


@functools.cache
def in_place_warpers_agree() -> bool:
    """Whether `warp_in_place` gives the installed warpers' scores, on random rows with ties."""
    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(6, 300, generator=generator) * 3).round(decimals=1)  # rounded: ties at the k-th score
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(7), TopKLogitsWarper(400)):
        if not torch.equal(_write(warper, scores.clone()), warper(None, scores.clone())):
            warnings.warn(
                f"transformers' {type(warper).__name__} no longer computes what hf_specdec writes in place: "
                "the warpers run as they are (slower, the same scores)",
                stacklevel=2,
            )
            return False
    return True
