"""The rejection sampler over each row's tokens in play (`sampling/tokens_in_play.py`): the same tokens as over
whole rows on the same noise, bit for bit; the noise drawn only where a token can win; where it does not apply."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import kstest

from hf_specdec.sampling import rejection_sampler, tokens_in_play
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_sampler import RandomDraws, draw_step_random, rejection_sample
from hf_specdec.sampling.tokens_in_play import LANE_COLUMNS, finite_entries


@pytest.fixture(autouse=True)
def narrow_at_any_size(monkeypatch):
    """The narrow layout for steps of any number of draws (it takes only steps of 100k or more)."""
    monkeypatch.setattr(tokens_in_play, "MIN_WHOLE_ROW_DRAWS", 0)


def _top_k_rows(generator: torch.Generator, rows: int, vocab: int, top_k: int) -> torch.Tensor:
    scores = torch.randn(rows, vocab, generator=generator) * (0.5 + 6 * float(torch.rand(1, generator=generator)))
    kth = scores.topk(top_k, dim=1).values[:, -1:]
    return scores.masked_fill(scores < kth, -math.inf)


def _step(generator: torch.Generator, vocab: int, top_k: int) -> tuple[SpecDecodeMetadata, torch.Tensor]:
    """A step's processed logits after top-k and its drafts: most drafts in play, some anywhere, rows of 0-5 drafts."""
    num_draft = torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator).tolist()
    logits = _top_k_rows(generator, sum(num_draft) + len(num_draft), vocab, top_k)
    drafts, position = [], 0
    for count in num_draft:
        row = []
        for offset in range(count):
            finite = (logits[position + offset] > -math.inf).nonzero()[:, 0]
            pick = finite[torch.randint(0, len(finite), (1,), generator=generator)]
            row.append(int(pick if torch.rand(1, generator=generator) < 0.8 else torch.randint(0, vocab, (1,), generator=generator)))
        drafts.append(np.array(row, dtype=np.int64))
        position += count + 1
    return SpecDecodeMetadata.from_drafts(drafts), logits


def _over_the_vocabulary(draws: RandomDraws, vocab: int) -> RandomDraws:
    """The same noise at the tokens in play, ones elsewhere, laid out over the vocabulary."""
    in_play = draws.in_play
    exponential = torch.ones(len(in_play.columns), vocab)
    kept = ~in_play.padding
    rows = torch.arange(len(in_play.columns))[:, None].expand_as(in_play.columns)
    exponential[rows[kept], in_play.columns[kept]] = draws.exponential[kept]
    return RandomDraws(uniform=draws.uniform, exponential=exponential)


def test_finite_entries_are_the_finite_scores_in_order():
    generator = torch.Generator().manual_seed(0)
    for vocab in (4096, 49_152, 1000):  # 1000: no multiple of 64, found column by column
        scores = _top_k_rows(generator, 9, vocab, 20)
        scores[3, :] = torch.randn(vocab, generator=generator)  # a row with every score finite
        rows, columns = finite_entries(scores)
        expected_rows, expected_columns = (scores > -math.inf).nonzero(as_tuple=True)
        assert torch.equal(rows, expected_rows) and torch.equal(columns, expected_columns)


def test_narrow_rows_give_the_whole_rows_probabilities_bit_for_bit():
    """Each position over its row's blocks in play: softmax gives those columns the whole row's p exactly. The
    same blocks in reverse order give other sums at some rows: the test can tell."""
    generator = torch.Generator().manual_seed(1)
    differs_out_of_order = 0
    for vocab, top_k in ((8192, 8), (49_152, 50), (262_144, 20)):
        metadata, logits = _step(generator, vocab, top_k)
        in_play = tokens_in_play.tokens_in_play(logits, metadata, torch.ones(metadata.num_rows, dtype=torch.bool))
        assert in_play is not None
        narrow = in_play.narrow(logits)
        columns = in_play.columns[in_play.row_of_position]
        kept = ~in_play.padding[in_play.row_of_position]
        whole = logits.softmax(-1).gather(1, columns)
        assert torch.equal(narrow.softmax(-1)[kept], whole[kept])
        # every finite score is in its row's narrow layout
        assert torch.equal(narrow.exp().sum(1), logits.exp().sum(1))
        blocks_reversed = narrow.view(len(narrow), -1, LANE_COLUMNS).flip(1).softmax(-1).flip(1).view(len(narrow), -1)
        differs_out_of_order += int((blocks_reversed[kept] != whole[kept]).any())
    assert differs_out_of_order


@pytest.mark.parametrize("draft_probabilities", [False, True])
def test_the_sampler_over_the_tokens_in_play_emits_what_whole_rows_emit_on_the_same_noise(draft_probabilities):
    """Random steps (greedy and sampled rows, drafts in play and not, one-hot and drafted q): the narrow sampler's
    tokens and counts equal the whole-row sampler's, given the noise laid out over the vocabulary."""
    generator = torch.Generator().manual_seed(2)
    narrow_steps = 0
    for trial in range(120):
        vocab = (4096, 8192)[trial % 2]
        metadata, logits = _step(generator, vocab, int(torch.randint(1, 40, (1,), generator=generator)))
        is_greedy = torch.rand(metadata.num_rows, generator=generator) < 0.2
        generators = [None if greedy else torch.Generator().manual_seed(trial * 8 + row) for row, greedy in enumerate(is_greedy)]
        draws = draw_step_random(generators, metadata, logits, is_greedy)
        if draws is None or draws.in_play is None:
            continue
        narrow_steps += 1
        draft_probs = None
        if draft_probabilities:
            draft_probs = torch.softmax(torch.randn(len(metadata.draft_token_ids), vocab, generator=generator) * 3, dim=-1)
        narrow = rejection_sample(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs)
        whole = rejection_sample(metadata, logits, is_greedy, draws=_over_the_vocabulary(draws, vocab), draft_probs=draft_probs)
        assert torch.equal(narrow[0], whole[0]) and torch.equal(narrow[1], whole[1]), trial
    assert narrow_steps >= 30


def test_noise_is_drawn_for_each_sampled_rows_tokens_in_play():
    """Sampled rows draw Exp(1) noise for their blocks in play only (ones at the padding); a greedy row draws
    nothing; the per-draft uniforms come first from each row's generator, as over the vocabulary."""
    generator = torch.Generator().manual_seed(3)
    vocab = 65_536
    metadata, logits = _step(generator, vocab, 30)
    while metadata.num_rows < 3:
        metadata, logits = _step(generator, vocab, 30)
    is_greedy = torch.zeros(metadata.num_rows, dtype=torch.bool)
    is_greedy[1] = True
    generators = [None if greedy else torch.Generator().manual_seed(row) for row, greedy in enumerate(is_greedy)]
    draws = draw_step_random(generators, metadata, logits, is_greedy)
    in_play = draws.in_play
    assert in_play is not None and in_play.num_columns[1] == 0 and torch.equal(draws.exponential[1], torch.ones(in_play.columns.shape[1]))
    finite_rows = in_play.row_of_position[(logits > -math.inf).nonzero()[:, 0]]
    assert set(finite_rows.tolist()) - {1} == set(range(metadata.num_rows)) - {1}
    for row in (0, 2):
        count = int(in_play.num_columns[row])
        assert count % LANE_COLUMNS == 0 and count <= vocab // 2
        assert torch.equal(draws.exponential[row, count:], torch.ones(draws.exponential.shape[1] - count))
        noise = draws.exponential[row, :count]
        assert kstest(noise.numpy(), "expon").pvalue > 1e-3
        again = torch.Generator().manual_seed(row)
        uniform = torch.rand(metadata.num_draft_tokens[row], generator=again)
        first = sum(metadata.num_draft_tokens[:row])
        assert torch.equal(draws.uniform[first : first + len(uniform)], uniform)
        assert torch.equal(noise, torch.rand(count, generator=again).neg_().log1p_().neg_())


@pytest.mark.parametrize(
    "case", ["few_draws", "every_score_finite", "vocab_not_multiple_of_64", "nan", "plus_inf", "float64", "torch_adds_otherwise"]
)
def test_steps_the_narrow_layout_does_not_cover_draw_over_the_vocabulary(case, monkeypatch):
    generator = torch.Generator().manual_seed(4)
    vocab = 4000 if case == "vocab_not_multiple_of_64" else 4096
    metadata, logits = _step(generator, vocab, 10)
    if case == "few_draws":
        monkeypatch.setattr(tokens_in_play, "MIN_WHOLE_ROW_DRAWS", metadata.num_rows * vocab + 1)
    elif case == "every_score_finite":
        logits = torch.randn(logits.shape, generator=generator)
    elif case in ("nan", "plus_inf"):
        logits[0, 5] = math.nan if case == "nan" else math.inf
    elif case == "float64":
        logits = logits.double()
    elif case == "torch_adds_otherwise":
        monkeypatch.setattr(tokens_in_play, "narrow_rows_agree", lambda: False)
    generators = [torch.Generator().manual_seed(row) for row in range(metadata.num_rows)]
    draws = draw_step_random(generators, metadata, logits, torch.zeros(metadata.num_rows, dtype=torch.bool))
    assert draws.in_play is None and draws.exponential.shape == (metadata.num_rows, vocab)


def test_trees_block_verification_and_the_kernels_draw_over_the_vocabulary(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    metadata, logits = _step(generator, 4096, 10)
    is_greedy = torch.zeros(metadata.num_rows, dtype=torch.bool)
    generators = [torch.Generator().manual_seed(row) for row in range(metadata.num_rows)]
    assert draw_step_random(generators, metadata, logits, is_greedy).in_play is not None
    assert draw_step_random(generators, metadata, logits, is_greedy, tree=True).in_play is None
    assert draw_step_random(generators, metadata, logits, is_greedy, method="block").in_play is None
    narrow = draw_step_random(generators, metadata, logits, is_greedy)
    with pytest.raises(ValueError, match="tokens in play are for the PyTorch token sampler"):
        rejection_sample(metadata, logits, is_greedy, draws=narrow, method="block")
    monkeypatch.setenv(rejection_sampler.BACKEND_ENV_VAR, "triton")
    assert draw_step_random(generators, metadata, logits, is_greedy).in_play is None
    with pytest.raises(ValueError, match="tokens in play are for the PyTorch token sampler"):
        rejection_sample(metadata, logits, is_greedy, draws=narrow)
