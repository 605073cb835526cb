"""OpenAI's presence and frequency penalties as a transformers logits processor.

transformers has no such processor: its `repetition_penalty` divides or multiplies a seen token's
logit once (CTRL's rule, prompt included), while OpenAI's clients send `presence_penalty` and
`frequency_penalty`, which subtract from the logit of every token the completion already holds:

    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

with count[t] the occurrences of t among the generated tokens (vLLM counts the same, the prompt
left out). It reads only `input_ids`, so plain `generate()` takes it in `logits_processor=[...]`
and the speculative loop replays it per verified position, each with its own prefix, like any
prefix-dependent processor.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor


class OutputTokenPenalties(LogitsProcessor):
    """Subtracts `frequency_penalty` per occurrence and `presence_penalty` once from the logit of
    every token generated so far. `prompt_width`: the columns of (left-padded) prompt at the start
    of each row of `input_ids`; the tokens after them are the generated ones."""

    def __init__(self, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, *, prompt_width: int):
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if isinstance(prompt_width, bool) or not isinstance(prompt_width, int) or prompt_width < 0:
            raise ValueError(f"prompt_width must be an integer >= 0, got {prompt_width!r}")
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_width :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(scores.dtype)
