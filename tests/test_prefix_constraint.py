"""`generate(prefix_allowed_tokens_fn=...)` under speculation: every verified position asks the function
for its own prefix and batch row (`sampling/prefix_constraint.py`), compared with plain `generate()`.

The constraint used is the common one (GENRE's entity retrieval): a trie of allowed continuations per
batch row that has no answer (an empty list) off the trie. Drafts leave the trie all the time, so a
position after a forbidden draft must never be asked about."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    FIRST_WORD_ID,
    VOCAB_SIZE,
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    new_tokens,
    ngram_config,
    plain_generate,
    repeated_span_prompts,
)
from test_sampling_distribution import chi_square_pvalue, exact_distribution, speculative_samples
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

import hf_specdec
from hf_specdec import SpeculativeEngine
from hf_specdec.sampling.prefix_constraint import SpeculativePrefixConstraint

MAX_NEW_TOKENS = 24


class Trie:
    """`prefix_allowed_tokens_fn` over per-row allowed continuations after `prompt_width` columns:
    the next tokens of the continuations the generated tokens start, anything once one is complete,
    nothing off the trie. Counts the calls it gets off the trie."""

    def __init__(self, continuations: list[list[list[int]]], prompt_width: int):
        self.continuations, self.prompt_width, self.off_trie = continuations, prompt_width, 0

    def __call__(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        generated = input_ids[self.prompt_width :].tolist()
        allowed = set()
        for continuation in self.continuations[batch_id]:
            if generated[: len(continuation)] == continuation[: len(generated)]:
                if len(generated) >= len(continuation):
                    return list(range(VOCAB_SIZE))
                allowed.add(continuation[len(generated)])
        self.off_trie += not allowed
        return sorted(allowed)


def greedy_continuations(model, inputs: dict, length: int) -> list[list[int]]:
    out = plain_generate(model, **inputs, max_new_tokens=length, do_sample=False, pad_token_id=0)
    return new_tokens(out, inputs["input_ids"].shape[1]).tolist()


def trie_for(model, inputs: dict, seed: int = 0) -> Trie:
    """Per row: the row's own greedy continuation leaving it at token 6 for random tokens, and at token 2 for
    random tokens then the continuation again; the output follows the model where the trie lets it (drafts
    do not), then leaves it."""
    rng = np.random.default_rng(seed)
    tries = []
    for greedy in greedy_continuations(model, inputs, MAX_NEW_TOKENS):
        random = lambda n: rng.integers(FIRST_WORD_ID, VOCAB_SIZE, n).tolist()  # noqa: E731
        tries.append([greedy[:6] + random(10), greedy[:2] + random(6) + greedy[2:8]])
    return Trie(tries, inputs["input_ids"].shape[1])


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(build_tiny_llama())


CONFIGS = {
    "ngram": ngram_config(k=5),
    "draft_model": "copy",
    "draft_model_tree": {"num_nodes": 10, "topk": 3},
}


def config_for(name: str, target) -> dict:
    if name == "ngram":
        return CONFIGS[name]
    draft = copy.deepcopy(target)  # the target's own continuation: long accepted runs until the trie turns away
    tree = CONFIGS[name] if name == "draft_model_tree" else None
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "tree": tree}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_plain_generate_with_a_trie_per_row(target, name):
    inputs = left_padded_batch(repeated_span_prompts(3, seed=7))
    trie = trie_for(target, inputs)
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0, prefix_allowed_tokens_fn=trie)
    plain = plain_generate(target, **inputs, **kwargs)
    assert trie.off_trie == 0
    out = target.generate(**inputs, **kwargs, return_dict_in_generate=True, speculative_config=config_for(name, target))
    assert torch.equal(out.sequences, plain)
    assert trie.off_trie == 0, "asked about a position after a forbidden draft"
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] > 0
    # the draft model's chain is the target's own choice, cut where the trie turns away: all of it accepted
    assert (metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]) == (name == "draft_model")
    # the constraint binds every row: the output is not the model's own
    generated = new_tokens(plain, inputs["input_ids"].shape[1]).tolist()
    assert all(g != own for g, own in zip(generated, greedy_continuations(target, inputs, MAX_NEW_TOKENS)))


def test_the_batch_index_given_is_the_rows_own(target, monkeypatch):
    """Asked as batch ID 0 whatever the row (the engine's convention, wrong in a batch), rows 1 and 2 follow
    row 0's trie."""
    inputs = left_padded_batch(repeated_span_prompts(3, seed=7))
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0, prefix_allowed_tokens_fn=trie_for(target, inputs))
    plain = plain_generate(target, **inputs, **kwargs)
    original = SpeculativePrefixConstraint.allowed
    monkeypatch.setattr(SpeculativePrefixConstraint, "allowed", lambda self, batch_id, prefix: original(self, 0, prefix))
    out = target.generate(**inputs, **kwargs, speculative_config=ngram_config(k=5))
    assert torch.equal(out[0], plain[0]) and not torch.equal(out[1:], plain[1:])


def test_an_unsatisfiable_constraint_forces_its_tokens_as_plain_generate_does(target):
    """Only EOS allowed from the 3rd new token while min_new_tokens bans it: transformers forces EOS anyway."""
    inputs = left_padded_batch(repeated_span_prompts(2, seed=3))
    width = inputs["input_ids"].shape[1]

    def eos_from_third(batch_id, input_ids):
        return [EOS_TOKEN_ID] if len(input_ids) - width >= 2 + batch_id else list(range(FIRST_WORD_ID, VOCAB_SIZE))

    kwargs = dict(max_new_tokens=10, min_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=EOS_TOKEN_ID,
                  prefix_allowed_tokens_fn=eos_from_third)  # fmt: skip
    plain = plain_generate(target, **inputs, **kwargs)
    assert (plain[:, width + 2 : width + 4] == EOS_TOKEN_ID).any()
    out = target.generate(**inputs, **kwargs, speculative_config=ngram_config(k=5))
    assert torch.equal(out, plain)


def test_an_empty_answer_for_the_next_token_raises_as_plain_generate_does(target):
    inputs = left_padded_batch(repeated_span_prompts(1, seed=3))
    width = inputs["input_ids"].shape[1]

    def nothing_after_four(batch_id, input_ids):
        return [] if len(input_ids) - width >= 4 else list(range(VOCAB_SIZE))

    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, prefix_allowed_tokens_fn=nothing_after_four)
    with pytest.raises(ValueError, match="returned an empty list for batch ID 0"):
        plain_generate(target, **inputs, **kwargs)
    with pytest.raises(ValueError, match="returned an empty list for batch ID 0"):
        target.generate(**inputs, **kwargs, speculative_config=ngram_config(k=5))


def test_several_sequences_per_prompt_are_refused(target):
    inputs = left_padded_batch(repeated_span_prompts(1, seed=3))
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        target.generate(
            **inputs, max_new_tokens=4, do_sample=True, num_return_sequences=2, pad_token_id=0,
            prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(VOCAB_SIZE)), speculative_config=ngram_config(),
        )  # fmt: skip
    engine = SpeculativeEngine(target, ngram_config())  # a request's own processor, built for 2 sequences
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor built for 2 sequences per prompt"):
        engine.add_request([5, 6, 7], {"max_new_tokens": 4}, logits_processor=[PrefixConstrainedLogitsProcessor(lambda b, ids: [5], 2)])
    assert engine.num_waiting == 0


def test_engine_requests_each_with_its_own_constraint(target):
    """A request's `PrefixConstrainedLogitsProcessor` is asked as batch ID 0, with the request's tokens."""
    prompts = repeated_span_prompts(3, seed=7)
    engine = SpeculativeEngine(target, ngram_config(k=5))
    expected, ids = [], []
    for prompt in prompts:
        inputs = left_padded_batch([prompt])
        trie = trie_for(target, inputs)
        kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(new_tokens(plain_generate(target, **inputs, **kwargs, prefix_allowed_tokens_fn=trie), len(prompt))[0].tolist())
        processor = PrefixConstrainedLogitsProcessor(trie, 1)
        ids.append(engine.add_request(prompt, kwargs, logits_processor=[processor]))
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [finished[i] for i in ids] == expected


# --- sampling: the constrained distribution, chi-square against the enumerated one ------------------------

SMALL_VOCAB = 16


def no_repeat_of_neighbours(batch_id: int, input_ids: torch.Tensor) -> list[int]:
    """Neither the last token nor the one after it (mod 16) again: depends on every prefix."""
    last = int(input_ids[-1])
    return [t for t in range(SMALL_VOCAB) if t not in (last, (last + 1) % SMALL_VOCAB)]


@pytest.mark.parametrize("drafter", ("ngram", "draft_model"))
def test_sampling_follows_the_constrained_distribution(drafter, monkeypatch):
    """n-gram drafts are cut at a forbidden one; a draft model's sampled drafts are not, and are rejected.
    With the draft model (the target's copy: most drafts accepted, most positions behind drafts), asking
    every position with the row's own tokens (the drafts before it left out) fails."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = dict(temperature=1.0, prefix_allowed_tokens_fn=no_repeat_of_neighbours)
    exact = exact_distribution(model, sampling)
    config = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if drafter == "ngram" else {"method": "draft_model", "model": copy.deepcopy(model), "num_speculative_tokens": 3}
    )  # fmt: skip
    samples, metrics = speculative_samples(model, sampling, config, num_samples=3000, seed=99)
    assert sum(m["num_accepted_tokens"] for m in metrics) > (100 if drafter == "ngram" else 3000)
    assert chi_square_pvalue(samples, exact) > 1e-3
    if drafter == "ngram":  # 169 drafts accepted: too few positions behind them for the broken variant to fail
        return
    original = SpeculativePrefixConstraint.process

    def drafts_left_out(self, scores, token_buffer, buffer_rows, prefix_lens, batch_rows):
        shortest = prefix_lens.copy()
        for row in np.unique(batch_rows):
            shortest[batch_rows == row] = prefix_lens[batch_rows == row].min()
        return original(self, scores, token_buffer, buffer_rows, shortest, batch_rows)

    monkeypatch.setattr(SpeculativePrefixConstraint, "process", drafts_left_out)
    broken, _ = speculative_samples(model, sampling, config, num_samples=500, seed=99)
    assert chi_square_pvalue(broken, exact) < 1e-3
