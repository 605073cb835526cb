"""EAGLE / EAGLE-3 drafters in generate(): exactness (greedy and sampled), the feature plumbing,
the head's own KV cache, and a head trained on the tiny target's outputs actually being accepted.

Random heads draft nonsense (almost every draft rejected): they check exactness under
rejection. The trained head checks the rest: drafts accepted, and every first draft equal to
what the head predicts from features of a separate plain target forward, which only holds when
each feature is paired with the right token at the right position.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import (
    FIRST_WORD_ID,
    VOCAB_SIZE,
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    plain_generate,
    repeated_span_batch,
)
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples

import hf_specdec
from hf_specdec.drafters import ProposeRequest
from hf_specdec.drafters.eagle import EagleProposer
from hf_specdec.heads.eagle_heads import EagleHead
from hf_specdec.loop import step
from hf_specdec.models.feature_capture import PendingFeatures, target_features
from hf_specdec.sampling.rejection_sampler import RandomDraws, rejection_sample

METHODS = ("eagle", "eagle3")


def random_head(model, method: str, seed: int = 0, num_layers: int = 1, draft_vocab_size: int | None = None):
    """A randomly initialised head; EAGLE-3 heads get a reduced draft vocabulary (3/4 of the ids)."""
    draft_vocab = None
    if method == "eagle3":
        vocab = model.config.vocab_size
        size = draft_vocab_size or vocab * 3 // 4
        draft_vocab = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    return EagleHead.for_target(model, method, num_layers=num_layers, draft_vocab=draft_vocab, seed=seed)


def eagle_config(method: str, head, k: int, **extra) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k, **extra}


# --- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("batch_size", (1, 3, 8))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_matches_plain_generate(enabled_llama, method, batch_size, k):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config=eagle_config(method, random_head(model, method), k),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    # the prefill step drafts nothing (no features yet); later steps draft while there is room
    assert 0 < metrics["num_drafts"] <= batch_size * (metrics["num_target_forwards"] - 1)
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"]


@pytest.mark.parametrize("method", METHODS)
def test_two_layer_head_and_custom_generate(tiny_llama, method):
    """A head with two decoder layers, through `custom_generate` on an unpatched model."""
    model = tiny_llama
    inputs = repeated_span_batch(3)
    plain = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=20,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config=eagle_config(method, random_head(model, method, num_layers=2), 3),
    )
    assert torch.equal(out, plain)


# random heads whose drafts land in the sampled support often enough (5-30%) for both paths to run
SAMPLING_HEAD_SEEDS = {"eagle": 0, "eagle3": 2}


def _eagle_samples(model, method: str, sampling: dict) -> tuple[np.ndarray, int, int]:
    head = random_head(model, method, seed=SAMPLING_HEAD_SEEDS[method], draft_vocab_size=12)
    samples, metrics = speculative_samples(
        model, sampling, eagle_config(method, head, 2), num_samples=4000, seed=1234
    )
    drafted = sum(m["num_draft_tokens"] for m in metrics)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    return samples, drafted, accepted


@pytest.mark.parametrize("method", METHODS)
def test_sampling_matches_exact_distribution(method):
    """Greedy drafts + one-hot q: sampled output follows the target's processed distribution."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    samples, drafted, accepted = _eagle_samples(model, method, sampling)
    assert 0 < accepted < drafted, "drafts must be both accepted and rejected for the test to mean anything"
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) > 1e-3


def test_sampling_test_detects_always_accepting(monkeypatch):
    """The same test with a sampler that accepts every EAGLE draft fails: it has power here too."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]

    def always_accept(metadata, logits, is_greedy, draws=None, draft_probs=None, method="token"):
        draws = RandomDraws(uniform=torch.zeros_like(draws.uniform), exponential=draws.exponential)
        return rejection_sample(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs, method=method)

    monkeypatch.setattr(step, "rejection_sample", always_accept)
    samples, _, _ = _eagle_samples(model, "eagle3", sampling)
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) < 1e-6


# --- the drafter's own state --------------------------------------------------------------------
def _features(model, method: str, head, tokens: list[int]) -> torch.Tensor:
    layers = head.feature_layers_for(len(model.model.layers))
    with torch.no_grad():
        return target_features(model, torch.tensor([tokens]), layers)[0][0]


def _request(tokens, features, max_draft, pending=None, row=0):
    """A request whose queue holds what `pending` (the loop's queue of earlier calls) still holds, plus `features`."""
    pending = pending if pending is not None else PendingFeatures()
    pending.add(row, features)
    return ProposeRequest(
        rows=[row], token_ids=[np.array(tokens, dtype=np.int64)], max_draft_tokens=[max_draft], target_features=pending
    )


@pytest.mark.parametrize("method", METHODS)
def test_head_cache_rollback_and_feature_consumption(tiny_llama, method):
    """Drafting after (a) one call with every feature, (b) a call allowed no drafts then the rest,
    (c) a call whose speculative head entries must be rolled back: all the same drafts."""
    model = tiny_llama
    head = random_head(model, method)
    tokens = [5, 9, 14, 5, 9, 14, 7, 22, 31, 40, 5, 9]
    features = _features(model, method, head, tokens)  # feature of position i: features[i]
    n, split, k = len(tokens), 7, 4

    def fresh(**kwargs):
        return EagleProposer(head, model, k, block_size=4, **kwargs)

    with torch.no_grad():
        direct = fresh(max_length=64).propose(_request(tokens, features[: n - 1], k)).draft_token_ids[0]

        quiet, queue = fresh(max_length=64), PendingFeatures()
        assert len(quiet.propose(_request(tokens[:split], features[: split - 1], 0, queue)).draft_token_ids[0]) == 0
        assert queue.count(0) == split - 1  # not drafting: the features wait in the queue
        after_quiet = quiet.propose(_request(tokens, features[split - 1 : n - 1], k, queue)).draft_token_ids[0]
        assert queue.count(0) == 0

        speculative, queue = fresh(num_blocks=1), PendingFeatures()  # one 4-token block: the pool has to grow
        first = speculative.propose(_request(tokens[:split], features[: split - 1], k, queue)).draft_token_ids[0]
        assert len(first) == k
        assert speculative.cache.seq_lens[0] == split - 1 + k - 1  # context pairs + drafts but the last
        after_speculative = speculative.propose(_request(tokens, features[split - 1 : n - 1], k, queue)).draft_token_ids[0]
    assert len(direct) == k
    np.testing.assert_array_equal(after_quiet, direct)
    np.testing.assert_array_equal(after_speculative, direct)

    speculative.release([0])
    assert speculative.cache.num_blocks_used == 0


@pytest.mark.parametrize("method", METHODS)
def test_rows_not_drafting_defer_the_head(tiny_llama, method, monkeypatch):
    """k = 0 calls (one new feature each, as a plain decode step gives) run no head forward: the
    features wait, and the first call that drafts feeds them all at once, with the drafts of a
    head fed every step. Past MAX_PENDING_POSITIONS a row feeds them even without drafting."""
    from hf_specdec.drafters import drafting

    model = tiny_llama
    head = random_head(model, method)
    tokens = [5, 9, 14, 5, 9, 14, 7, 22, 31, 40, 5, 9]
    features = _features(model, method, head, tokens)
    n, first, k = len(tokens), 3, 2

    def quiet_then_draft(proposer):
        queue = PendingFeatures()
        proposer.propose(_request(tokens[:first], features[: first - 1], 0, queue))
        fed = []
        for length in range(first + 1, n):  # one decode step per token, none drafting
            request = _request(tokens[:length], features[length - 2 : length - 1], 0, queue)
            assert proposer.propose(request).num_draft_tokens == [0]
            fed.append(proposer.cache.seq_lens.get(0, 0) if proposer.cache is not None else 0)
            assert fed[-1] + queue.count(0) == length - 1  # every feature is either fed or waiting
        return fed, proposer.propose(_request(tokens, features[n - 2 : n - 1], k, queue)).draft_token_ids[0]

    with torch.no_grad():
        direct = EagleProposer(head, model, k, max_length=64).propose(_request(tokens, features[: n - 1], k))
        fed, deferred = quiet_then_draft(EagleProposer(head, model, k, max_length=64))
        monkeypatch.setattr(drafting, "MAX_PENDING_POSITIONS", 4)
        capped_fed, capped = quiet_then_draft(EagleProposer(head, model, k, max_length=64))
    assert fed == [0] * len(fed)  # no head forward while not drafting
    assert max(capped_fed) > 0 and all(n_fed % 4 == 0 for n_fed in capped_fed)  # fed in backlogs of 4
    np.testing.assert_array_equal(deferred, direct.draft_token_ids[0])
    np.testing.assert_array_equal(capped, direct.draft_token_ids[0])


def test_no_features_no_drafts(tiny_llama):
    """The prefill step: the loop has no features yet, so the drafter drafts nothing."""
    proposer = EagleProposer(random_head(tiny_llama, "eagle"), tiny_llama, 3, max_length=32)
    request = _request([5, 6, 7], torch.empty(0, 0), 3)
    assert proposer.propose(request).num_draft_tokens == [0]
    assert proposer.target_feature_layers == (len(tiny_llama.model.layers),)


# --- a trained head ------------------------------------------------------------------------------
# A smoother tiny target than conftest's (initializer_range 0.05): its greedy continuations fall
# into patterns a one-layer head learns in a few hundred steps.
TRAINED_TARGET_INIT = 0.05


def _random_prompts(count: int, seed: int, lengths: tuple[int, int] = (8, 8)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def train_head(model, method: str, num_sequences: int = 384, steps: int = 300, batch: int = 16) -> EagleHead:
    """Cross-entropy of the head's next-token logits against the target's greedy next tokens
    (plus feature regression for EAGLE), on the target's own greedy continuations."""
    torch.manual_seed(0)
    inputs = left_padded_batch(_random_prompts(num_sequences, seed=0))
    sequences = plain_generate(model, **inputs, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    head = EagleHead.for_target(model, method, seed=0)
    with torch.no_grad():
        features, logits = target_features(model, sequences, head.feature_layers_for(len(model.model.layers)))
    targets = logits.argmax(dim=-1)
    # pair (feature i, token i+1) predicts the target's choice at position i+1
    pair_tokens, pair_features, pair_targets = sequences[:, 1:], features[:, :-1], targets[:, 1:]
    positions = torch.arange(sequences.shape[1] - 1).expand(num_sequences, -1)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    head.train()
    for _ in range(steps):
        pick = torch.randint(0, num_sequences, (batch,), generator=generator)
        hidden = head(pair_tokens[pick], pair_features[pick], positions[pick])
        logits = head.compute_logits(hidden)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), pair_targets[pick].flatten())
        if method == "eagle":  # the head's output stands in for the next target feature
            loss = loss + torch.nn.functional.smooth_l1_loss(hidden, features[pick, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return head.eval()


def _teacher_forced(model, head, tokens: list[int]) -> torch.Tensor:
    """Logits of the head for every pair of the sequence, from a plain target forward's features."""
    features = _features(model, head.method, head, tokens)
    with torch.no_grad():
        hidden = head(
            torch.tensor([tokens[1:]]), features[None, :-1], torch.arange(len(tokens) - 1)[None]
        )
        return head.compute_logits(hidden)[0]


@pytest.mark.parametrize("method", METHODS)
def test_trained_head_is_accepted(method, monkeypatch):
    model = hf_specdec.enable(build_tiny_llama(initializer_range=TRAINED_TARGET_INIT))
    model.requires_grad_(False)
    head = train_head(model, method)

    first_drafts: list[tuple[int, int, int]] = []  # (row, context length, first draft)
    propose = EagleProposer.propose

    def recording_propose(self, request):
        proposal = propose(self, request)
        for row, tokens, drafts in zip(request.rows, request.token_ids, proposal.draft_token_ids):
            if len(drafts):
                first_drafts.append((row, len(tokens), int(drafts[0])))
        return proposal

    monkeypatch.setattr(EagleProposer, "propose", recording_propose)
    inputs = left_padded_batch(_random_prompts(8, seed=1, lengths=(5, 12)))
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=eagle_config(method, head, 3),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["mean_acceptance_length"] > 1.5, out.spec_metrics

    # each first draft is the head's argmax at the last context pair, as a separate plain forward
    # of the final sequence computes it (a near-tie may flip: fp noise between attention paths)
    pad = inputs["input_ids"].shape[1] - inputs["attention_mask"].sum(dim=1)
    for row in range(len(plain)):
        tokens = plain[row, int(pad[row]) :].tolist()
        logits = _teacher_forced(model, head, tokens)
        for _, length, draft in (r for r in first_drafts if r[0] == row):
            pair_logits = logits[length - 2]
            best = head.draft_to_target(pair_logits.argmax()).item()
            top2 = pair_logits.topk(2).values
            assert draft == best or (top2[0] - top2[1]).item() < 1e-4, (row, length, draft, best)
    assert len(first_drafts) >= 8 * 5
