"""Grammar-constrained generation (xgrammar) under speculation.

The user passes xgrammar's own transformers processor, as for plain generate(); the loop replaces it
with `SpeculativeGrammar`, which masks every verify position for its own prefix and rolls the
matcher back over rejected drafts. Greedy must equal plain constrained generate(), every output must
match the grammar, and sampled output must follow the constrained distribution.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from conftest import (
    EOS_TOKEN_ID,
    SMALL_VOCAB_SIZE,
    VOCAB_SIZE,
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    plain_generate,
    repeated_span_prompts,
)
from scipy.stats import chisquare
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

import hf_specdec
from hf_specdec import SpeculativeEngine
from hf_specdec.loop import step
from hf_specdec.sampling import grammar as grammar_module

WORDS = ["<pad>", "</s>", "<s>"] + [f"w{i}" for i in range(3, VOCAB_SIZE - 1)] + ["abcdef"]
WORD_PATTERN = r"(w1[0-9]|w2[0-9])+"  # tokens w10..w29, nothing else


def word_grammar():
    info = xgr.TokenizerInfo(WORDS, xgr.VocabType.RAW, stop_token_ids=[EOS_TOKEN_ID])
    return xgr.GrammarCompiler(info).compile_regex(WORD_PATTERN)


def generate(model, inputs, config=None, **kwargs):
    """Constrained generate(): plain, or ours with `config`; a fresh processor each call (xgrammar's rule)."""
    processors = [XgrammarProcessor(word_grammar())]
    if config is None:
        return plain_generate(model, **inputs, logits_processor=processors, **kwargs)
    return model.generate(
        **inputs, logits_processor=processors, custom_generate=hf_specdec.generate, speculative_config=config,
        return_dict_in_generate=True, **kwargs,
    )


def drafter_config(drafter: str) -> dict:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": build_tiny_llama(seed=3), "num_speculative_tokens": 3},
        # a tree's nodes are masked each for the path to it (no cut before the verify)
        "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "tree": {"num_nodes": 8, "topk": 2}},
    }[drafter]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "ngram_tree"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_matches_plain_constrained_generate(drafter, batch_size):
    model = build_tiny_llama()
    inputs = left_padded_batch(repeated_span_prompts(batch_size))
    plain = generate(model, inputs, max_new_tokens=24, do_sample=False)
    out = generate(model, inputs, drafter_config(drafter), max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences, plain)
    width = inputs["input_ids"].shape[1]
    for row in out.sequences[:, width:].tolist():
        text = "".join(WORDS[t] for t in row if t != EOS_TOKEN_ID)
        assert re.fullmatch(WORD_PATTERN, text), text  # every output follows the grammar
    unconstrained = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    assert not torch.equal(unconstrained, plain), "the grammar changes nothing: the test would prove little"
    if drafter != "draft_model":
        assert out.spec_metrics["num_accepted_tokens"] > 0


def test_forbidden_drafts_are_cut_before_the_verify(monkeypatch):
    """Deterministic drafts stop at the first token the grammar forbids: fewer positions verified, same output."""
    model = build_tiny_llama()
    inputs = left_padded_batch(repeated_span_prompts(3))
    config = {"method": "ngram", "num_speculative_tokens": 4}
    cut = generate(model, inputs, config, max_new_tokens=24, do_sample=False)
    monkeypatch.setattr(step, "cut_forbidden_drafts", lambda processors, rows, drafts, prefix_of: drafts)
    whole = generate(model, inputs, config, max_new_tokens=24, do_sample=False)
    assert torch.equal(cut.sequences, whole.sequences)
    assert cut.spec_metrics["num_draft_tokens"] < whole.spec_metrics["num_draft_tokens"]
    assert cut.spec_metrics["num_accepted_tokens"] == whole.spec_metrics["num_accepted_tokens"]


# --- sampling: the constrained distribution ----------------------------------------------------------

LETTERS = ["<pad>"] + list("abcdefghijklmno")  # the 16-token model's vocabulary as text
LETTER_PATTERN = r"(ab|cd|e)+"
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4]  # "abcdabcd": the n-gram drafter proposes "a b c ..."
SAMPLING = dict(temperature=1.2, top_k=12)
NEW_TOKENS = 3


def letter_grammar():
    info = xgr.TokenizerInfo(LETTERS, xgr.VocabType.RAW)
    return xgr.GrammarCompiler(info).compile_regex(LETTER_PATTERN)


def advanced_processor(prefixes: list[tuple[int, ...]]) -> XgrammarProcessor:
    """xgrammar's processor with one matcher per row already fed that row's generated prefix."""
    processor = XgrammarProcessor(letter_grammar())
    processor.batch_size = len(prefixes)
    processor.compiled_grammars = processor.compiled_grammars * len(prefixes)
    processor.matchers = [xgr.GrammarMatcher(processor.compiled_grammars[0]) for _ in prefixes]
    for matcher, prefix in zip(processor.matchers, prefixes):
        assert all(matcher.accept_token(t) for t in prefix)
    processor.token_bitmask = xgr.allocate_token_bitmask(len(prefixes), processor.full_vocab_size)
    return processor


def exact_constrained_distribution(model) -> dict[tuple[int, ...], float]:
    """P(next 3 tokens) from plain generate()'s own processed scores, the grammar applied for each prefix."""
    probs: dict[tuple[int, ...], torch.Tensor] = {}
    for depth in range(NEW_TOKENS):
        prefixes = [s for s in itertools.product(range(SMALL_VOCAB_SIZE), repeat=depth) if _allowed(s)]
        input_ids = torch.tensor([PROMPT + list(s) for s in prefixes])
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=1, do_sample=True,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            logits_processor=[advanced_processor(prefixes)], **SAMPLING,
        )
        for prefix, p in zip(prefixes, torch.softmax(out.scores[0].double(), dim=-1)):
            probs[prefix] = p
    exact = {}
    for triple in itertools.product(range(SMALL_VOCAB_SIZE), repeat=NEW_TOKENS):
        if _allowed(triple[:2]):
            exact[triple] = float(probs[()][triple[0]] * probs[triple[:1]][triple[1]] * probs[triple[:2]][triple[2]])
    return exact


def _allowed(prefix: tuple[int, ...]) -> bool:
    matcher = xgr.GrammarMatcher(letter_grammar())
    return all(matcher.accept_token(t) for t in prefix)


NGRAM_CHAIN = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def constrained_samples(model, num_samples: int, seed: int, rows: int = 500, config: dict = NGRAM_CHAIN) -> np.ndarray:
    samples = []
    for call in range(num_samples // rows):
        input_ids = torch.tensor([PROMPT] * rows)
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
            do_sample=True, pad_token_id=0, logits_processor=[XgrammarProcessor(letter_grammar())],
            custom_generate=hf_specdec.generate, return_dict_in_generate=True,
            speculative_config={**config, "seed": seed + call * rows},
            **SAMPLING,
        )
        assert out.spec_metrics["num_accepted_tokens"] > 0
        samples.append(out.sequences[:, len(PROMPT):].numpy())
    return np.concatenate(samples)


def constrained_pvalue(samples: np.ndarray, exact: dict[tuple[int, ...], float]) -> float:
    """0 when a sample lies outside the grammar's support, else the chi-square p-value over the support."""
    support = {triple: p for triple, p in exact.items() if p > 0}
    if any(tuple(s) not in support for s in samples.tolist()):
        return 0.0
    counts: dict[tuple[int, ...], int] = {}
    for triple in map(tuple, samples.tolist()):
        counts[triple] = counts.get(triple, 0) + 1
    n, big = len(samples), [t for t, p in support.items() if len(samples) * p >= 5]
    observed = [counts.get(t, 0) for t in big]
    expected = [n * support[t] for t in big]
    if len(big) < len(support):  # the rare cells pooled into one, as the test requires
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    return chisquare(observed, expected).pvalue


def test_sampled_output_follows_the_constrained_distribution():
    model = build_small_vocab_llama()
    exact = exact_constrained_distribution(model)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    assert max(exact.values()) < 0.5, "the constrained distribution is nearly deterministic: the test would prove little"
    samples = constrained_samples(model, num_samples=4000, seed=99)
    assert constrained_pvalue(samples, exact) > 1e-3


def _tree_config(model) -> dict:
    from test_eagle import random_head

    return {"method": "eagle3", "model": random_head(model, "eagle3", seed=1), "num_speculative_tokens": 3,
            "tree": {"num_nodes": 24, "topk": 8}}  # fmt: skip


def test_sampled_tree_output_follows_the_constrained_distribution(monkeypatch):
    """Draft trees under a grammar: each node masked for its own path, siblings tried in rank order
    against the masked residual. Masking every node as its row's root (the path ignored) fails."""
    model = build_small_vocab_llama()
    exact = exact_constrained_distribution(model)
    samples = constrained_samples(model, num_samples=4000, seed=7, config=_tree_config(model))
    assert constrained_pvalue(samples, exact) > 1e-3
    original = grammar_module.SpeculativeGrammar.process

    def root_mask_only(self, scores, token_buffer, buffer_rows, prefix_lens, batch_rows):
        roots = np.array([np.flatnonzero(batch_rows == row)[0] for row in batch_rows])
        return original(self, scores, token_buffer, roots, prefix_lens[roots], batch_rows)

    monkeypatch.setattr(grammar_module.SpeculativeGrammar, "process", root_mask_only)
    try:
        broken = constrained_samples(model, num_samples=4000, seed=7, config=_tree_config(model))
    except RuntimeError as error:  # a forbidden token got through: the loop's own check catches it
        assert "which its grammar does not allow here" in str(error)
    else:
        assert constrained_pvalue(broken, exact) < 1e-6


def test_unmasked_drafts_are_detected(monkeypatch):
    """A grammar that masks only the first verify position of each row must fail the same test."""
    model = build_small_vocab_llama()
    exact = exact_constrained_distribution(model)
    original = grammar_module.SpeculativeGrammar.process

    def first_position_only(self, scores, token_buffer, buffer_rows, prefix_lens, batch_rows):
        masked = original(self, scores, token_buffer, buffer_rows, prefix_lens, batch_rows)
        first = np.array([prefix_lens[i] == prefix_lens[buffer_rows == buffer_rows[i]].min() for i in range(len(buffer_rows))])
        return torch.where(torch.from_numpy(first)[:, None], masked, scores)

    monkeypatch.setattr(grammar_module.SpeculativeGrammar, "process", first_position_only)
    try:
        samples = constrained_samples(model, num_samples=4000, seed=99)
    except RuntimeError as error:  # a forbidden token got through: the loop's own check catches it
        assert "which its grammar does not allow here" in str(error)
    else:
        assert constrained_pvalue(samples, exact) < 1e-6


# --- refusals ------------------------------------------------------------------------------------------


def test_a_used_xgrammar_processor_is_refused():
    model = build_tiny_llama()
    inputs = left_padded_batch(repeated_span_prompts(1))
    processor = XgrammarProcessor(word_grammar())
    plain_generate(model, **inputs, max_new_tokens=4, do_sample=False, logits_processor=[processor])
    with pytest.raises(ValueError, match="already used by an earlier generate"):
        model.generate(**inputs, max_new_tokens=4, logits_processor=[processor], custom_generate=hf_specdec.generate,
                       speculative_config={"method": "ngram"})


def test_grammar_processors_we_cannot_roll_back_are_refused():
    from transformers import LogitsProcessor

    outlines_like = type("RegexLogitsProcessor", (LogitsProcessor,), {"__module__": "outlines.processors.structured",
                                                                      "__call__": lambda self, ids, scores: scores})
    model = build_tiny_llama()
    inputs = left_padded_batch(repeated_span_prompts(1))
    with pytest.raises(ValueError, match="RegexLogitsProcessor is not supported with speculative decoding: outlines"):
        model.generate(**inputs, max_new_tokens=4, logits_processor=[outlines_like()],
                       custom_generate=hf_specdec.generate, speculative_config={"method": "ngram"})


def _engine_outputs(engine, requests: list[tuple[list[int], dict, object]]) -> list[list[int]]:
    ids = [engine.add_request(prompt, config, grammar=grammar, seed=1) for prompt, config, grammar in requests]
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "ngram_tree"])
def test_engine_requests_follow_their_own_grammar(drafter):
    """An engine request with a grammar equals plain constrained generate() alone (greedy), beside
    unconstrained requests that stay as they are; a sampled one follows the grammar too."""
    model = build_tiny_llama()
    engine = SpeculativeEngine(model, drafter_config(drafter), max_batch_size=4)
    prompts = repeated_span_prompts(3)
    greedy = {"max_new_tokens": 24, "do_sample": False}
    constrained, free, sampled = _engine_outputs(engine, [
        (prompts[0], greedy, word_grammar()), (prompts[1], greedy, None),
        (prompts[2], {"max_new_tokens": 24, "do_sample": True, "temperature": 1.2}, word_grammar()),
    ])  # fmt: skip
    alone = {k: torch.tensor([p]) for k, p in (("input_ids", prompts[0]),)}
    alone["attention_mask"] = torch.ones_like(alone["input_ids"])
    expected = generate(model, alone, max_new_tokens=24, do_sample=False)[0, len(prompts[0]) :].tolist()
    assert constrained == expected
    unconstrained = plain_generate(model, input_ids=torch.tensor([prompts[1]]), max_new_tokens=24, do_sample=False)
    assert free == unconstrained[0, len(prompts[1]) :].tolist()
    for row in (constrained, sampled):
        text = "".join(WORDS[t] for t in row if t != EOS_TOKEN_ID)
        assert re.fullmatch(WORD_PATTERN, text), text
    assert constrained != plain_generate(model, **alone, max_new_tokens=24, do_sample=False)[0, len(prompts[0]) :].tolist()


def test_engine_refuses_a_grammar_it_cannot_apply():
    model = build_tiny_llama()
    engine = SpeculativeEngine(model, {"method": "ngram", "num_speculative_tokens": 2}, max_batch_size=2)
    with pytest.raises(ValueError, match="grammar must be an xgrammar CompiledGrammar"):
        engine.add_request([5, 6, 7], {"max_new_tokens": 4}, grammar=WORD_PATTERN)
    other_vocab = xgr.GrammarCompiler(xgr.TokenizerInfo(WORDS[:-1], xgr.VocabType.RAW)).compile_regex("w1[0-9]")
    with pytest.raises(ValueError, match="vocab_size"):
        engine.add_request([5, 6, 7], {"max_new_tokens": 4}, grammar=other_vocab)
    with pytest.raises(ValueError, match="vocab_size"):  # xgrammar's processor among the request's own
        engine.add_request([5, 6, 7], {"max_new_tokens": 4}, logits_processor=[XgrammarProcessor(other_vocab)])


def test_engine_sampled_requests_follow_the_constrained_distribution():
    """Engine requests with a grammar and drafts sampled from a draft model's q (never cut before the
    verify: the masked verify must reject forbidden ones) follow plain constrained generate()'s distribution."""
    from test_draft_model import perturbed_copy

    model = build_small_vocab_llama()
    exact = exact_constrained_distribution(model)
    engine = SpeculativeEngine(
        model, {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}, max_batch_size=64
    )
    config = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0, **SAMPLING}
    ids = [engine.add_request(PROMPT, config, grammar=letter_grammar(), seed=seed) for seed in range(3000)]
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    samples = np.array([finished[i] for i in ids])
    assert engine.metrics.num_accepted_tokens > 0
    assert constrained_pvalue(samples, exact) > 1e-3
