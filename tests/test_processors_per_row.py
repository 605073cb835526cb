"""Processors that transformers builds with a value per batch row (a source per row, repeated by
`num_return_sequences`): at every verified position, grouped by prefix length, each position gets its own row's."""

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
)

from hf_specdec.sampling.logits_processing import process_logits, spread_over_rows

PROCESSORS = {
    "encoder_repetition_penalty_down": lambda sources: EncoderRepetitionPenaltyLogitsProcessor(0.6, sources),
    "encoder_repetition_penalty_up": lambda sources: EncoderRepetitionPenaltyLogitsProcessor(1.7, sources),
    "encoder_no_repeat_ngram": lambda sources: EncoderNoRepeatNGramLogitsProcessor(2, sources),
}


@pytest.mark.parametrize("name", PROCESSORS)
@pytest.mark.parametrize("repeats", [1, 3])
def test_each_position_reads_its_own_rows_source(name, repeats):
    """Two prompts' sources, each row sampled `repeats` times; 3 positions a row with prefix lengths shared across
    rows, so a group holds positions of several rows in an order of its own."""
    generator = torch.Generator().manual_seed(repeats)
    sources = torch.randint(0, 16, (2, 12), generator=generator)
    rows, per_row = 2 * repeats, 3
    logits = torch.randn(rows * per_row, 64, generator=generator)
    token_buffer = torch.randint(0, 16, (rows, 40), generator=generator)
    buffer_rows = np.repeat(np.arange(rows), per_row)
    prefix_lens = np.tile(np.arange(20, 20 + per_row), rows) + np.repeat(np.arange(rows) % 2, per_row)
    processors = spread_over_rows(LogitsProcessorList([PROCESSORS[name](sources)]), rows)

    processed = process_logits(processors, logits, token_buffer, buffer_rows, prefix_lens)

    for position, (row, length) in enumerate(zip(buffer_rows, prefix_lens)):
        alone = PROCESSORS[name](sources[row // repeats : row // repeats + 1])
        expected = alone(token_buffer[row : row + 1, :length], logits[position : position + 1].clone())
        assert torch.equal(processed[position : position + 1], expected), (name, position)
    assert not torch.equal(processed, logits)  # it bites
    # the other prompt's source gives other scores: the comparison can tell the rows apart
    swapped = process_logits(spread_over_rows(LogitsProcessorList([PROCESSORS[name](sources.flip(0))]), rows), logits, token_buffer, buffer_rows, prefix_lens)
    assert not torch.equal(swapped, processed)


def test_a_source_count_that_does_not_divide_the_batch_is_refused():
    sources = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="EncoderRepetitionPenaltyLogitsProcessor holds 2 sources for a batch of 3 rows"):
        spread_over_rows(LogitsProcessorList([EncoderRepetitionPenaltyLogitsProcessor(1.5, sources)]), 3)


def test_processors_without_rows_of_their_own_come_back_as_they_are():
    processors = LogitsProcessorList([EncoderRepetitionPenaltyLogitsProcessor(1.5, torch.zeros(3, 4, dtype=torch.long))])
    assert spread_over_rows(processors, 3) is processors
