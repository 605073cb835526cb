"""Block verification (`rejection_sample_method="block"`, Sun et al. 2024, arXiv 2403.10444,
Algorithm 2): `block_verify_reference` and the Triton kernels `block_verify_triton`.

1. The kernels (run by Triton's interpreter, TRITON_INTERPRET=1 as in test_rejection_kernels.py)
   emit the reference's tokens and accepted lengths on the same draws: ragged rows (0..8 drafts),
   greedy / sampled / mixed rows, sampled q and one-hot drafts, vocabularies that are not a
   multiple of the kernel's block, the interpreter's tiles and a GPU launch's chunked ones.
2. The reference is exact: on a 4-token vocabulary whose target p and drafter q depend on the
   whole prefix (tables indexed by it), many independent rows draft from q, are verified, and
   each row's output is completed to a fixed length L from the exact target; the joint
   distribution of the L tokens must pass a chi-square test against the product of p's
   conditionals, and the same test must reject deliberately broken variants.
3. The expected accepted length is P(tau >= i) = E[w_i] summed (the paper's lemma), at least
   token-wise's, strictly more when q is far from p, equal for one-hot drafts: enumerated exactly
   and checked against simulated rows verified both ways on the same draws.
4. End to end: `model.generate(..., rejection_sample_method="block")` with a sampling draft model
   follows the target distribution (test_sampling_distribution's chi-square test), the kernels
   forced on reproduce the reference's samples, and the configuration errors name the key.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail these tests, not skip them)
from conftest import build_small_vocab_llama
from scipy.stats import chisquare
from test_rejection_kernels import chunked_tiles, random_case
from test_sampling_distribution import (
    PROMPT,
    SETTINGS,
    chi_square_pvalue,
    exact_distribution,
    speculative_samples,
)

import hf_specdec
from hf_specdec.sampling import block_verification
from hf_specdec.sampling.block_verification import block_verify_reference
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_sampler import (
    BACKEND_ENV_VAR,
    RandomDraws,
    rejection_sample,
    rejection_sample_reference,
)


@pytest.fixture(scope="module")
def kernels():
    """The block kernels, run by Triton's interpreter (conftest sets TRITON_INTERPRET=1 first)."""
    from hf_specdec.kernels import block_verification as block_kernels
    from hf_specdec.kernels import rejection

    assert rejection.kernels_are_interpreted(), (
        "TRITON_INTERPRET=1 was not set when triton was first imported (tests/conftest.py sets it)"
    )
    return block_kernels


def rejection_kernels():
    from hf_specdec.kernels import rejection

    return rejection


# --- 1. the kernels against the reference ------------------------------------------------------


def sampled_case(
    seed: int, num_rows: int, vocab_size: int, row_kinds: str, one_hot: bool, max_drafts: int = 8
):
    """A ragged step whose drafts are real draws from q (so the weights w_i, masses Z_i and stop
    probabilities h_i take every kind of value): p and q are related softmaxes (q = p's logits
    plus noise; most p rows favour one token, so runs of drafts are accepted), some q rows equal
    p exactly (Z = 0, w stays 1), some p and q rows are cut to their top 5 (exact zeros: q(x) = 0
    where p(x) > 0 and the reverse), rows have 0..max_drafts drafts, and a few noise draws are
    exactly 0."""
    generator = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, max_drafts + 1, (num_rows,), generator=generator)
    num_draft[0], num_draft[-1] = 0, max_drafts  # a row without drafts and a full row, always
    num_logits = int(num_draft.sum()) + num_rows
    logits = torch.randn(num_logits, vocab_size, generator=generator) * 1.5
    boosted = torch.rand(num_logits, generator=generator) < 0.85  # a favoured token: runs of accepted drafts
    favoured = torch.randint(0, vocab_size, (num_logits,), generator=generator)
    logits[boosted, favoured[boosted]] += math.log(vocab_size) + 3.0
    metadata = SpecDecodeMetadata.from_drafts([np.zeros(int(n), dtype=np.int64) for n in num_draft])
    draft_logits = logits[metadata.target_logits_indices] + torch.randn(
        len(metadata.target_logits_indices), vocab_size, generator=generator
    ) * (0.2 + 1.3 * torch.rand(len(metadata.target_logits_indices), 1, generator=generator))
    if vocab_size > 5:
        for values in (logits, draft_logits):
            cut = torch.rand(len(values), generator=generator) < 0.2
            fifth = values[cut].topk(5, dim=-1).values[:, -1:]
            values[cut] = values[cut].masked_fill(values[cut] < fifth, float("-inf"))
    draft_probs = torch.softmax(draft_logits, dim=-1)
    same = torch.rand(len(draft_probs), generator=generator) < 0.15
    draft_probs[same] = torch.softmax(logits[metadata.target_logits_indices[same]], dim=-1)
    metadata.draft_token_ids = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
    is_greedy = {
        "random": torch.zeros(num_rows, dtype=torch.bool),
        "mixed": torch.rand(num_rows, generator=generator) < 0.4,
    }[row_kinds]
    exponential = torch.empty(num_rows, vocab_size).exponential_(generator=generator)
    exponential[torch.rand(num_rows, vocab_size, generator=generator) < 0.01] = 0.0
    draws = RandomDraws(uniform=torch.rand(len(draft_probs), generator=generator), exponential=exponential)
    return {
        "metadata": metadata,
        "logits": logits,
        "is_greedy": is_greedy,
        "draws": draws,
        "draft_probs": None if one_hot else draft_probs,
    }


def assert_block_backends_agree(kernels, case: dict, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    expected_tokens, expected_accepted = block_verify_reference(**case)
    tokens, accepted = kernels.block_verify_triton(**case, tiles=tiles)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(tokens, expected_tokens)
    return tokens, accepted


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("row_kinds", ["random", "mixed"])
@pytest.mark.parametrize("vocab_size", [7, 50, 1000])  # the interpreter's blocks: 8, 64, 512 columns
def test_kernels_match_reference(kernels, vocab_size, row_kinds, one_hot):
    differs_from_token = stopped = completed = 0
    for seed in range(3):
        case = sampled_case(seed, num_rows=12, vocab_size=vocab_size, row_kinds=row_kinds, one_hot=one_hot)
        tokens, accepted = assert_block_backends_agree(kernels, case)
        num_draft = torch.tensor(case["metadata"].num_draft_tokens)
        sampled = ~case["is_greedy"]
        stopped += int((sampled & (accepted < num_draft)).sum())
        completed += int((sampled & (accepted == num_draft) & (num_draft > 0)).sum())
        token_tokens, _ = rejection_sample_reference(**case)
        differs_from_token += int((tokens != token_tokens).any(dim=1).sum())
        # test_rejection_kernels' cases: tied maxima, -inf logits, drafts mostly the favoured token
        assert_block_backends_agree(
            kernels, random_case(seed, 12, vocab_size, row_kinds, with_draft_probs=not one_hot, max_drafts=8)
        )
    assert stopped and completed, "no row stopped early, or none accepted all its drafts"
    assert differs_from_token > 0, (
        "block and token-wise verification agreed everywhere: the cases test little"
    )


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_kernels_match_reference_with_gpu_tiles(kernels, one_hot):
    """One (row, position) pair per program and the vocabulary split into 3 chunks of 16 columns
    (50 = 16 + 16 + 18, the last chunk ragged): masses are summed over chunks, races reduced."""
    for seed in (3, 4):
        case = sampled_case(seed, num_rows=3, vocab_size=50, row_kinds="mixed", one_hot=one_hot, max_drafts=6)
        assert_block_backends_agree(kernels, case, tiles=chunked_tiles(rejection_kernels(), 16, 3))


def test_kernels_edge_cases(kernels):
    vocab = 10
    # q == p at every position: w stays 1 and every mass Z is 0 (h = 0/0 -> 0 before the last
    # draft, h_g = 1), so every sampled row accepts all its drafts, as exact arithmetic says
    metadata = SpecDecodeMetadata.from_drafts(
        [np.array(d, dtype=np.int64) for d in ([3, 1, 4], [], [1, 5], [9])]
    )
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(metadata.num_rows + 6, vocab, generator=generator)
    draws = RandomDraws(
        uniform=torch.rand(6, generator=generator),
        exponential=torch.empty(4, vocab).exponential_(generator=generator),
    )
    case = {
        "metadata": metadata,
        "logits": logits,
        "is_greedy": torch.tensor([False, False, False, True]),
        "draws": draws,
        "draft_probs": torch.softmax(logits[metadata.target_logits_indices], dim=-1),
    }
    _, accepted = assert_block_backends_agree(kernels, case)
    assert accepted[:3].tolist() == [3, 0, 2]

    # a step without any draft, and every row greedy (token-wise's rule, the token-wise kernels)
    metadata = SpecDecodeMetadata.from_drafts([np.zeros(0, dtype=np.int64)] * 3)
    for is_greedy in (torch.zeros(3, dtype=torch.bool), torch.tensor([True, False, True])):
        case = {
            "metadata": metadata,
            "logits": logits[:3],
            "is_greedy": is_greedy,
            "draws": RandomDraws(uniform=torch.zeros(0), exponential=draws.exponential[:3]),
            "draft_probs": None,
        }
        _, accepted = assert_block_backends_agree(kernels, case)
        assert accepted.tolist() == [0, 0, 0]
    greedy = sampled_case(5, num_rows=6, vocab_size=vocab, row_kinds="random", one_hot=False)
    greedy["is_greedy"] = torch.ones(6, dtype=torch.bool)
    tokens, accepted = assert_block_backends_agree(kernels, greedy)
    expected_tokens, expected_accepted = rejection_sample_reference(**greedy)
    assert torch.equal(tokens, expected_tokens) and torch.equal(accepted, expected_accepted)

    # more than 32 drafts and missing draws are refused, as token-wise
    metadata = SpecDecodeMetadata.from_drafts([np.arange(33) % vocab])
    with pytest.raises(ValueError, match="at most 32"):
        kernels.block_verify_triton(metadata, torch.randn(34, vocab), torch.zeros(1, dtype=torch.bool))
    metadata = SpecDecodeMetadata.from_drafts([np.arange(3)])
    for verify in (kernels.block_verify_triton, block_verify_reference):
        with pytest.raises(ValueError, match="random draws"):
            verify(metadata, torch.randn(4, vocab), torch.zeros(1, dtype=torch.bool))


# Compiles both kernels for an H100 / H200 (sm_90) in a process without TRITON_INTERPRET (Triton
# ships ptxas: no GPU needed), as test_rejection_kernels does for the token-wise kernels: checks
# compiled-mode typing, IEEE divisions (div.rn, as torch), and that every float64 fused
# multiply-add the compiler formed multiplies two float32 values (w * p: exact in float64, so
# fusing cannot round differently from the reference's multiply then add) and that no float32
# one was formed (the weights' multiply must round on its own).
AHEAD_OF_TIME_COMPILE = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_specdec.kernels import block_verification as block, rejection

POINTERS = {"best_columns_ptr": "*i32", "mass_ptr": "*fp64", "is_greedy_ptr": "*i1"}
INT64_POINTERS = {"output_ptr", "num_accepted_ptr", "draft_ids_ptr", "cu_num_draft_ptr",
                  "target_logits_indices_ptr", "bonus_logits_indices_ptr"}

def argument_type(name):
    if name.isupper():
        return "constexpr"
    if name.endswith("_ptr"):
        return POINTERS.get(name, "*i64" if name in INT64_POINTERS else "*fp32")
    return "fp32" if name == "noise_floor" else "i32"

def compile_for_sm90(kernel, constexprs, num_warps=4):
    signature = {name: argument_type(name) for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    defined = {}
    for line in lines:
        match = re.match(r"[a-z][a-z0-9.]*\\s+(%[a-z]+[0-9]+),", line)
        if match:
            defined[match.group(1)] = line
    def from_float32(register):
        line = defined.get(register, "")
        if line.startswith("neg.f64"):
            line = defined.get(re.findall(r"%[a-z]+[0-9]+", line)[1], "")
        return line.startswith("cvt.f64.f32")
    for line in lines:
        assert not re.match(r"fma\\.[a-z.]*f32", line), line
        if line.startswith("fma.rn.f64"):
            operands = re.findall(r"%[a-z]+[0-9]+", line)
            assert from_float32(operands[1]) and from_float32(operands[2]), line
    assert "div.full" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx
    return ptx

for num_rows, vocab_size, output_width in ((256, 151_936, 9), (1, 49_152, 6)):
    tiles = rejection.LaunchTiles.choose(num_rows, output_width, vocab_size, interpreted=False)
    block_chunks = triton.next_power_of_2(tiles.vocab_chunks(vocab_size)[1])
    for has_draft_probs in (False, True):
        ptx = compile_for_sm90(block._block_position_kernel, {
            "HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_ROWS": tiles.rows, "BLOCK_POSITIONS": tiles.positions,
            "BLOCK_V": tiles.vocab, "BLOCK_CHUNKS": block_chunks,
        }, num_warps=tiles.warps)
        assert "div.rn.f32" in ptx and ("div.rn.f64" in ptx) == (not has_draft_probs)
        ptx = compile_for_sm90(block._block_accept_kernel, {
            "HAS_DRAFT_PROBS": has_draft_probs, "PLACEHOLDER": -1, "BLOCK_ROWS": tiles.accept_rows,
            "BLOCK_SPEC": triton.next_power_of_2(output_width), "BLOCK_CHUNKS": block_chunks,
        })
        assert "div.rn.f64" in ptx
print("compiled")
"""


def test_kernels_compile_for_gpu(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", AHEAD_OF_TIME_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled" in result.stdout


# --- 2. exactness of the reference on prefix-dependent tables ----------------------------------

VOCAB = 4
DRAFTS = 3  # g: drafts per row (ragged rows draft 0..g)
LENGTH = DRAFTS + 1  # every row's output is completed to this many tokens


class PrefixTable:
    """A distribution over VOCAB tokens for every prefix of up to `max_depth` tokens.

    Row `offset[depth] + code` holds the distribution after the prefix whose base-VOCAB code is
    `code` (first token most significant)."""

    def __init__(self, probs: torch.Tensor, max_depth: int):
        self.probs = probs  # [sum of VOCAB**d for d <= max_depth, VOCAB] float64
        self.offset = [sum(VOCAB**d for d in range(depth)) for depth in range(max_depth + 1)]

    @classmethod
    def random(cls, seed: int, max_depth: int, spread: float, zeros: float) -> PrefixTable:
        """softmax(spread * N(0, 1)) per prefix; a share `zeros` of the rows has a token at probability 0."""
        generator = torch.Generator().manual_seed(seed)
        num_prefixes = sum(VOCAB**d for d in range(max_depth + 1))
        logits = torch.randn(num_prefixes, VOCAB, generator=generator, dtype=torch.float64) * spread
        cut = torch.rand(num_prefixes, generator=generator) < zeros
        logits[cut, torch.randint(0, VOCAB, (int(cut.sum()),), generator=generator)] = -math.inf
        return cls(torch.softmax(logits, dim=-1), max_depth)

    def mixed_with(self, other: PrefixTable, share: float) -> PrefixTable:
        return PrefixTable((1 - share) * self.probs + share * other.probs, len(self.offset) - 1)

    def rows(self, codes: torch.Tensor, depth: int) -> torch.Tensor:
        return self.offset[depth] + codes

    def probability(self, sequence: tuple[int, ...]) -> float:
        """P(sequence) = the product of its conditionals."""
        result, code = 1.0, 0
        for depth, token in enumerate(sequence):
            result *= float(self.probs[self.offset[depth] + code, token])
            code = code * VOCAB + token
        return result


def verify_table_rows(
    target: PrefixTable,
    drafter: PrefixTable,
    num_draft: torch.Tensor,
    one_hot: bool,
    generator: torch.Generator,
    verifiers=(block_verify_reference,),
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Row r drafts num_draft[r] tokens from the drafter (sampled; one-hot: its argmax) and every
    verifier checks them against the target on the same draws.

    Returns the drafts `[rows, max drafts]` and each verifier's (output tokens, num_accepted)."""
    num_rows, max_drafts = len(num_draft), int(num_draft.max())
    codes = torch.zeros(num_rows, dtype=torch.int64)
    prefix_rows, drafts = [], []
    for depth in range(max_drafts + 1):
        prefix_rows.append(target.rows(codes, depth))
        if depth < max_drafts:
            q = drafter.probs[drafter.rows(codes, depth)]
            token = q.argmax(dim=-1) if one_hot else torch.multinomial(q, 1, generator=generator)[:, 0]
            drafts.append(token)
            codes = codes * VOCAB + token
    prefix_rows = torch.stack(prefix_rows, dim=1)  # [rows, max drafts + 1]: position j's prefix row
    drafts = torch.stack(drafts, dim=1)
    positions = torch.arange(max_drafts + 1)
    kept_positions = positions[None, :] <= num_draft[:, None]
    kept_drafts = positions[None, :max_drafts] < num_draft[:, None]
    metadata = SpecDecodeMetadata.from_drafts([row[:n] for row, n in zip(drafts.numpy(), num_draft.tolist())])
    # p = softmax(log p), its rows laid out as metadata says
    logits = target.probs[prefix_rows[kept_positions]].log().float()
    draft_probs = None if one_hot else drafter.probs[prefix_rows[:, :max_drafts][kept_drafts]].float()
    draws = RandomDraws(
        uniform=torch.rand(int(num_draft.sum()), generator=generator),
        exponential=torch.empty(num_rows, VOCAB).exponential_(generator=generator),
    )
    is_greedy = torch.zeros(num_rows, dtype=torch.bool)
    results = [
        verify(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs) for verify in verifiers
    ]
    return drafts, results


def completed_outputs(
    target: PrefixTable, output: torch.Tensor, num_accepted: torch.Tensor, generator: torch.Generator
) -> np.ndarray:
    """Each row's emitted tokens (num_accepted + 1), continued to LENGTH tokens from the exact target."""
    sequences = torch.full((len(output), LENGTH), -1, dtype=torch.int64)
    emitted = torch.arange(output.shape[1])[None, :] <= num_accepted[:, None]
    sequences[:, : output.shape[1]] = torch.where(emitted, output, -1)
    codes = torch.zeros(len(output), dtype=torch.int64)
    for depth in range(LENGTH):
        missing = sequences[:, depth] < 0
        sampled = torch.multinomial(target.probs[target.rows(codes, depth)], 1, generator=generator)[:, 0]
        sequences[:, depth] = torch.where(missing, sampled, sequences[:, depth])
        codes = codes * VOCAB + sequences[:, depth]
    return sequences.numpy()


def table_pvalue(
    target: PrefixTable, drafter: PrefixTable, one_hot: bool, seed: int, num_rows: int = 100_000
):
    """The chi-square p-value of the completed outputs of ragged rows (0..DRAFTS drafts) against the
    target's exact LENGTH-token distribution, and the rows' accepted lengths."""
    generator = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, DRAFTS + 1, (num_rows,), generator=generator)
    num_draft[0] = DRAFTS
    _, [(output, num_accepted)] = verify_table_rows(target, drafter, num_draft, one_hot, generator)
    samples = completed_outputs(target, output, num_accepted, generator)
    exact = {s: target.probability(s) for s in itertools.product(range(VOCAB), repeat=LENGTH)}
    return chi_square_pvalue(samples, exact), num_accepted, num_draft


@pytest.fixture(scope="module")
def tables():
    """A target and a drafter far from it, both prefix-dependent, with exact zeros in both."""
    target = PrefixTable.random(11, DRAFTS, spread=1.2, zeros=0.25)
    drafter = PrefixTable.random(12, DRAFTS, spread=1.5, zeros=0.25)
    return target, drafter


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled_q", "one_hot"])
def test_reference_follows_the_target_distribution(tables, one_hot):
    target, drafter = tables
    pvalue, num_accepted, num_draft = table_pvalue(target, drafter, one_hot, seed=1)
    # every stop occurred: at 0, in the middle, and after the last draft (bonus token)
    full = num_draft == DRAFTS
    assert {0, 1, 2, 3} <= set(num_accepted[full].tolist())
    assert pvalue > 1e-3


def _residual_from_p(weight, target_row, draft_row, draft_ids):
    return target_row.clone()


def _weight_without_cap(weight, target_p, draft_q):
    drawable = draft_q > 0
    return torch.where(
        drawable, weight * target_p / torch.where(drawable, draft_q, 1.0), (weight * target_p > 0).float()
    )


def _h_without_mass(mass, weight):
    return STOP_PROBABILITY(torch.zeros_like(mass), weight)


def _h_without_one_minus_w(mass, weight):
    return torch.where(mass > 0, torch.ones_like(mass), torch.zeros_like(mass))


RESIDUAL_WEIGHTS = block_verification.residual_weights
STOP_PROBABILITY = block_verification.stop_probability
BROKEN = {
    # the extra token from p itself, not from the residual max(w p - q, 0)
    "residual_from_p": ("residual_weights", _residual_from_p, (False, True)),
    # w_i = w_{i-1} p / q without the min(., 1) (one-hot: prod p <= 1 anyway, so sampled q only)
    "weight_without_cap": ("next_weight", _weight_without_cap, (False,)),
    # h_i = 0 before the last draft: the residual mass Z_i left out, rows stop at 0 or g only
    "h_without_mass": ("stop_probability", _h_without_mass, (False, True)),
    # h_i = 1 wherever Z_i > 0: the 1 - w_i term left out
    "h_without_one_minus_w": ("stop_probability", _h_without_one_minus_w, (False, True)),
}


@pytest.mark.parametrize(
    "broken,one_hot",
    [(name, one_hot) for name, (_, _, kinds) in BROKEN.items() for one_hot in kinds],
)
def test_broken_variants_are_detected(tables, monkeypatch, broken, one_hot):
    """The test above has power: each variant, on the same rows, fails it by far. (One plausible
    slip is too small to see: the residual at tau as max(p - q, 0), w_tau dropped, passes even
    with 200k rows on these tables, so it is not listed.)"""
    target, drafter = tables
    attribute, replacement, _ = BROKEN[broken]
    monkeypatch.setattr(block_verification, attribute, replacement)
    pvalue, _, _ = table_pvalue(target, drafter, one_hot, seed=1)
    assert pvalue < 1e-6


# --- 3. expected accepted length ---------------------------------------------------------------


def expected_accepted_lengths(target: PrefixTable, drafter: PrefixTable, num_draft: int, one_hot: bool):
    """E[tau] of block and token-wise verification, by enumerating every draft block.

    Token-wise P(tau >= i) = E[prod_{j <= i} min(1, p(X_j) / q(X_j))]; block P(tau >= i) = E[w_i],
    w_i = min(w_{i-1} p(X_i) / q(X_i), 1) (the paper's lemma); one-hot: q(X) = 1, both prod p(X_j)."""
    block = token = 0.0
    for depth in range(1, num_draft + 1):  # P(tau >= depth), summed over the draft prefixes X_1..X_depth
        for prefix in itertools.product(range(VOCAB), repeat=depth):
            probability, weight, ratio_product, code = 1.0, 1.0, 1.0, 0
            for position, x in enumerate(prefix):
                q_row = drafter.probs[drafter.offset[position] + code]
                q = float(q_row.argmax() == x) if one_hot else float(q_row[x])
                p = float(target.probs[target.offset[position] + code, x])
                probability *= q
                if probability == 0:
                    break
                weight = min(weight * p / q, 1.0)
                ratio_product *= min(p / q, 1.0)
                code = code * VOCAB + x
            block += probability * weight
            token += probability * ratio_product
    return block, token


@pytest.mark.parametrize("closeness", ["far", "near", "one_hot"])
def test_block_accepts_at_least_as_much_as_token_wise(tables, closeness):
    target, far_drafter = tables
    one_hot = closeness == "one_hot"
    # one-hot drafts: the near drafter's argmax, which the target often agrees with (tau spreads over 0..g)
    drafter = far_drafter if closeness == "far" else far_drafter.mixed_with(target, 0.7)
    block_expected, token_expected = expected_accepted_lengths(target, drafter, DRAFTS, one_hot)

    generator = torch.Generator().manual_seed(2)
    num_rows = 40_000
    num_draft = torch.full((num_rows,), DRAFTS)
    _, [(_, block), (_, token)] = verify_table_rows(
        target,
        drafter,
        num_draft,
        one_hot,
        generator,
        verifiers=(block_verify_reference, rejection_sample_reference),
    )
    block, token = block.double(), token.double()
    standard_error = max(block.std(), token.std()) / math.sqrt(num_rows)
    assert abs(block.mean() - block_expected) < 4 * standard_error, (block.mean(), block_expected)
    assert abs(token.mean() - token_expected) < 4 * standard_error, (token.mean(), token_expected)
    difference = block - token  # on the same draws
    difference_error = max(difference.std() / math.sqrt(num_rows), 1e-12)
    if one_hot:  # the same accepted lengths in distribution: P(tau >= i) = prod p(X_j) either way
        assert block_expected == pytest.approx(token_expected, rel=1e-12)
        assert abs(difference.mean()) < 4 * difference_error
        drafts = [int(x) for x in verify_table_rows(target, drafter, num_draft[:1], True, generator)[0][0]]
        survival = [1.0] + [target.probability(tuple(drafts[:i])) for i in range(1, DRAFTS + 1)] + [0.0]
        expected = [(survival[i] - survival[i + 1]) * num_rows for i in range(DRAFTS + 1)]
        for accepted in (block, token):
            observed = torch.bincount(accepted.long(), minlength=DRAFTS + 1).numpy()
            assert chisquare(observed, expected).pvalue > 1e-3
    else:
        assert block_expected >= token_expected
        assert difference.mean() > -3 * difference_error
        if closeness == "far":  # strictly more, by a margin the simulation resolves
            assert block_expected > token_expected + 0.05, (block_expected, token_expected)
            assert difference.mean() > 6 * difference_error


# --- 4. end to end through generate() ----------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_pair():
    """The 16-token target of test_sampling_distribution and a draft model with other weights."""
    return hf_specdec.enable(build_small_vocab_llama(0)), build_small_vocab_llama(1)


def block_config(draft, k: int = 3, **extra) -> dict:
    return {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": k,
        "rejection_sample_method": "block",
        **extra,
    }


def test_generate_with_block_follows_the_target_distribution(small_vocab_pair, monkeypatch):
    """Sampled drafts with their q, 3 new tokens: the first step verifies a block of 2 drafts
    (where block and token-wise differ); the output must still follow the target, and a broken
    residual must not."""
    target, draft = small_vocab_pair
    methods = []
    original = rejection_sample

    def recorded(*args, method="token", **kwargs):
        methods.append((method, kwargs.get("draft_probs") is not None))
        return original(*args, method=method, **kwargs)

    from hf_specdec.loop import step

    monkeypatch.setattr(step, "rejection_sample", recorded)
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(target, sampling)
    samples, metrics = speculative_samples(target, sampling, block_config(draft), num_samples=4000, seed=2024)
    assert methods and all(method == "block" for method, _ in methods)
    assert any(sampled_q for _, sampled_q in methods), "block verification of sampled q never ran"
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    assert chi_square_pvalue(samples, exact) > 1e-3

    # the same run with the extra token drawn from p instead of the residual fails the test
    monkeypatch.setattr(block_verification, "residual_weights", _residual_from_p)
    broken, _ = speculative_samples(target, sampling, block_config(draft), num_samples=4000, seed=2024)
    assert chi_square_pvalue(broken, exact) < 1e-6


def test_generate_block_with_kernels_reproduces_the_reference(small_vocab_pair, kernels, monkeypatch):
    """The same seeds through generate() with the Triton kernels forced on (interpreted) and the
    reference: the same samples."""
    target, draft = small_vocab_pair
    sampling = SETTINGS["temperature_topk_topp"]
    calls = []
    original = kernels.block_verify_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "block_verify_triton", counted)
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    with_kernels, _ = speculative_samples(
        target, sampling, block_config(draft), num_samples=300, seed=5, rows=300
    )
    assert calls, "the kernels never ran"
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    reference, _ = speculative_samples(
        target, sampling, block_config(draft), num_samples=300, seed=5, rows=300
    )
    assert np.array_equal(with_kernels, reference)


def test_block_with_greedy_decoding_is_refused(small_vocab_pair):
    target, draft = small_vocab_pair
    input_ids = torch.tensor([PROMPT])
    with pytest.raises(ValueError, match="rejection_sample_method") as error:
        target.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            speculative_config=block_config(draft),
        )
    assert "do_sample" in str(error.value)


def test_unknown_method_is_refused(small_vocab_pair):
    target, draft = small_vocab_pair
    input_ids = torch.tensor([PROMPT])
    with pytest.raises(ValueError, match="rejection_sample_method") as error:
        target.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            do_sample=True,
            pad_token_id=0,
            speculative_config={**block_config(draft), "rejection_sample_method": "tree"},
        )
    assert "'tree'" in str(error.value) and "token" in str(error.value) and "block" in str(error.value)
    metadata = SpecDecodeMetadata.from_drafts([np.arange(2)])
    with pytest.raises(ValueError, match="allowed: token, block"):
        rejection_sample(metadata, torch.randn(3, 16), torch.ones(1, dtype=torch.bool), method="tree")
