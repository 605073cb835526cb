"""Top-p over the tokens still in play (`sampling/top_p.py`) against transformers' whole-row warper, bit for bit."""

import math

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama, repeated_span_batch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_specdec
from hf_specdec.drafters.drafting import DraftSampling, DraftTokenPicker
from hf_specdec.sampling import top_p
from hf_specdec.sampling.logits_processing import process_logits
from hf_specdec.sampling.top_p import LANE_COLUMNS, narrow_rows_agree, warp_top_p


def _after_top_k(generator: torch.Generator, rows: int, vocab: int, top_k: int, bf16: bool) -> torch.Tensor:
    scores = torch.randn(rows, vocab, generator=generator) * (0.5 + 8 * float(torch.rand(1, generator=generator)))
    if bf16:  # a bf16 model's logits: many equal scores
        scores = scores.to(torch.bfloat16).float()
    return TopKLogitsWarper(top_k)(None, scores)


def test_top_p_over_the_tokens_in_play_equals_the_whole_row_warper():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = int(torch.randint(300, 4000, (1,), generator=generator)) if trial % 10 else 151_936
        rows, top_k = int(torch.randint(1, 12, (1,), generator=generator)), int(torch.randint(1, 64, (1,), generator=generator))
        scores = _after_top_k(generator, rows, vocab, top_k, bf16=trial % 3 == 0)
        warper = TopPLogitsWarper(0.01 + 0.98 * float(torch.rand(1, generator=generator)), min_tokens_to_keep=1 + trial % 3)
        expected = warper(None, scores)
        given = scores.clone()
        assert torch.equal(warp_top_p(warper, None, given), expected), trial
        assert torch.equal(given, scores)  # not written unless in place
        assert torch.equal(warp_top_p(warper, None, given, in_place=True), expected), trial


def test_the_narrow_row_gives_the_whole_rows_cumulative_probabilities_bit_for_bit():
    """The claim the narrow path rests on: softmax's sum and cumsum see the finite scores alike once a multiple of
    LANE_COLUMNS leading -inf columns is gone; dropping a number of columns that is no multiple of the vector width
    changes the sum's rounding (the check below tells the two apart)."""
    generator = torch.Generator().manual_seed(1)

    def cumulative(row: torch.Tensor) -> torch.Tensor:
        return row.sort().values.softmax(-1).cumsum(-1)

    differs_unaligned = 0
    for _ in range(300):
        vocab = int(torch.randint(300, 5000, (1,), generator=generator))
        scores = _after_top_k(generator, 1, vocab, int(torch.randint(2, 64, (1,), generator=generator)), bf16=False)
        finite = scores[scores > -math.inf]
        whole = cumulative(scores)[0, -len(finite) :]
        for drop, aligned in ((LANE_COLUMNS * ((vocab - len(finite) - LANE_COLUMNS) // LANE_COLUMNS), True), (vocab - len(finite) - 1, False)):
            narrow = torch.full((1, vocab - drop), -math.inf)
            narrow[0, -len(finite) :] = finite
            same = torch.equal(cumulative(narrow)[0, -len(finite) :], whole)
            if aligned:
                assert same
            else:
                differs_unaligned += not same
    assert differs_unaligned > 0


def test_equal_scores_at_the_cut_get_the_whole_row_warpers_choice():
    # three equal scores holding all the mass, top-p 0.5: one of them is cut, which one the sort's order of equal
    # scores decides; a narrow row's sort orders them otherwise (checked), so such rows take the whole-row warper
    vocab = 5000
    scores = torch.full((1, vocab), -math.inf)
    columns = torch.tensor([17, 2100, 4001])
    scores[0, columns] = 1.0
    warper = TopPLogitsWarper(0.5)
    expected = warper(None, scores)
    narrow = torch.full((1, 128), -math.inf)
    narrow[0, -3:] = 1.0
    cut_in_narrow = columns[torch.isinf(warper(None, narrow)[0, -3:])]
    cut_in_whole = columns[torch.isinf(expected[0, columns])]
    assert not torch.equal(cut_in_narrow, cut_in_whole)  # the case tells the two orders apart
    assert torch.equal(warp_top_p(warper, None, scores), expected)


@pytest.mark.parametrize(
    "case", ["nan", "plus_inf", "all_finite", "row_of_minus_inf", "filter_value", "float64"]
)  # fmt: skip
def test_top_p_rows_the_narrow_path_does_not_cover_take_the_whole_row_warper(case):
    generator = torch.Generator().manual_seed(2)
    scores = _after_top_k(generator, 4, 3000, 20, bf16=False)
    warper = TopPLogitsWarper(0.8)
    if case == "nan":
        scores[1, 5] = math.nan
    elif case == "plus_inf":
        scores[2, 7] = math.inf
    elif case == "all_finite":
        scores = torch.randn(4, 3000, generator=generator)
    elif case == "row_of_minus_inf":
        scores[3] = -math.inf
    elif case == "filter_value":
        warper = TopPLogitsWarper(0.8, filter_value=-1e4)
    else:
        scores = scores.double()
    expected = warper(None, scores.clone())
    torch.testing.assert_close(warp_top_p(warper, None, scores), expected, rtol=0, atol=0, equal_nan=True)


def test_a_step_and_the_drafts_warp_as_transformers_processors_do():
    """Qwen2.5's generation config (repetition penalty, temperature 0.7, top-k 20, top-p 0.8) at every verified
    position of 8 rows at k = 8, and a draft model's warping, against the processors called as generate() calls them."""
    generator = torch.Generator().manual_seed(3)
    vocab, rows, per_row = 151_936, 8, 9
    logits = torch.randn(rows * per_row, vocab, generator=generator) * 3
    token_buffer = torch.randint(0, vocab, (rows, 64), generator=generator)
    buffer_rows = np.repeat(np.arange(rows), per_row)
    prefix_lens = np.tile(np.arange(40, 40 + per_row), rows) + np.repeat(np.arange(rows) % 3, per_row)
    processors = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    )
    given = logits.clone()
    processed = process_logits(processors, given, token_buffer, buffer_rows, prefix_lens)
    assert torch.equal(given, logits)  # the caller's logits untouched
    for position in range(len(logits)):
        prefix = token_buffer[buffer_rows[position] : buffer_rows[position] + 1, : prefix_lens[position]]
        assert torch.equal(processed[position : position + 1], processors(prefix, logits[position : position + 1].clone()))
    picker = DraftTokenPicker(DraftSampling.sampled(processors, seed=0), torch.device("cpu"))
    expected = logits
    for warper in processors[1:]:
        expected = warper(None, expected)
    assert torch.equal(picker.warp(given), expected)
    assert torch.equal(given, logits)


def test_a_torch_that_adds_a_narrow_row_otherwise_runs_top_p_over_whole_rows(monkeypatch):
    assert narrow_rows_agree()  # this torch adds as the narrow path assumes (a torch upgrade that does not fails here)
    scores = _after_top_k(torch.Generator().manual_seed(4), 4, 3000, 20, bf16=False)
    called_on = []

    class Recording(TopPLogitsWarper):
        def __call__(self, input_ids, scores):
            called_on.append(tuple(scores.shape))
            return super().__call__(input_ids, scores)

    assert torch.equal(warp_top_p(Recording(0.8), None, scores), TopPLogitsWarper(0.8)(None, scores))
    assert called_on[0][1] < scores.shape[1]  # a narrow row
    called_on.clear()
    monkeypatch.setattr(top_p, "narrow_rows_agree", lambda: False)
    assert torch.equal(warp_top_p(Recording(0.8), None, scores), TopPLogitsWarper(0.8)(None, scores))
    assert called_on == [tuple(scores.shape)]


def test_sampled_generate_draws_the_same_tokens_with_top_p_over_the_tokens_in_play(monkeypatch):
    """End to end (a draft model's sampled drafts warped, every verified position processed, rows of a batch): the
    same seeded tokens with the narrow path as with whole rows everywhere, and the narrow path did run."""
    vocab = 2048
    target, draft = hf_specdec.enable(build_tiny_llama(vocab_size=vocab)), build_tiny_llama(seed=1, vocab_size=vocab)
    widths = []
    whole_row_call = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, ids, s: widths.append(s.shape[-1]) or whole_row_call(self, ids, s))

    def sample() -> torch.Tensor:
        torch.manual_seed(0)
        return target.generate(
            **repeated_span_batch(3), max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.8,
            pad_token_id=0, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "seed": 0},
        )  # fmt: skip

    narrow = sample()
    assert min(widths) < vocab  # the narrow path ran
    widths.clear()
    monkeypatch.setattr(top_p, "narrow_rows_agree", lambda: False)
    assert torch.equal(sample(), narrow)
    assert set(widths) == {vocab}
