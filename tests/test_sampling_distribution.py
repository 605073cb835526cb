"""Sampling exactness: speculative sampling follows the target's distribution after the full
logits-processor pipeline.

A tiny model with a 16-token vocabulary; the exact distribution of the next 3 tokens is
enumerated from plain `generate()`'s own processed scores over every prefix; thousands of
speculative samples (one per batch row, each row with its own generator) must pass a
chi-square test against it, and the same test must reject a deliberately broken sampler.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from conftest import SMALL_VOCAB_SIZE, build_small_vocab_llama, build_tiny_llama
from scipy.stats import chisquare, kstest
from transformers import LogitsProcessor, LogitsProcessorList

import hf_specdec
from hf_specdec.loop import step
from hf_specdec.sampling import logits_processing, rejection_sampler
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.penalties import OutputTokenPenalties
from hf_specdec.sampling.rejection_sampler import RandomDraws, draw_random, rejection_sample

NEW_TOKENS = 3
PROMPT = [3, 5, 7, 3, 5, 7, 3, 5]  # repeats, so the n-gram drafter proposes "7 3 5 ..."
SETTINGS = {
    "temperature_topk_topp": dict(temperature=1.3, top_k=10, top_p=0.95),
    "minp_repetition_penalty": dict(temperature=1.0, min_p=0.05, repetition_penalty=1.4),
    "no_repeat_ngram_topk": dict(temperature=1.1, no_repeat_ngram_size=3, top_k=12),
    "typical_epsilon": dict(temperature=1.2, typical_p=0.9, epsilon_cutoff=0.02),
    "eta_top_h": dict(temperature=1.0, eta_cutoff=0.02, top_h=0.8),
}
# OpenAI's presence / frequency penalties over the generated tokens (every row's prompt is PROMPT)
PENALTIES = dict(
    temperature=1.0, logits_processor=LogitsProcessorList([OutputTokenPenalties(1.5, 0.8, prompt_width=len(PROMPT))])
)


@pytest.fixture(scope="module")
def model():
    return hf_specdec.enable(build_small_vocab_llama())


class _ForceSuffix(LogitsProcessor):
    """Makes row i of generate() pick `suffixes[i]` in its first steps, then leaves the scores alone."""

    def __init__(self, suffixes: list[tuple[int, ...]], prompt_width: int):
        self.suffixes, self.prompt_width = torch.tensor(suffixes, dtype=torch.long).reshape(len(suffixes), -1), prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        if step >= self.suffixes.shape[1]:
            return scores
        forced = torch.full_like(scores, -torch.inf)
        forced[torch.arange(len(scores)), self.suffixes[:, step]] = 0.0
        return forced


def exact_distribution(
    model, sampling: dict, prompt: list[int] = PROMPT, inputs=None, tokens=range(SMALL_VOCAB_SIZE), decoded: bool = False
) -> dict[tuple[int, ...], float]:
    """P(next 3 tokens) by enumeration, from plain generate()'s processed scores at every prefix.
    `inputs(input_ids)`: other inputs for a batch of those prefixes (an image's, for instance);
    `tokens`: the ones that can be sampled (the rest suppressed). Each prefix is a prompt of its own, or with
    `decoded` the prompt followed by the suffix generate() is made to pick: for a model whose prompt attends
    both ways (PaliGemma) the two differ, and only the latter is what sampling from the prompt gives."""
    probs: dict[tuple[int, ...], torch.Tensor] = {}
    for depth in range(NEW_TOKENS):
        suffixes = list(itertools.product(tokens, repeat=depth))
        if decoded:
            input_ids = torch.tensor([prompt] * len(suffixes))
            forced = {"logits_processor": LogitsProcessorList([_ForceSuffix(suffixes, len(prompt))])}
        else:
            input_ids, forced = torch.tensor([prompt + list(s) for s in suffixes]), {}
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            **(inputs(input_ids) if inputs else {}),
            max_new_tokens=1 + (depth if decoded else 0),
            do_sample=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **forced,
            **sampling,
        )
        step_probs = torch.softmax(out.scores[-1].double(), dim=-1)
        for suffix, p in zip(suffixes, step_probs):
            probs[suffix] = p
    return {
        triple: float(probs[()][triple[0]] * probs[triple[:1]][triple[1]] * probs[triple[:2]][triple[2]])
        for triple in itertools.product(tokens, repeat=NEW_TOKENS)
    }


NGRAM_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def speculative_samples(
    model, sampling: dict, speculative_config: dict, num_samples: int, seed: int, rows: int = 500, prompt: list[int] = PROMPT
) -> tuple[np.ndarray, list[dict]]:
    """`num_samples` sampled NEW_TOKENS-token continuations of PROMPT, `rows` per generate call, and
    each call's `spec_metrics`. Call i runs `speculative_config` with seed `seed + i * rows` (row r
    then samples with `seed + i * rows + r`: no two rows share draws). Every call must draft."""
    samples, metrics = [], []
    for call in range(num_samples // rows):
        input_ids = torch.tensor([prompt] * rows)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=True,
            pad_token_id=0,
            return_dict_in_generate=True,
            speculative_config={**speculative_config, "seed": seed + call * rows},
            **sampling,
        )
        assert out.spec_metrics["num_draft_tokens"] > 0
        samples.append(out.sequences[:, len(prompt) :].numpy())
        metrics.append(out.spec_metrics)
    return np.concatenate(samples), metrics


def chi_square_pvalue(samples: np.ndarray, exact: dict[tuple[int, ...], float]) -> float:
    """Cells with expected count < 5 are pooled into one, as the test requires."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for row in map(tuple, samples):
        counts[row] = counts.get(row, 0) + 1
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for triple, p in exact.items():
        if n * p >= 5:
            observed.append(counts.get(triple, 0))
            expected.append(n * p)
        else:
            pooled_obs += counts.get(triple, 0)
            pooled_exp += n * p
    observed.append(pooled_obs)
    expected.append(pooled_exp)
    assert sum(observed) == n, "every sample is a 3-token continuation"
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_speculative_sampling_matches_exact_distribution(model, setting):
    exact = exact_distribution(model, SETTINGS[setting])
    samples, _ = speculative_samples(model, SETTINGS[setting], NGRAM_CONFIG, num_samples=4000, seed=1234)
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_penalties_match_exact_distribution(model, monkeypatch):
    """Penalties count the drafts before each verified position. The drafter is the target itself, so
    nearly every draft is accepted and most positions sit behind drafts. Counting only the tokens
    emitted before the step (every position of a row given the row's shortest prefix) fails."""
    exact = exact_distribution(model, PENALTIES)
    config = {"method": "draft_model", "model": copy.deepcopy(model), "num_speculative_tokens": 3}
    samples, metrics = speculative_samples(model, PENALTIES, config, num_samples=4000, seed=1234)
    assert sum(m["num_accepted_tokens"] for m in metrics) > 4000
    assert chi_square_pvalue(samples, exact) > 1e-3
    # the penalties bite: without them the same samples fail
    without = {name: value for name, value in PENALTIES.items() if name != "logits_processor"}
    assert chi_square_pvalue(samples, exact_distribution(model, without)) < 1e-6
    by_prefix_length = logits_processing._by_prefix_length

    def drafts_not_counted(token_buffer, buffer_rows, prefix_lens, call):
        shortest = prefix_lens.copy()
        for row in np.unique(buffer_rows):
            shortest[buffer_rows == row] = prefix_lens[buffer_rows == row].min()
        by_prefix_length(token_buffer, buffer_rows, shortest, call)

    monkeypatch.setattr(logits_processing, "_by_prefix_length", drafts_not_counted)
    broken, _ = speculative_samples(model, PENALTIES, config, num_samples=4000, seed=1234)
    assert chi_square_pvalue(broken, exact) < 1e-6


def test_broken_sampler_is_detected(model, monkeypatch):
    """Always accepting drafts must fail the same test: the test has power."""
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling)

    def always_accept(metadata, logits, is_greedy, draws=None, draft_probs=None, method="token"):
        draws = RandomDraws(uniform=torch.zeros_like(draws.uniform), exponential=draws.exponential)
        return rejection_sample(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs, method=method)

    monkeypatch.setattr(step, "rejection_sample", always_accept)
    samples, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=4000, seed=1234)
    assert chi_square_pvalue(samples, exact) < 1e-6


def test_sampling_over_the_tokens_in_play_matches_exact_distribution(monkeypatch):
    """A 4096-token vocabulary of which 16 tokens in 8 of its 64-column blocks can be sampled, top-k 4: each row's
    p and exponential race run over its blocks in play (`sampling/tokens_in_play.py`; asserted). Broken: the blocks
    in play taken from each row's last verified position only (a draft's position loses its other blocks)."""
    vocab, allowed = 4096, [64 * block + offset for block in range(1, 64, 8) for offset in (5, 38)]
    model = hf_specdec.enable(
        build_tiny_llama(initializer_range=0.3, vocab_size=vocab, hidden_size=32, intermediate_size=64, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    )  # fmt: skip
    sampling = dict(temperature=1.2, top_k=4, suppress_tokens=sorted(set(range(vocab)) - set(allowed)))
    prompt = [allowed[i] for i in (0, 5, 9, 0, 5, 9, 0, 5)]
    exact = exact_distribution(model, sampling, prompt, tokens=allowed)
    narrow_steps, whole_steps, tokens_in_play = [], [], rejection_sampler.tokens_in_play

    def recorded(logits, metadata, sampled):
        in_play = tokens_in_play(logits, metadata, sampled)
        (whole_steps if in_play is None else narrow_steps).append(metadata.num_rows)
        return in_play

    monkeypatch.setattr(rejection_sampler, "tokens_in_play", recorded)
    samples, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=4000, seed=1234, prompt=prompt)
    assert narrow_steps and not whole_steps
    assert chi_square_pvalue(samples, exact) > 1e-3

    def last_position_only(logits, metadata, sampled):
        positions = torch.tensor(metadata.num_draft_tokens) + 1
        bonus_of_position = torch.repeat_interleave(metadata.bonus_logits_indices, positions)
        return recorded(logits[bonus_of_position], metadata, sampled)

    monkeypatch.setattr(rejection_sampler, "tokens_in_play", last_position_only)
    broken, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=4000, seed=1234, prompt=prompt)
    assert chi_square_pvalue(broken, exact) < 1e-6


def test_seeded_sampling_reproduces(model):
    sampling = SETTINGS["temperature_topk_topp"]
    first, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=500, seed=7)
    again, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=500, seed=7)
    other, _ = speculative_samples(model, sampling, NGRAM_CONFIG, num_samples=500, seed=8)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_global_seed_reproduces(model):
    """Without speculative_config.seed, torch.manual_seed makes a run reproducible."""

    def run():
        torch.manual_seed(99)
        input_ids = torch.tensor([PROMPT] * 4)
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=8,
            do_sample=True,
            pad_token_id=0,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )

    assert torch.equal(run(), run())


@pytest.mark.parametrize("one_hot_drafts", [True, False])
def test_rejection_sampler_output_follows_p(one_hot_drafts):
    """Unit level: drafts from q, one draft per row; the emitted first token is distributed as p.

    Covers both one-hot drafts (q = delta) and drafts that carry their probabilities.
    """
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 7, 60000
    p_logits = torch.randn(vocab, generator=generator) * 1.5
    p = torch.softmax(p_logits, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=0)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator)
    metadata = SpecDecodeMetadata.from_drafts([np.array([d]) for d in drafts.tolist()])
    logits = p_logits.repeat(2 * rows, 1)  # per row: the draft position, then the bonus position
    draws = RandomDraws(
        uniform=torch.rand(rows, generator=generator),
        exponential=torch.empty(rows, vocab).exponential_(generator=generator),
    )
    draft_probs = None if one_hot_drafts else q.repeat(rows, 1)
    output, num_accepted = rejection_sample(
        metadata, logits, torch.zeros(rows, dtype=torch.bool), draws=draws, draft_probs=draft_probs
    )
    first = output[:, 0]
    assert torch.equal(first[num_accepted == 1], drafts[num_accepted == 1])
    observed = torch.bincount(first, minlength=vocab).numpy()
    assert chisquare(observed, (p * rows).numpy()).pvalue > 1e-3
    if not one_hot_drafts:  # acceptance rate is sum(min(p, q)) (seed §12.2.2)
        expected_rate = torch.minimum(p, q).sum().item()
        assert abs(num_accepted.float().mean().item() - expected_rate) < 0.01


def test_draw_random_gives_each_row_its_own_draws():
    """One U[0, 1) per draft and one Exp(1) vector per sampled row, each from the row's own generator;
    greedy rows (no generator) get placeholders."""
    vocab, cpu = 50_000, torch.device("cpu")
    metadata = SpecDecodeMetadata.from_drafts([np.zeros(n, dtype=np.int64) for n in (3, 0, 5)])
    generators = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    draws = draw_random(generators, metadata, vocab, cpu)
    assert draws.uniform.shape == (8,) and draws.exponential.shape == (3, vocab)
    assert ((draws.uniform >= 0) & (draws.uniform < 1)).all()
    assert torch.equal(draws.exponential[1], torch.ones(vocab))
    for row in (0, 2):
        noise = draws.exponential[row]
        assert torch.isfinite(noise).all() and (noise >= 0).all()
        assert kstest(noise.numpy(), "expon").pvalue > 1e-3
    assert kstest(torch.cat([draws.exponential[0], draws.exponential[2]]).numpy(), "expon").pvalue > 1e-3
    alone = draw_random(
        [torch.Generator().manual_seed(2)], SpecDecodeMetadata.from_drafts([np.zeros(5, dtype=np.int64)]), vocab, cpu
    )
    assert torch.equal(alone.exponential[0], draws.exponential[2])
    assert torch.equal(alone.uniform, draws.uniform[3:])


def small_vocab_model(arch: str, seed: int = 0):
    """16-token models of other architectures: Gemma 2 (window 4 < the prompt, soft-capping), Mixtral
    (4 experts, 2 per token) and gpt-oss (sinks, window 4, experts)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    sizes = dict(
        vocab_size=SMALL_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None, bos_token_id=None, initializer_range=0.3,
    )
    torch.manual_seed(seed)
    if arch == "gemma2":
        config = Gemma2Config(**sizes, sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                              tie_word_embeddings=False)
        return Gemma2ForCausalLM(config).eval()
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)).eval()
    model = GptOssForCausalLM(GptOssConfig(**sizes, sliding_window=4, num_local_experts=4, num_experts_per_tok=2)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.5, 1.5, layer.self_attn.sinks.numel()))
    return model


@pytest.mark.parametrize("arch", ["gemma2", "mixtral", "gpt_oss"])
def test_sampling_matches_exact_distribution_on_other_architectures(arch):
    """The chi-square test of the Llama above on a sliding-window + soft-capping family, an MoE family
    and gpt-oss (sinks): 4000 samples of 3 tokens against the enumerated exact distribution. Drafts
    come from a sibling of the same architecture (another seed): sampled with their q, partly
    accepted, so acceptance, rejection and recovery all run on these models' caches."""
    model = hf_specdec.enable(small_vocab_model(arch))
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling)
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    config = {"method": "draft_model", "model": small_vocab_model(arch, seed=1), "num_speculative_tokens": 2}
    samples, metrics = speculative_samples(model, sampling, config, num_samples=4000, seed=4321)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    assert 0 < accepted < sum(m["num_draft_tokens"] for m in metrics), "drafts all accepted or all rejected"
    assert chi_square_pvalue(samples, exact) > 1e-3


def small_vocab_family_model(model_type: str, seed: int = 0, **overrides):
    """A 16-token tiny model of a family of the matrix (pad 0, no eos / bos), logits spread by initializer 0.3."""
    import families

    config = families.tiny_config(model_type, init_scale=0.3)
    config.vocab_size, config.pad_token_id, config.eos_token_id, config.bos_token_id = SMALL_VOCAB_SIZE, 0, None, None
    for name, value in overrides.items():
        setattr(config, name, value)
    model = families.build_tiny_model(model_type, seed=seed, config=config)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    return model


def assert_follows_exact_distribution_until_broken(model, seed: int, break_it) -> None:
    """2000 sampled continuations (fewer than elsewhere: these models run a forward per row) with drafts
    from a 16-token Llama sampled with their q pass the chi-square test against the enumerated
    distribution, drafts accepted and rejected; after `break_it()` 1000 fail it (measured: p below 1e-35 for
    every broken variant at 1000 samples, 1e-3 needed)."""
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling)
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    config = {"method": "draft_model", "model": build_small_vocab_llama(1), "num_speculative_tokens": 2}
    samples, metrics = speculative_samples(model, sampling, config, num_samples=2000, seed=seed)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    assert 0 < accepted < sum(m["num_draft_tokens"] for m in metrics), "drafts all accepted or all rejected"
    assert chi_square_pvalue(samples, exact) > 1e-3
    break_it()
    samples, _ = speculative_samples(model, sampling, config, num_samples=1000, seed=seed)
    assert chi_square_pvalue(samples, exact) < 1e-3


def test_sampling_on_a_prompt_attending_both_ways_matches_exact_distribution(monkeypatch):
    """PaliGemma (its text prompt attends both ways under SDPA; the model's own forward prefills it) against the
    distribution plain generate() samples from (the prompt, then each suffix decoded: it differs from the
    suffix read as part of the prompt by up to 0.08); broken: the prompt fed causally on the paged path."""
    import families

    from hf_specdec.loop import decoding

    config = families.tiny_config("paligemma", init_scale=0.3)
    text = config.get_text_config()
    text.vocab_size, text.pad_token_id, text.eos_token_id, text.bos_token_id = SMALL_VOCAB_SIZE, 0, None, None
    model = families.build_tiny_model("paligemma", config=config)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model = hf_specdec.enable(model)
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling, decoded=True)
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    config = {"method": "draft_model", "model": build_small_vocab_llama(1), "num_speculative_tokens": 2}
    samples, metrics = speculative_samples(model, sampling, config, num_samples=2000, seed=99)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    assert 0 < accepted < sum(m["num_draft_tokens"] for m in metrics), "drafts all accepted or all rejected"
    assert chi_square_pvalue(samples, exact) > 1e-3
    monkeypatch.setattr(decoding, "prompt_attends_both_ways", lambda model: False)
    samples, _ = speculative_samples(model, sampling, config, num_samples=2000, seed=99)
    assert chi_square_pvalue(samples, exact) < 1e-3


def test_sampling_on_sparse_indexed_attention_matches_exact_distribution(monkeypatch):
    """DeepSeek-V3.2's sparse attention (one row per forward, the indexer's top-k honoured; past the
    8-token prompt each query attends to the top 4 keys, not its whole context); broken: attending to
    every key instead of the selected ones."""
    from hf_specdec.cache import paged_attention

    model = hf_specdec.enable(small_vocab_family_model("deepseek_v32", index_topk=4))
    assert_follows_exact_distribution_until_broken(
        model, 99, lambda: monkeypatch.setattr(paged_attention, "_with_indices", lambda mask, indices, meta: mask)
    )


@pytest.mark.parametrize("batched", [True, False])
def test_sampling_on_own_attention_matches_exact_distribution(monkeypatch, batched):
    """BLOOM on its own attention: batched on one `DynamicCache` (rows realigned after each step), broken: a
    rollback that leaves the rejected drafts' keys in the batch; or one row per forward on a `DynamicCache`
    each (rolled back by cropping), broken: a rollback that keeps the rejected drafts' keys (crops the oldest)."""
    from transformers.cache_utils import DynamicLayer

    from hf_specdec.cache.architectures import check_architecture
    from hf_specdec.cache.own_attention import (
        BatchedOwnAttentionCache,
        mark_own_attention,
        runs_one_row_per_forward,
    )

    def crop_the_oldest(layer, tokens_to_remove: int) -> None:  # the right length, the rejected drafts' keys kept
        if tokens_to_remove < 0:
            layer.keys, layer.values = layer.keys[..., -tokens_to_remove:, :], layer.values[..., -tokens_to_remove:, :]

    model = hf_specdec.enable(small_vocab_family_model("bloom"))
    check_architecture(model)
    if batched:
        break_it = lambda: monkeypatch.setattr(BatchedOwnAttentionCache, "rollback", lambda cache, row, n: None)  # noqa: E731
    else:
        mark_own_attention(model)  # one row per forward, as a model with sliding layers runs
        break_it = lambda: monkeypatch.setattr(DynamicLayer, "crop", crop_the_oldest)  # noqa: E731
    assert runs_one_row_per_forward(model) != batched
    assert_follows_exact_distribution_until_broken(model, 5, break_it)
