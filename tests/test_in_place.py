"""Processors at every verified position against transformers' as plain generate() calls them, bit for bit: temperature
and top-k written in place (`sampling/in_place.py`) after the repetition penalty grouped by prefix length."""

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_specdec.sampling import in_place
from hf_specdec.sampling.logits_processing import process_logits


def _step(generator: torch.Generator, vocab: int, rows: int, per_row: int, token_vocab: int | None = None):
    """A step's logits (rounded: ties), the rows' tokens, and each position's batch row and prefix length."""
    logits = (torch.randn(rows * per_row, vocab, generator=generator) * 3).round(decimals=1)
    token_buffer = torch.randint(0, token_vocab or vocab, (rows, 40), generator=generator)
    buffer_rows = np.repeat(np.arange(rows), per_row)
    prefix_lens = np.tile(np.arange(20, 20 + per_row), rows) + np.repeat(np.arange(rows) % 3, per_row)
    return logits, token_buffer, buffer_rows, prefix_lens


def _as_generate_calls(processors, logits, token_buffer, buffer_rows, prefix_lens) -> torch.Tensor:
    """Each position through the processors with its own prefix, as plain generate() calls them."""
    return torch.cat([
        processors(token_buffer[row : row + 1, :length], logits[position : position + 1].clone())
        for position, (row, length) in enumerate(zip(buffer_rows, prefix_lens))
    ])  # fmt: skip


@pytest.mark.parametrize(
    "penalty", [RepetitionPenaltyLogitsProcessor(1.3), RepetitionPenaltyLogitsProcessor(0.8), RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=10)]
)
def test_the_repetition_penalty_then_temperature_and_top_k_in_place_give_transformers_scores(penalty):
    """At every position of 5 rows, 4 prefix lengths each: a penalty above and below 1 and with the prompt ignored;
    the rows' tokens run past the logits' vocabulary (an embedding larger than the head), which the penalty drops."""
    generator = torch.Generator().manual_seed(0)
    logits, *rest = _step(generator, vocab=1000, rows=5, per_row=4, token_vocab=1010)
    processors = LogitsProcessorList([penalty, TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])
    given = logits.clone()
    processed = process_logits(processors, given, *rest)
    assert torch.equal(given, logits)  # the caller's logits untouched
    assert torch.equal(processed, _as_generate_calls(processors, logits, *rest))
    assert not torch.equal(processed, _as_generate_calls(LogitsProcessorList(processors[1:]), logits, *rest))  # it bites


def test_the_repetition_penalty_with_a_prompt_length_per_row():
    """generate() gives the penalty each batch row's own prompt length (its left padding) as a tensor: each
    prefix-length group gets its rows' lengths."""
    generator = torch.Generator().manual_seed(1)
    logits, *rest = _step(generator, vocab=640, rows=4, per_row=3)
    lengths = torch.tensor([0, 22, 5, 30])
    processed = process_logits(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=lengths)]), logits, *rest)
    token_buffer, buffer_rows, prefix_lens = rest
    for position, (row, length) in enumerate(zip(buffer_rows, prefix_lens)):
        alone = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=lengths[row : row + 1])
        assert torch.equal(processed[position : position + 1], alone(token_buffer[row : row + 1, :length], logits[position : position + 1]))


def test_temperature_and_top_k_in_place_give_the_warpers_scores():
    """Written into scores the loop owns (after the penalty): the warpers' scores, ties at the k-th included;
    first in the list the warper runs on the caller's logits, which stay untouched."""
    assert in_place.in_place_warpers_agree()  # the installed transformers computes what is written in place
    generator = torch.Generator().manual_seed(2)
    logits, *rest = _step(generator, vocab=2048, rows=4, per_row=5)
    for processors in (
        [RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.6), TopKLogitsWarper(9)],
        [TemperatureLogitsWarper(1.3), TopKLogitsWarper(50, filter_value=-1e4)],
        [TopKLogitsWarper(4000)],  # k above the vocabulary
    ):
        processors = LogitsProcessorList(processors)
        given = logits.clone()
        assert torch.equal(process_logits(processors, given, *rest), _as_generate_calls(processors, logits, *rest))
        assert torch.equal(given, logits)


def test_warpers_that_no_longer_agree_run_as_they_are(monkeypatch):
    calls = []

    class Recording(TemperatureLogitsWarper):
        def __call__(self, input_ids, scores):
            calls.append(scores.shape)
            return super().__call__(input_ids, scores)

    scores = torch.randn(3, 100)
    assert in_place.warp_in_place(TemperatureLogitsWarper(0.5), scores.clone()) is not None
    assert in_place.warp_in_place(Recording(0.5), scores.clone()) is None  # another type: the warper runs
    monkeypatch.setattr(in_place, "in_place_warpers_agree", lambda: False)
    assert in_place.warp_in_place(TemperatureLogitsWarper(0.5), scores.clone()) is None
    assert in_place.warp_in_place(TopKLogitsWarper(5), scores.clone()) is None
    processed = process_logits(
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), Recording(0.5)]), scores, torch.zeros(1, 4, dtype=torch.long),
        np.zeros(3, dtype=np.int64), np.full(3, 4),
    )  # fmt: skip
    assert calls == [(3, 100)] and processed.shape == scores.shape
