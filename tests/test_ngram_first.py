"""An n-gram lookup before a model drafter (`prompt_lookup_max` with method eagle / eagle3 /
draft_model / ...): exact greedy output, exact sampling (the model drafter's q merged with the
n-gram's one-hot rows), both drafters really used in one call, and the config's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_small_vocab_llama, plain_generate, repeated_span_batch
from test_eagle import random_head
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import DraftProposal, NgramFirstProposer, NgramProposer, ProposeRequest
from hf_specdec.drafters.eagle import EagleProposer
from hf_specdec.drafters.ngram_first import _with_one_hot_rows
from hf_specdec.loop import step


def test_config():
    config = SpeculativeConfig(
        method="eagle3", model="head", num_speculative_tokens=1, prompt_lookup_max=4, prompt_lookup_num_tokens=6
    )
    assert config.ngram_first and (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert config.max_draft_tokens == 6  # the loop asks for the longer of the two
    assert SpeculativeConfig(method="eagle3", model="head", num_speculative_tokens=3, prompt_lookup_min=2).max_draft_tokens == 3
    assert not SpeculativeConfig(method="eagle3", model="head").ngram_first
    assert not SpeculativeConfig(method="ngram").ngram_first  # ngram is the lookup itself


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"method": "ngram", "prompt_lookup_num_tokens": 4}, "n-gram stage"),
        ({"method": "eagle", "model": "h", "prompt_lookup_num_tokens": 4}, "prompt_lookup_max"),
        ({"method": "eagle", "model": "h", "prompt_lookup_max": 3, "prompt_lookup_num_tokens": 0}, "1 to 32"),
        ({"method": "eagle", "model": "h", "prompt_lookup_max": 3, "prompt_lookup_num_tokens": 33}, "1 to 32"),
        ({"method": "eagle", "model": "h", "num_speculative_tokens": "auto", "prompt_lookup_max": 3,
          "prompt_lookup_num_tokens": 4}, "auto"),
        ({"method": "eagle", "model": "h", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ],
)
def test_invalid_config_names_the_field(kwargs, fragment):
    field = "prompt_lookup_min" if "prompt_lookup_num_tokens" not in kwargs else "prompt_lookup_num_tokens"
    with pytest.raises(ValueError, match=f"speculative_config.{field}") as info:
        SpeculativeConfig(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("method", ("eagle", "eagle3"))
@pytest.mark.parametrize("batch_size", (1, 4))
def test_greedy_matches_plain_generate(enabled_llama, method, batch_size, monkeypatch):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    asked = []  # rows the head was asked to draft for
    original = EagleProposer.propose

    def counting(self, request):
        asked.extend(r for r, n in zip(request.rows, request.max_draft_tokens) if n > 0)
        return original(self, request)

    monkeypatch.setattr(EagleProposer, "propose", counting)
    config = {"method": method, "model": random_head(model, method), "num_speculative_tokens": 1,
              "prompt_lookup_min": 1, "prompt_lookup_max": 3, "prompt_lookup_num_tokens": 4}
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, speculative_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    # drafts of 4 tokens: the n-gram's (the head drafts k=1)
    assert len(out.spec_metrics["num_accepted_tokens_per_pos"]) == 4
    assert asked, "rows without a match were drafted by the head"


def test_fast_linears_reach_the_wrapped_head(enabled_llama):
    head = random_head(enabled_llama, "eagle3")
    config = SpeculativeConfig(method="eagle3", model=head, num_speculative_tokens=1, prompt_lookup_max=2)
    proposer = hf_specdec.drafters.build_proposer(config, enabled_llama)
    assert isinstance(proposer, NgramFirstProposer)
    assert proposer.target_feature_layers == proposer.drafter.target_feature_layers
    assert step.drafter_networks(proposer) == [proposer.drafter.head]


def test_one_hot_rows_merge_in_row_order():
    q_own = torch.softmax(torch.randn(3, 5), dim=-1)  # row 1 drafted 2 tokens, row 3 one
    modelled = DraftProposal(
        draft_token_ids=[np.zeros(0, dtype=np.int64), np.array([1, 2]), np.zeros(0, dtype=np.int64), np.array([4])],
        draft_probs=q_own,
    )
    drafts = [np.array([3, 0]), np.array([1, 2]), np.array([2]), np.array([4])]
    merged = _with_one_hot_rows(modelled, drafts, [True, False, True, False])
    expected = torch.stack([torch.eye(5)[3], torch.eye(5)[0], q_own[0], q_own[1], torch.eye(5)[2], q_own[2]])
    assert torch.equal(merged, expected)
    assert _with_one_hot_rows(DraftProposal(drafts, None), drafts, [True] * 4) is None


@pytest.mark.slow
def test_sampled_draft_model_behind_ngram_follows_the_target_distribution(monkeypatch):
    """Sampled drafts (with q) for some rows and n-gram drafts (one-hot) for others in the same
    steps: the output follows the target's processed distribution."""
    target, draft = hf_specdec.enable(build_small_vocab_llama(0)), build_small_vocab_llama(1)
    # with this setting some rows' second step finds a 1-gram match while others do not
    sampling = SETTINGS["no_repeat_ngram_topk"]
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
              "prompt_lookup_min": 1, "prompt_lookup_max": 3, "prompt_lookup_num_tokens": 3}
    mixed_steps = 0  # steps in which some rows drafted by n-gram and others by the draft model
    original = NgramFirstProposer.propose

    def spy(self, request):
        nonlocal mixed_steps
        matched = [len(d) > 0 for d in self.ngram.propose(request).draft_token_ids]
        proposal = original(self, request)
        modelled = [len(d) > 0 and not m for d, m in zip(proposal.draft_token_ids, matched)]
        mixed_steps += any(matched) and any(modelled) and proposal.draft_probs is not None
        return proposal

    monkeypatch.setattr(NgramFirstProposer, "propose", spy)
    samples, metrics = speculative_samples(target, sampling, config, num_samples=4000, seed=1234)
    assert mixed_steps > 0
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    assert chi_square_pvalue(samples, exact_distribution(target, sampling)) > 1e-3


def test_ngram_only_rows_leave_the_drafter_idle():
    """A row with a match is asked of the drafter with max_draft_tokens 0."""
    seen = []

    class Recorder:
        def propose(self, request):
            seen.append(list(request.max_draft_tokens))
            return DraftProposal([np.array([9] * n, dtype=np.int64) for n in request.max_draft_tokens])

        def release(self, rows, token_ids=None):
            seen.append(("released", rows))

    proposer = NgramFirstProposer(NgramProposer(3, 1, 2), Recorder())
    request = ProposeRequest(rows=[0, 1], token_ids=[np.array([5, 6, 7, 5, 6]), np.array([1, 2, 3, 4])],
                             max_draft_tokens=[3, 2])
    drafts = proposer.propose(request).draft_token_ids
    assert [d.tolist() for d in drafts] == [[7, 5, 6], [9, 9]]
    proposer.release([1])
    assert seen == [[0, 2], ("released", [1])]
