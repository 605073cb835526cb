"""Sampled drafts are drawn from exactly the q the picker returns (`DraftTokenPicker.pick`): the
rejection sampler's p / q test keeps the output on the target's distribution only then."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

from hf_specdec.drafters.drafting import DraftSampling, DraftTokenPicker

VOCAB, ROWS = 12, 6000


def draw(picker: DraftTokenPicker, logits: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """One draft for each of ROWS rows (each its own generator) from the same logits."""
    tokens, q = picker.pick(logits.expand(ROWS, -1), list(range(ROWS)))
    return tokens.numpy(), q


def chi_square_p(tokens: np.ndarray, q: torch.Tensor) -> float:
    support = (q > 0).numpy()
    observed = np.bincount(tokens, minlength=VOCAB)
    assert observed[~support].sum() == 0  # never a token q gives no mass
    expected = q.double().numpy()[support]
    return chisquare(observed[support], ROWS * expected / expected.sum()).pvalue


@pytest.fixture
def logits():
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 2


def sampling_picker(temperature: float = 0.5) -> DraftTokenPicker:
    warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(8)]
    return DraftTokenPicker(DraftSampling(do_sample=True, warpers=warpers, seed=7), torch.device("cpu"))


def test_sampled_drafts_follow_the_returned_q(logits):
    tokens, q = draw(sampling_picker(), logits)
    assert torch.allclose(q, q[:1].expand_as(q)) and (q[0] == 0).sum() == VOCAB - 8  # top-k left 8 tokens
    assert chi_square_p(tokens, q[0]) > 1e-3
    again, _ = draw(sampling_picker(), logits)  # the same seed: the same drafts
    assert np.array_equal(tokens, again)


def test_a_picker_drawing_from_another_q_is_detected(logits):
    """The test has power: drafts drawn at temperature 0.7, tested against the q of 0.5, fail it."""
    tokens, _ = draw(sampling_picker(temperature=0.7), logits)
    _, q = sampling_picker(temperature=0.5).pick(logits, [0])
    assert chi_square_p(tokens, q[0]) < 1e-6
