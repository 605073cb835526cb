"""method="draft_model": a separate small causal LM drafts; the output stays the target's.

Drafts are built from the tiny target (its weights plus noise, or its first layer plus noise) so
that they agree with it often enough for drafts to be accepted and rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    new_tokens,
    plain_generate,
    repeated_span_batch,
    repeated_span_prompts,
)
from test_sampling_distribution import (
    PROMPT,
    SETTINGS,
    chi_square_pvalue,
    exact_distribution,
    speculative_samples,
)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
    XGLMConfig,
    XGLMForCausalLM,
)

import hf_specdec
from hf_specdec.drafters import DraftModelProposer, DraftSampling, ProposeRequest
from hf_specdec.loop import step


def perturbed_copy(target, num_layers: int | None = None, noise: float = 0.1, seed: int = 1, **overrides):
    """The target's first `num_layers` layers (all by default), each weight plus `noise` x its std."""
    num_layers = num_layers or target.config.num_hidden_layers
    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": num_layers, **overrides})
    draft = LlamaForCausalLM(config).eval()
    state = {
        name: value
        for name, value in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    draft.load_state_dict(state)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    return draft


def draft_config(draft, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(build_tiny_llama())


@pytest.fixture(scope="module")
def drafts(target):
    return {"perturbed": perturbed_copy(target), "one_layer": perturbed_copy(target, num_layers=1)}


# --- greedy identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_name", ["perturbed", "one_layer"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_matches_plain_generate(target, drafts, draft_name, k, batch_size):
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(target, **inputs, max_new_tokens=40, do_sample=False)
    out = target.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=draft_config(drafts[draft_name], k),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] > 0, "no draft was ever accepted: the test proves nothing"
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"], "no draft was ever rejected"
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]


def test_eos_stops_rows_and_frees_the_draft_cache(target, drafts):
    """Rows that finish early leave the batch; the others keep drafting from a consistent cache."""
    inputs = repeated_span_batch(4)
    baseline = new_tokens(
        plain_generate(target, **inputs, max_new_tokens=30, do_sample=False), inputs["input_ids"].shape[1]
    )
    eos = [EOS_TOKEN_ID, int(baseline[1, 6]), int(baseline[2, 14])]
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = target.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        speculative_config=draft_config(drafts["perturbed"]),
    )
    assert torch.equal(out, plain)
    assert (new_tokens(plain, inputs["input_ids"].shape[1]) == 0).any(), "no row finished early"


def test_draft_loaded_from_a_folder(target, drafts, tmp_path):
    drafts["perturbed"].save_pretrained(tmp_path / "draft")
    inputs = repeated_span_batch(3)
    by_object = target.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config=draft_config(drafts["perturbed"]),
        return_dict_in_generate=True,
    )
    by_path = target.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config=draft_config(str(tmp_path / "draft")),
        return_dict_in_generate=True,
    )
    assert torch.equal(by_path.sequences, by_object.sequences)
    assert by_path.spec_metrics["num_accepted_tokens"] == by_object.spec_metrics["num_accepted_tokens"]
    # loaded once per target, not on every call
    loaded = hf_specdec.drafters.draft_model._LOADED[target]
    assert list(loaded) == [str(tmp_path / "draft")]


# --- the proposer on its own: catch-up and rollback of the draft cache ------------------------


def test_drafts_equal_the_draft_models_greedy_continuation(drafts):
    """Over several steps with random acceptance, every row's drafts are exactly what the draft
    model generates greedily from the row's context: the cache keeps the accepted prefix and
    drops the rest correctly, whatever was accepted."""
    draft = drafts["one_layer"]
    k = 4
    proposer = DraftModelProposer(draft, k, DraftSampling(), block_size=4, max_length=80)
    rng = np.random.default_rng(0)
    contexts = [np.array(p, dtype=np.int64) for p in repeated_span_prompts(3, seed=5)]
    for _ in range(6):
        max_draft = [int(rng.integers(0, k + 1)) for _ in contexts]
        proposal = proposer.propose(
            ProposeRequest(rows=[0, 1, 2], token_ids=contexts, max_draft_tokens=max_draft)
        )
        assert proposal.draft_probs is None
        for row, (context, drafted) in enumerate(zip(contexts, proposal.draft_token_ids)):
            assert len(drafted) == max_draft[row]
            if len(drafted):
                expected = draft.generate(
                    input_ids=torch.from_numpy(context)[None],
                    max_new_tokens=len(drafted),
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(context) :]
                assert drafted.tolist() == expected.tolist(), row
        # accept a random prefix of each row's drafts and append a random "target" token
        for row, drafted in enumerate(proposal.draft_token_ids):
            accepted = int(rng.integers(0, len(drafted) + 1))
            contexts[row] = np.concatenate([contexts[row], drafted[:accepted], [int(rng.integers(3, 128))]])
    proposer.release([0, 1, 2])
    assert proposer.cache.num_blocks_used == 0 and not proposer.cached_tokens


# --- sampling ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_pair():
    """The 16-token target of test_sampling_distribution and a draft with other weights."""
    return hf_specdec.enable(build_small_vocab_llama(0)), build_small_vocab_llama(1)


def _draft_samples(target, draft, sampling: dict, num_samples: int, seed: int) -> np.ndarray:
    samples, metrics = speculative_samples(target, sampling, draft_config(draft, k=3), num_samples, seed)
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    return samples


@pytest.mark.parametrize("setting", ["temperature_topk_topp", "minp_repetition_penalty"])
def test_sampled_drafts_follow_the_target_distribution(small_vocab_pair, setting):
    target, draft = small_vocab_pair
    exact = exact_distribution(target, SETTINGS[setting])
    samples = _draft_samples(target, draft, SETTINGS[setting], num_samples=4000, seed=1234)
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_wrong_q_is_detected(small_vocab_pair, monkeypatch):
    """Handing the sampler a q the drafts were not drawn from (uniform) biases the output: the
    test has power, and the q the drafter returns is the one that matters."""
    target, draft = small_vocab_pair
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(target, sampling)
    original = step.rejection_sample
    seen = []

    def uniform_q(metadata, logits, is_greedy, draws=None, draft_probs=None, method="token"):
        seen.append(draft_probs)
        wrong = None if draft_probs is None else torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return original(metadata, logits, is_greedy, draws=draws, draft_probs=wrong, method=method)

    monkeypatch.setattr(step, "rejection_sample", uniform_q)
    samples = _draft_samples(target, draft, sampling, num_samples=4000, seed=1234)
    assert any(q is not None for q in seen)
    for q in seen:
        if q is not None:
            torch.testing.assert_close(q.sum(-1), torch.ones(len(q)))
    assert chi_square_pvalue(samples, exact) < 1e-6


def _acceptance_rate(target, draft, drop_q: bool, monkeypatch) -> float:
    original = step.rejection_sample

    def maybe_drop_q(metadata, logits, is_greedy, draws=None, draft_probs=None, method="token"):
        return original(metadata, logits, is_greedy, draws=draws, draft_probs=None if drop_q else draft_probs, method=method)

    monkeypatch.setattr(step, "rejection_sample", maybe_drop_q)
    input_ids = torch.tensor([PROMPT] * 400)
    metrics = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=8,
        do_sample=True,
        pad_token_id=0,
        return_dict_in_generate=True,
        speculative_config=draft_config(draft, k=3, seed=0),
        **SETTINGS["temperature_topk_topp"],
    ).spec_metrics
    return metrics["num_accepted_tokens"] / metrics["num_draft_tokens"]


def test_q_raises_the_acceptance_rate(small_vocab_pair, monkeypatch):
    """A sampled draft treated as one-hot is still exact (given the token, q = delta), but is
    accepted with probability p(x) instead of min(1, p(x)/q(x)): passing q pays."""
    target, draft = small_vocab_pair
    with_q = _acceptance_rate(target, draft, drop_q=False, monkeypatch=monkeypatch)
    one_hot = _acceptance_rate(target, draft, drop_q=True, monkeypatch=monkeypatch)
    assert with_q > 2 * one_hot, (with_q, one_hot)


def test_seeded_sampling_reproduces(small_vocab_pair):
    target, draft = small_vocab_pair
    sampling = SETTINGS["temperature_topk_topp"]
    first = _draft_samples(target, draft, sampling, num_samples=500, seed=7)
    again = _draft_samples(target, draft, sampling, num_samples=500, seed=7)
    other = _draft_samples(target, draft, sampling, num_samples=500, seed=8)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_self_draft_with_the_same_warpers_accepts_everything(small_vocab_pair):
    """The target drafting for itself: q equals p after the position-free warpers, so every
    sampled draft passes (u * q < p with q = p)."""
    target, _ = small_vocab_pair
    input_ids = torch.tensor([PROMPT] * 8)
    out = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=12,
        do_sample=True,
        pad_token_id=0,
        temperature=1.3,
        top_k=10,
        return_dict_in_generate=True,
        speculative_config=draft_config(target, k=3, seed=0),
    )
    metrics = out.spec_metrics
    assert metrics["num_draft_tokens"] > 0
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]


# --- what the draft must share with the target -------------------------------------------------


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        ({"vocab_size": 96}, "vocabulary size 96 (target: 128)"),
        ({"eos_token_id": 5}, "eos_token_id [5] (target: [1])"),
        ({"bos_token_id": 7}, "bos_token_id [7] (target: [2])"),
        ({"pad_token_id": 3}, "pad_token_id [3] (target: [0])"),
    ],
)
def test_mismatched_vocabulary_or_special_tokens_rejected(target, overrides, fragment):
    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1, **overrides})
    draft = LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match="does not share the target's tokenizer") as info:
        target.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=draft_config(draft))
    assert fragment in str(info.value)


def test_mismatched_tokenizers_rejected(target, drafts, word_tokenizer, tmp_path):
    """Same sizes and special ids, but the tokenizers map words to other ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    draft = perturbed_copy(target, num_layers=1)
    word_tokenizer.save_pretrained(tmp_path / "target")
    vocab = dict(word_tokenizer.get_vocab())
    vocab["w3"], vocab["w4"] = vocab["w4"], vocab["w3"]
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
    )
    other.save_pretrained(tmp_path / "draft")
    original_path = target.config.name_or_path
    target.config.name_or_path = str(tmp_path / "target")
    try:
        draft.config.name_or_path = str(tmp_path / "target")  # the same tokenizer: accepted
        hf_specdec.drafters.check_draft_compatible(draft, target)
        draft = perturbed_copy(target, num_layers=1)
        draft.config.name_or_path = str(tmp_path / "draft")
        with pytest.raises(ValueError, match=r"tokenizer vocabulary \(4 token/id pairs differ\)"):
            target.generate(
                **repeated_span_batch(1), max_new_tokens=4, speculative_config=draft_config(draft)
            )
    finally:
        target.config.name_or_path = original_path


def test_draft_architectures_refused_on_own_attention_or_run(target):
    """A draft we cannot run exactly (RWKV keeps a cache class of its own) is refused naming its model type;
    a draft the paged attention cannot run but its own can (XGLM computes attention itself) drafts for a
    paged Llama, identical to plain generate(); a draft of another family (GPT-2) is refused for what
    really differs, its vocabulary."""
    special = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, **special))
    with pytest.raises(ValueError, match="draft model: model_type='rwkv' is not supported"):
        target.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=draft_config(rwkv))
    xglm = XGLMForCausalLM(
        XGLMConfig(vocab_size=128, d_model=32, ffn_dim=64, num_layers=1, attention_heads=2, **special)
    ).eval()
    inputs = repeated_span_batch(2)
    out = target.generate(
        **inputs, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, speculative_config=draft_config(xglm)
    )
    plain = plain_generate(target, **inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="speculative_config.tree is not supported with a draft model that runs on its own"):
        target.generate(**inputs, max_new_tokens=4, speculative_config=draft_config(xglm, tree={"num_nodes": 4, "topk": 2}))
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64, pad_token_id=0, eos_token_id=1)
    ).eval()
    with pytest.raises(ValueError, match="vocabulary size 96"):
        target.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=draft_config(gpt2))


def test_bad_model_value_rejected(target):
    with pytest.raises(ValueError, match="speculative_config.model"):
        target.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=draft_config(12))


def test_ragged_batch_with_max_length_cap(target, drafts):
    """Rows of very different lengths, and a max_new_tokens that cuts drafts short near the end."""
    inputs = left_padded_batch([[5, 6, 7] * 6, [9, 10], [11, 12, 13, 11, 12, 13, 11]])
    plain = plain_generate(target, **inputs, max_new_tokens=9, do_sample=False)
    out = target.generate(
        **inputs, max_new_tokens=9, do_sample=False, speculative_config=draft_config(drafts["perturbed"], k=8)
    )
    assert torch.equal(out, plain)
