"""Greedy speculative decoding must reproduce plain greedy generate() token for token."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_tiny_llama,
    new_tokens,
    ngram_config,
    plain_generate,
    repeated_span_batch,
)
from transformers import LogitsProcessor, LogitsProcessorList

import hf_specdec
from hf_specdec.sampling.penalties import OutputTokenPenalties

BATCH_SIZES = (1, 3, 8)
NUM_SPECULATIVE_TOKENS = (1, 3, 5, 8)
LOOKUP_RANGES = ((1, 1), (1, 4), (2, 5), (3, 3))


@pytest.mark.parametrize("lookup_min,lookup_max", LOOKUP_RANGES)
@pytest.mark.parametrize("k", NUM_SPECULATIVE_TOKENS)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_matches_plain_generate(enabled_llama, batch_size, k, lookup_min, lookup_max):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    max_new_tokens = 30 + 6 * (k % 4) + batch_size % 5  # 30..48, varied over the grid
    plain = plain_generate(model, **inputs, max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        speculative_config=ngram_config(k, lookup_min, lookup_max),
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == plain.shape
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] > 0, (
        "the n-gram drafter was never accepted: the test proves nothing"
    )
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"], "no draft was ever rejected"
    # every drafted step drafts at most k tokens and accepts a leading run of them
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]
    assert len(metrics["num_accepted_tokens_per_pos"]) <= k
    assert sum(metrics["num_accepted_tokens_per_pos"]) == metrics["num_accepted_tokens"]
    per_pos = metrics["num_accepted_tokens_per_pos"]
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    assert metrics["mean_acceptance_length"] == pytest.approx(
        1 + metrics["num_accepted_tokens"] / metrics["num_drafts"]
    )
    # emitted tokens are exactly the non-padding new tokens of the result
    generated = new_tokens(plain, inputs["input_ids"].shape[1])
    assert metrics["num_emitted_tokens"] == _count_generated(generated)
    # one forward per step; each step emits at most accepted + 1 tokens per row
    assert metrics["num_target_forwards"] <= max_new_tokens
    if batch_size == 1:  # the accepted drafts saved target passes
        assert metrics["num_target_forwards"] < max_new_tokens
        assert (
            metrics["num_emitted_tokens"] <= metrics["num_target_forwards"] + metrics["num_accepted_tokens"]
        )


def _count_generated(generated: torch.Tensor) -> int:
    """New tokens per row up to and including the first EOS (what plain generate really produced)."""
    total = 0
    for row in generated.tolist():
        count = len(row)
        if EOS_TOKEN_ID in row:
            count = row.index(EOS_TOKEN_ID) + 1
        total += count
    return total


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_custom_generate_entry_point_matches_plain(tiny_llama, batch_size):
    """`custom_generate=hf_specdec.generate` works on an unpatched model, identically."""
    model = tiny_llama
    inputs = repeated_span_batch(batch_size)
    plain = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config=ngram_config(5, 1, 4),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    # the same call through enable() gives the same tokens and the same metrics counters
    hf_specdec.enable(model)
    enabled = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=ngram_config(5, 1, 4),
        return_dict_in_generate=True,
    )
    assert torch.equal(enabled.sequences, plain)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert enabled.spec_metrics[key] == out.spec_metrics[key], key


def test_config_forms_are_equivalent(enabled_llama):
    """dict, JSON string and SpeculativeConfig describe the same run."""
    model = enabled_llama
    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=32, do_sample=False)
    forms = [
        ngram_config(4, 2, 3),
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}',
        hf_specdec.SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3),
    ]
    results = [
        model.generate(
            **inputs,
            max_new_tokens=32,
            do_sample=False,
            speculative_config=form,
            return_dict_in_generate=True,
        )
        for form in forms
    ]
    for result in results:
        assert torch.equal(result.sequences, plain)
        assert result.spec_metrics["num_draft_tokens"] == results[0].spec_metrics["num_draft_tokens"]
        assert result.spec_metrics["num_accepted_tokens"] == results[0].spec_metrics["num_accepted_tokens"]


def test_unpadded_single_row_without_attention_mask(enabled_llama):
    model = enabled_llama
    input_ids = repeated_span_batch(1)["input_ids"]
    plain = plain_generate(model, input_ids=input_ids, max_new_tokens=36, do_sample=False)
    out = model.generate(
        input_ids=input_ids, max_new_tokens=36, do_sample=False, speculative_config=ngram_config(8)
    )
    assert torch.equal(out, plain)


def test_cumulative_metrics_on_model(enabled_llama):
    model = enabled_llama
    assert not isinstance(getattr(model, "spec_decode_metrics", None), hf_specdec.SpecDecodeMetrics)
    per_call = []
    for batch_size in (1, 3):
        out = model.generate(
            **repeated_span_batch(batch_size),
            max_new_tokens=30,
            do_sample=False,
            speculative_config=ngram_config(3),
            return_dict_in_generate=True,
        )
        per_call.append(out.spec_metrics)
    total = model.spec_decode_metrics
    assert isinstance(total, hf_specdec.SpecDecodeMetrics)
    for key in (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_emitted_tokens",
        "num_target_forwards",
    ):
        assert getattr(total, key) == per_call[0][key] + per_call[1][key], key
    longest = max(len(m["num_accepted_tokens_per_pos"]) for m in per_call)
    expected = [
        sum(
            m["num_accepted_tokens_per_pos"][i] if i < len(m["num_accepted_tokens_per_pos"]) else 0
            for m in per_call
        )
        for i in range(longest)
    ]
    assert total.num_accepted_tokens_per_pos == expected
    assert total.num_accepted_tokens > 0


def test_disable_by_batch_size_turns_drafting_off(enabled_llama):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        speculative_config=ngram_config(5, disable_by_batch_size=3),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    # while all three rows run no row drafts; the rows here all run to max_new_tokens together
    assert out.spec_metrics["num_draft_tokens"] == 0
    assert out.spec_metrics["num_target_forwards"] == 30


# --- enabling does not change plain generate ---------------------------------------------------


def _plain_calls(model, inputs):
    torch.manual_seed(123)
    greedy = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    scored = model.generate(
        **inputs, max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    torch.manual_seed(7)
    sampled = model.generate(**inputs, max_new_tokens=16, do_sample=True, top_k=20, temperature=0.9)
    return greedy, scored, sampled


def test_enable_without_speculative_config_is_plain_generate():
    inputs = repeated_span_batch(3)
    before = _plain_calls(build_tiny_llama(), inputs)
    model = hf_specdec.enable(build_tiny_llama())
    after = _plain_calls(model, inputs)
    assert torch.equal(before[0], after[0])
    assert torch.equal(before[1].sequences, after[1].sequences)
    assert not hasattr(after[1], "spec_metrics") or after[1].spec_metrics is None
    assert len(before[1].scores) == len(after[1].scores)
    for a, b in zip(before[1].scores, after[1].scores, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(before[2], after[2])
    # explicit None is the same as leaving it out
    torch.manual_seed(123)
    assert torch.equal(
        model.generate(**inputs, max_new_tokens=20, do_sample=False, speculative_config=None), before[0]
    )
    # and plain generate does not speculate
    assert getattr(model, "spec_decode_metrics", None) is None


def test_disable_restores_original_generate(tiny_llama):
    model = tiny_llama
    original_func = model.generate.__func__
    assert "generate" not in vars(model)
    hf_specdec.enable(model)
    patched = model.generate
    assert "generate" in vars(model)
    hf_specdec.enable(model)  # idempotent: no double wrapping
    assert model.generate is patched
    hf_specdec.disable(model)
    assert "generate" not in vars(model)
    assert model.generate.__func__ is original_func
    inputs = repeated_span_batch(1)
    with pytest.raises(ValueError, match="speculative_config"):
        model.generate(**inputs, max_new_tokens=5, speculative_config=ngram_config())
    hf_specdec.disable(model)  # disabling twice is harmless
    assert model.generate.__func__ is original_func


def test_custom_generate_and_speculative_config_together_rejected(enabled_llama):
    """Another loop as custom_generate cannot run with speculative_config; hf_specdec.generate can
    (tests/test_enabled_custom_generate.py)."""

    def other_loop(model, input_ids, **kwargs):
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match="custom_generate.*hf_specdec.generate"):
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=5,
            custom_generate=other_loop,
            speculative_config=ngram_config(),
        )


# --- scores / logits ---------------------------------------------------------------------------


def _eos_inside_output(model, inputs, row: int, min_position: int) -> int:
    """A token plain greedy emits for `row` first at or after `min_position` (so rows end at different steps)."""
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    generated = new_tokens(plain, inputs["input_ids"].shape[1])[row].tolist()
    for position in range(min_position, len(generated)):
        token = generated[position]
        if token not in generated[:position] and token not in (PAD_TOKEN_ID, EOS_TOKEN_ID):
            return token
    raise AssertionError("no suitable token in the plain output")


def _active_steps(generated: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[steps, batch] bool: the row was still generating at that step (the EOS step included)."""
    is_eos = torch.isin(generated, torch.tensor(eos_ids))
    finished_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~finished_before).T


@pytest.mark.parametrize("k", (2, 6))
def test_scores_and_logits_match_plain(enabled_llama, k):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    width = inputs["input_ids"].shape[1]
    eos = _eos_inside_output(model, inputs, row=1, min_position=12)
    kwargs = dict(
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=[EOS_TOKEN_ID, eos],
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        sequence_bias={(5,): 0.75, (7,): -0.5, (9, 11): 1.0},  # makes scores differ from logits
    )
    plain = plain_generate(model, **inputs, **kwargs)
    out = model.generate(**inputs, **kwargs, speculative_config=ngram_config(k, 1, 3))
    assert torch.equal(out.sequences, plain.sequences)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    generated = new_tokens(plain.sequences, width)
    active = _active_steps(generated, [EOS_TOKEN_ID, eos])
    assert not active.all(), "every row ran to the end: the finished-row case is not exercised"
    assert active[:, 1].sum() < active.shape[0]
    assert len(out.scores) == len(plain.scores) == generated.shape[1]
    assert len(out.logits) == len(plain.logits) == generated.shape[1]
    for step in range(generated.shape[1]):
        rows = active[step]
        assert out.scores[step].shape == plain.scores[step].shape
        torch.testing.assert_close(out.scores[step][rows], plain.scores[step][rows], atol=1e-4, rtol=0)
        torch.testing.assert_close(out.logits[step][rows], plain.logits[step][rows], atol=1e-4, rtol=0)
        # the emitted token is the argmax of its scores row (greedy)
        assert torch.equal(out.scores[step][rows].argmax(-1), generated[rows, step])
    assert not torch.equal(torch.stack(out.scores), torch.stack(out.logits))


# --- logits processors -------------------------------------------------------------------------


def _processor_kwargs(generated: list[int]) -> dict[str, dict]:
    """Processor options built from tokens plain greedy emits for row 0, so each one bites."""
    first, second, third = generated[2], generated[3], generated[5]
    return {
        "repetition_penalty": {"repetition_penalty": 1.5},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 4},
        "min_new_tokens": {"min_new_tokens": 15, "eos_token_id": [EOS_TOKEN_ID, generated[6]]},
        "bad_words_ids": {"bad_words_ids": [[first], [second, third]]},
        "sequence_bias": {"sequence_bias": {(second,): -20.0, (first, third): 10.0}},
        "encoder_repetition_penalty": {"encoder_repetition_penalty": 10.0},  # boosts the prompt (a decoder-only model's source)
        "combined": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "bad_words_ids": [[second]]},
    }


# transformers builds repetition_penalty's processor with one prompt-ignore length per batch row and
# encoder_repetition_penalty's with one prompt per row; processors are called with rows regrouped by
# prefix length, so batch 4 checks that regrouping.
PROCESSOR_CASES = [
    pytest.param(name, batch_size)
    for batch_size in (1, 4)
    for name in (
        "repetition_penalty",
        "no_repeat_ngram_size",
        "min_new_tokens",
        "bad_words_ids",
        "sequence_bias",
        "encoder_repetition_penalty",
    )
] + [pytest.param("combined", 1), pytest.param("combined", 4)]


@pytest.mark.parametrize("processor,batch_size", PROCESSOR_CASES)
def test_logits_processors_greedy_identity(enabled_llama, processor, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    width = inputs["input_ids"].shape[1]
    baseline = plain_generate(model, **inputs, max_new_tokens=36, do_sample=False)
    options = _processor_kwargs(new_tokens(baseline, width)[0].tolist())[processor]
    plain = plain_generate(model, **inputs, max_new_tokens=36, do_sample=False, **options)
    assert not torch.equal(plain, baseline), f"{processor} did not change the output: the test proves nothing"
    for k, lookup in ((3, (1, 4)), (8, (1, 2))):
        out = model.generate(
            **inputs,
            max_new_tokens=36,
            do_sample=False,
            speculative_config=ngram_config(k, *lookup),
            return_dict_in_generate=True,
            **options,
        )
        assert torch.equal(out.sequences, plain), (processor, k)
        assert out.spec_metrics["num_draft_tokens"] > 0
    # with a copying processor on top most drafts are accepted: the built-in processor must then
    # see each accepted draft in its prefix
    boosted = dict(max_new_tokens=36, do_sample=False, **options)
    plain = plain_generate(
        model, **inputs, **boosted, logits_processor=LogitsProcessorList([InductionBoost()])
    )
    out = model.generate(
        **inputs,
        **boosted,
        logits_processor=LogitsProcessorList([InductionBoost()]),
        speculative_config=ngram_config(5, 1, 2),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain), processor
    assert out.spec_metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("batch_size", (1, 4))
def test_output_token_penalties_greedy_identity(enabled_llama, batch_size):
    """OpenAI's presence / frequency penalties: each verified position counts the accepted drafts
    before it among the generated tokens (left-padded rows: the prompt is the input's width)."""
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    penalties = LogitsProcessorList([OutputTokenPenalties(0.3, 0.2, prompt_width=inputs["input_ids"].shape[1])])
    baseline = plain_generate(model, **inputs, max_new_tokens=36, do_sample=False)
    plain = plain_generate(model, **inputs, max_new_tokens=36, do_sample=False, logits_processor=penalties)
    assert not torch.equal(plain, baseline), "the penalties did not change the output: the test proves nothing"
    for k, lookup in ((3, (1, 4)), (8, (1, 2))):
        out = model.generate(
            **inputs, max_new_tokens=36, do_sample=False, logits_processor=penalties,
            speculative_config=ngram_config(k, *lookup), return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, plain), k
        assert out.spec_metrics["num_accepted_tokens"] > 0


class InductionBoost(LogitsProcessor):
    """Boosts the token that followed the most recent earlier occurrence of the last token.

    It reads the whole prefix, so each verify position must see the row's tokens plus the drafts
    before it; and it makes the output copy itself, so many drafts are accepted.
    """

    def __init__(self, boost: float = 3.0):
        self.boost = boost
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            last = ids[-1]
            for position in range(len(ids) - 2, -1, -1):
                if ids[position] == last:
                    scores[row, ids[position + 1]] += self.boost
                    break
        return scores


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_custom_prefix_dependent_logits_processor(enabled_llama, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(
        model,
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        logits_processor=LogitsProcessorList([InductionBoost()]),
    )
    baseline = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    assert not torch.equal(plain, baseline)
    for k, lookup in ((4, (1, 3)), (8, (2, 2))):
        processor = InductionBoost()
        out = model.generate(
            **inputs,
            max_new_tokens=40,
            do_sample=False,
            logits_processor=LogitsProcessorList([processor]),
            speculative_config=ngram_config(k, *lookup),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain), k
        metrics = out.spec_metrics
        assert metrics["num_accepted_tokens"] >= metrics["num_emitted_tokens"] // 4, metrics
        assert processor.calls > 0
