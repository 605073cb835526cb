"""Stopping: EOS (also inside an accepted draft span), max / min new tokens, stop strings, custom
criteria, streamers, and padding of rows that finish early, always compared with plain generate."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    left_padded_batch,
    new_tokens,
    ngram_config,
    plain_generate,
    repeated_span_batch,
    repeated_span_prompts,
)
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec.loop import engine


class StepRecorder:
    """Wraps `engine.speculative_step`: per step, the (row, emitted tokens) pairs."""

    def __init__(self, monkeypatch):
        self.steps: list[list[tuple[int, list[int]]]] = []
        original = engine.speculative_step

        def recording_step(*args, **kwargs):
            emitted = original(*args, **kwargs)
            self.steps.append([(row, tokens.tolist()) for row, tokens, _, _ in emitted])
            return emitted

        monkeypatch.setattr(engine, "speculative_step", recording_step)

    def spans(self, row: int) -> list[list[int]]:
        return [tokens for step in self.steps for r, tokens in step if r == row]


@pytest.fixture
def recorder(monkeypatch):
    return StepRecorder(monkeypatch)


def replay_prompt(model, seed: int, continuation: int = 12) -> list[int]:
    """prompt + the model's own greedy continuation + prompt again: the model tends to replay the
    continuation, and the drafter finds it in the prompt, so accepted drafts carry tokens that were
    not generated before (candidates for an EOS inside an accepted span)."""
    prompt = repeated_span_prompts(1, seed)[0]
    inputs = left_padded_batch([prompt])
    generated = plain_generate(model, **inputs, max_new_tokens=continuation, do_sample=False)[0].tolist()
    return generated + prompt


def eos_inside_accepted_span(spans: list[list[int]]) -> tuple[int, int] | None:
    """(token, position) of a token that was emitted as an accepted draft with more tokens after it in
    the same step, and that the row had not generated before; None when there is none."""
    position = 0
    generated: list[int] = []
    for span in spans:
        for j, token in enumerate(span[:-1]):  # span[-1] is the bonus / recovered token
            if (
                len(span) >= 2
                and token not in generated + span[:j]
                and token not in (PAD_TOKEN_ID, EOS_TOKEN_ID)
            ):
                return token, position + j
        generated += span
        position += len(span)
    return None


REPLAY_SEEDS = (104, 105, 106, 112, 119, 129, 136, 138, 140, 141)


def test_eos_inside_accepted_span_single_row(enabled_llama, recorder):
    model = enabled_llama
    config = ngram_config(4, 1, 4)
    for seed in REPLAY_SEEDS:
        inputs = left_padded_batch([replay_prompt(model, seed)])
        recorder.steps.clear()
        model.generate(**inputs, max_new_tokens=30, do_sample=False, speculative_config=config)
        found = eos_inside_accepted_span(recorder.spans(0))
        if found is not None:
            break
    assert found is not None, "no prompt put a fresh token inside an accepted span"
    eos, position = found
    width = inputs["input_ids"].shape[1]
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    recorder.steps.clear()
    out = model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        speculative_config=config,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    generated = new_tokens(out.sequences, width)[0].tolist()
    assert len(generated) == position + 1 and generated[-1] == eos
    # the last step accepted drafts past the EOS: they were dropped, not emitted
    metrics = out.spec_metrics
    assert metrics["num_emitted_tokens"] == position + 1
    assert metrics["num_target_forwards"] + metrics["num_accepted_tokens"] > metrics["num_emitted_tokens"]
    assert recorder.spans(0)[-1][-1] == eos


def test_eos_inside_accepted_span_batched(enabled_llama, recorder):
    """Several rows, each with its own EOS from an accepted span (eos_token_id as a list)."""
    model = enabled_llama
    config = ngram_config(4, 1, 4)
    prompts = [replay_prompt(model, seed) for seed in REPLAY_SEEDS[:4]]
    inputs = left_padded_batch(prompts)
    width = inputs["input_ids"].shape[1]
    model.generate(**inputs, max_new_tokens=30, do_sample=False, speculative_config=config)
    candidates = [eos_inside_accepted_span(recorder.spans(row)) for row in range(len(prompts))]
    eos_ids = [EOS_TOKEN_ID] + sorted({c[0] for c in candidates if c is not None})
    assert len(eos_ids) >= 3, candidates
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos_ids)
    out = model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos_ids,
        speculative_config=config,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    generated = new_tokens(out.sequences, width)
    _assert_padded_after_eos(generated, eos_ids)
    stopped_early = [row for row in range(len(prompts)) if generated[row, -1] == PAD_TOKEN_ID]
    assert stopped_early, "no row finished before the others"


def _assert_padded_after_eos(generated: torch.Tensor, eos_ids: list[int]) -> None:
    for row in generated.tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        if ends:
            assert all(token == PAD_TOKEN_ID for token in row[ends[0] + 1 :]), row


def _token_first_at(generated: list[int], start: int) -> int:
    for position in range(start, len(generated)):
        token = generated[position]
        if token not in generated[:position] and token not in (PAD_TOKEN_ID, EOS_TOKEN_ID):
            return token
    raise AssertionError(f"no fresh token after position {start} in {generated}")


@pytest.mark.parametrize("k", (2, 5, 8))
def test_eos_list_rows_finish_at_different_steps(enabled_llama, k):
    model = enabled_llama
    inputs = repeated_span_batch(8)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=40, do_sample=False), width)
    eos_ids = [_token_first_at(baseline[0].tolist(), 8), _token_first_at(baseline[5].tolist(), 20)]
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False, eos_token_id=eos_ids)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=eos_ids,
        speculative_config=ngram_config(k, 1, 4),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    generated = new_tokens(out.sequences, width)
    lengths = [(row != PAD_TOKEN_ID).sum().item() for row in generated]
    assert len(set(lengths)) >= 2, lengths  # rows really finished at different steps
    assert min(lengths) < generated.shape[1]
    _assert_padded_after_eos(generated, eos_ids)


def test_padding_uses_pad_token_id(enabled_llama):
    """A pad_token_id other than 0: finished rows are filled with it, as plain generate does."""
    model = enabled_llama
    inputs = repeated_span_batch(3)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=30, do_sample=False), width)
    eos = _token_first_at(baseline[0].tolist(), 5)
    pad = 126
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    plain = plain_generate(model, **inputs, **kwargs)
    out = model.generate(**inputs, **kwargs, speculative_config=ngram_config(5))
    assert torch.equal(out, plain)
    assert new_tokens(out, width)[0, -1].item() == pad


@pytest.mark.parametrize("batch_size", (1, 3))
def test_max_new_tokens_reached_mid_span(enabled_llama, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    width = inputs["input_ids"].shape[1]
    config = ngram_config(8, 1, 4)
    full = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    for max_new_tokens in range(1, 25):
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            speculative_config=config,
            return_dict_in_generate=True,
        )
        assert out.sequences.shape[1] - width <= max_new_tokens
        assert torch.equal(out.sequences, full[:, : width + max_new_tokens]), max_new_tokens
        assert out.spec_metrics["num_emitted_tokens"] == batch_size * max_new_tokens


def test_max_length_instead_of_max_new_tokens(enabled_llama):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    max_length = inputs["input_ids"].shape[1] + 17
    plain = plain_generate(model, **inputs, max_length=max_length, do_sample=False)
    out = model.generate(**inputs, max_length=max_length, do_sample=False, speculative_config=ngram_config(8))
    assert out.shape[1] == max_length
    assert torch.equal(out, plain)


@pytest.mark.parametrize("batch_size", (1, 4))
def test_min_new_tokens_delays_eos(enabled_llama, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=40, do_sample=False), width)
    eos = _token_first_at(baseline[0].tolist(), 3)
    early = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False, eos_token_id=eos)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, min_new_tokens=12)
    plain = plain_generate(model, **inputs, **kwargs)
    assert not torch.equal(plain, early)
    for k in (3, 8):
        out = model.generate(**inputs, **kwargs, speculative_config=ngram_config(k, 1, 4))
        assert torch.equal(out, plain), k
    generated = new_tokens(plain, width)[0].tolist()
    assert eos not in generated[:12]


# --- stop strings ------------------------------------------------------------------------------


def _stop_string_cases(generated: list[int]) -> dict[str, list[str]]:
    a, b = generated[9], generated[10]
    return {
        "one_token": [f"w{a}"],
        "two_tokens": [f"w{a}w{b}"],
        "overhanging": [f"{str(a)[-1]}w{str(b)[0]}"],  # starts inside token a, ends inside token b
        "several": ["never-generated", f"w{b}w{generated[11]}w{generated[12]}"],
    }


@pytest.mark.parametrize("case", ("one_token", "two_tokens", "overhanging", "several"))
@pytest.mark.parametrize("batch_size", (1, 3))
def test_stop_strings(enabled_llama, word_tokenizer, case, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=36, do_sample=False), width)
    stop_strings = _stop_string_cases(baseline[0].tolist())[case]
    kwargs = dict(max_new_tokens=36, do_sample=False, stop_strings=stop_strings, tokenizer=word_tokenizer)
    plain = plain_generate(model, **inputs, **kwargs)
    assert plain.shape[1] - width < 36 or (new_tokens(plain, width) == PAD_TOKEN_ID).any(), (
        "stop string never hit"
    )
    out = model.generate(**inputs, **kwargs, speculative_config=ngram_config(5, 1, 3))
    assert torch.equal(out, plain)


def test_stop_strings_without_tokenizer_is_an_error(enabled_llama):
    with pytest.raises(ValueError, match="tokenizer"):
        enabled_llama.generate(
            **repeated_span_batch(1), max_new_tokens=5, stop_strings=["w5"], speculative_config=ngram_config()
        )


# --- custom stopping criteria ------------------------------------------------------------------


class StopOnLastToken(StoppingCriteria):
    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


class StopOnBigram(StoppingCriteria):
    def __init__(self, first: int, second: int):
        self.first, self.second = first, second

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -2] == self.first) & (input_ids[:, -1] == self.second)


class StopAfterNewTokens(StoppingCriteria):
    """Length-based, but not a MaxLengthCriteria: it must be checked after every emitted token."""

    def __init__(self, prompt_width: int, count: int):
        self.limit = prompt_width + count

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, dtype=torch.bool)


def _bigram_first_at(generated: list[int], start: int) -> tuple[int, int]:
    seen = set(zip(generated[:start], generated[1 : start + 1], strict=True))
    for position in range(start, len(generated) - 1):
        bigram = (generated[position], generated[position + 1])
        if bigram not in seen:
            return bigram
        seen.add(bigram)
    raise AssertionError(f"no fresh bigram after position {start} in {generated}")


@pytest.mark.parametrize("criterion", ("last_token", "bigram", "after_new_tokens"))
@pytest.mark.parametrize("batch_size", (1, 4))
def test_custom_stopping_criteria(enabled_llama, criterion, batch_size):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=36, do_sample=False), width)
    row0 = baseline[0].tolist()
    make = {
        "last_token": lambda: StopOnLastToken([_token_first_at(row0, 10)]),
        "bigram": lambda: StopOnBigram(*_bigram_first_at(row0, 24)),
        "after_new_tokens": lambda: StopAfterNewTokens(width, 23),
    }[criterion]
    plain = plain_generate(
        model, **inputs, max_new_tokens=36, do_sample=False, stopping_criteria=StoppingCriteriaList([make()])
    )
    assert (new_tokens(plain, width)[0] == PAD_TOKEN_ID).any() or plain.shape[1] - width < 36, (
        "the criterion never stopped plain generate"
    )
    for k in (3, 8):
        out = model.generate(
            **inputs,
            max_new_tokens=36,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([make()]),
            speculative_config=ngram_config(k, 1, 4),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain), k
        assert out.spec_metrics["num_accepted_tokens"] > 0


# --- streamers ---------------------------------------------------------------------------------


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.values: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        assert self.ended == 0, "put() after end()"
        self.values.append(value.detach().clone())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("stop", ("max_new_tokens", "eos"))
def test_streamer_receives_prompt_then_emitted_tokens(enabled_llama, stop):
    model = enabled_llama
    inputs = repeated_span_batch(1)
    width = inputs["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=32, do_sample=False)
    if stop == "eos":
        baseline = new_tokens(plain_generate(model, **inputs, **kwargs), width)[0].tolist()
        kwargs["eos_token_id"] = _token_first_at(baseline, 15)
    plain_streamer = CollectingStreamer()
    plain = plain_generate(model, **inputs, **kwargs, streamer=plain_streamer)
    streamer = CollectingStreamer()
    out = model.generate(**inputs, **kwargs, streamer=streamer, speculative_config=ngram_config(5, 1, 4))
    assert torch.equal(out, plain)
    assert streamer.ended == 1
    assert torch.equal(streamer.values[0], inputs["input_ids"])
    streamed = torch.cat([value.flatten() for value in streamer.values[1:]])
    assert torch.equal(streamed, new_tokens(out, width)[0])
    # the same stream plain generate produces
    assert torch.equal(streamed, torch.cat([value.flatten() for value in plain_streamer.values[1:]]))
    if stop == "eos":
        assert streamed[-1].item() == kwargs["eos_token_id"] and len(streamed) < 32


def test_streamer_through_custom_generate_entry_point(tiny_llama):
    """transformers drops `streamer` for custom_generate callables; `speculative_streamer` carries it."""
    model = tiny_llama
    inputs = repeated_span_batch(1)
    streamer = CollectingStreamer()
    out = model.generate(
        **inputs,
        max_new_tokens=20,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config=ngram_config(4),
        speculative_streamer=streamer,
    )
    assert streamer.ended == 1
    assert torch.equal(streamer.values[0], inputs["input_ids"])
    streamed = torch.cat([value.flatten() for value in streamer.values[1:]])
    assert torch.equal(streamed, new_tokens(out, inputs["input_ids"].shape[1])[0])


def test_streamer_with_batch_rejected(enabled_llama):
    streamer = CollectingStreamer()
    with pytest.raises(ValueError, match="batch size 1"):
        enabled_llama.generate(
            **repeated_span_batch(3), max_new_tokens=5, streamer=streamer, speculative_config=ngram_config()
        )
    assert streamer.values == []


def test_eos_as_first_new_token(enabled_llama):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    width = inputs["input_ids"].shape[1]
    first = plain_generate(model, **inputs, max_new_tokens=1, do_sample=False)[:, width].tolist()
    eos = first[1]
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    out = model.generate(
        **inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos, speculative_config=ngram_config(8)
    )
    assert torch.equal(out, plain)
    assert out[1, width].item() == eos and (out[1, width + 1 :] == PAD_TOKEN_ID).all()


def test_stop_strings_from_generation_config(enabled_llama, word_tokenizer):
    from transformers import GenerationConfig

    model = enabled_llama
    inputs = repeated_span_batch(3)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=30, do_sample=False), width)[
        1
    ].tolist()
    config = GenerationConfig(
        max_new_tokens=30,
        do_sample=False,
        stop_strings=[f"w{baseline[8]}w{baseline[9]}"],
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    plain = plain_generate(model, **inputs, generation_config=config, tokenizer=word_tokenizer)
    assert (new_tokens(plain, width)[1] == PAD_TOKEN_ID).any() or plain.shape[1] - width < 30
    out = model.generate(
        **inputs, generation_config=config, tokenizer=word_tokenizer, speculative_config=ngram_config(4)
    )
    assert torch.equal(out, plain)
    assert config.stop_strings == [f"w{baseline[8]}w{baseline[9]}"]  # the caller's config is not modified
