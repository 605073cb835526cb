"""`OutputTokenPenalties`: OpenAI's presence / frequency penalties as a transformers processor.
Exactness under speculation is tested with every other processor (test_greedy_identity,
test_sampling_distribution, test_engine, test_server); here, the rule itself."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.sampling.penalties import OutputTokenPenalties


def test_penalties_follow_openais_rule_over_generated_tokens_only():
    scores = torch.zeros(2, 6)
    # prompt width 3: row 0 generated [4, 4, 2], row 1 generated [1, 5, 5]; prompt tokens (5, 4) do not count
    input_ids = torch.tensor([[5, 5, 1, 4, 4, 2], [0, 4, 4, 1, 5, 5]])
    out = OutputTokenPenalties(presence_penalty=0.5, frequency_penalty=0.25, prompt_width=3)(input_ids, scores)
    expected = torch.zeros(2, 6)
    expected[0, 4] = -(2 * 0.25 + 0.5)
    expected[0, 2] = -(0.25 + 0.5)
    expected[1, 1] = -(0.25 + 0.5)
    expected[1, 5] = -(2 * 0.25 + 0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # nothing generated yet: scores unchanged; negative penalties reward repeats
    assert torch.equal(OutputTokenPenalties(1.0, 1.0, prompt_width=6)(input_ids, scores), scores)
    rewarded = OutputTokenPenalties(-1.0, 0.0, prompt_width=3)(input_ids, scores)
    assert rewarded[0, 4] == 1.0 and rewarded[0, 0] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=float("nan"), prompt_width=0), "presence_penalty must be a finite number"),
        (dict(frequency_penalty="0.5", prompt_width=0), "frequency_penalty must be a finite number"),
        (dict(presence_penalty=True, prompt_width=0), "presence_penalty must be a finite number"),
        (dict(prompt_width=-1), "prompt_width must be an integer >= 0"),
    ],
)
def test_bad_penalties_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OutputTokenPenalties(**kwargs)
