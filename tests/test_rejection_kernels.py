"""The Triton rejection sampler (`hf_specdec.kernels.rejection`) against the PyTorch reference.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, so no GPU is needed;
triton itself is (the `test` extra installs it) and these tests fail without it. Given the same
random draws both backends must emit the same tokens and accepted lengths, bit for bit, on
ragged batches of greedy, sampled and mixed rows, with one-hot drafts and with draft
probabilities, from a 7-token vocabulary to 50k. The kernels run both with the tiles a GPU
launch uses (one (row, position) pair per program) and with the interpreter's (many per
program). End to end, the decode loop with the kernels forced on must still reproduce plain
greedy generate() and, sampling, the exact target distribution.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail these tests, not skip them)
from conftest import ngram_config, plain_generate, repeated_span_batch
from test_sampling_distribution import (
    NGRAM_CONFIG,
    SETTINGS,
    chi_square_pvalue,
    exact_distribution,
    speculative_samples,
)
from test_sampling_distribution import model as sampling_model  # noqa: F401  (module-scoped fixture)

from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_sampler import (
    BACKEND_ENV_VAR,
    RandomDraws,
    greedy_accept_on_host,
    rejection_backend,
    rejection_sample,
    rejection_sample_reference,
)

ROW_KINDS = ("greedy", "random", "mixed")


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, run by Triton's interpreter (conftest sets TRITON_INTERPRET=1 first)."""
    from hf_specdec.kernels import rejection

    assert rejection.kernels_are_interpreted(), (
        "TRITON_INTERPRET=1 was not set when triton was first imported (tests/conftest.py sets it)"
    )
    return rejection


def gpu_tiles(kernels, case: dict):
    """The tiles a CUDA launch would use for this case, run under the interpreter."""
    metadata = case["metadata"]
    return kernels.LaunchTiles.choose(
        metadata.num_rows, metadata.max_spec_len + 1, case["logits"].shape[-1], interpreted=False
    )


def chunked_tiles(kernels, columns_per_iteration: int, vocab_splits: int):
    """GPU-style tiles (one pair per program) with the vocabulary split into chunks, as small batches
    get them on a GPU, at a size the interpreter runs quickly."""
    return kernels.LaunchTiles(
        rows=1, positions=1, vocab=columns_per_iteration, accept_rows=2, vocab_splits=vocab_splits
    )


def random_case(
    seed: int, num_rows: int, vocab_size: int, row_kinds: str, with_draft_probs: bool, max_drafts: int = 32
):
    """A ragged step with the situations the kernels must get right.

    Each logits row favours one token (boosted so it keeps real mass even in a 50k vocabulary)
    and most drafts are that token, so runs of accepted drafts, rejections and fully accepted rows
    (bonus token) all occur. Some rows are rounded to whole numbers (tied maxima: torch's first
    index must win), some masked to their top 5 with -inf (p with exact zeros, as after top-k),
    and some noise draws are exactly 0 (the reference clamps them).
    """
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_draft = rng.integers(0, max_drafts + 1, num_rows)
    num_logits = int(num_draft.sum()) + num_rows
    boost = math.log(vocab_size) + 2.0
    favoured = torch.randint(0, vocab_size, (num_logits,), generator=generator)
    logits = torch.randn(num_logits, vocab_size, generator=generator) * 2.0
    logits[torch.arange(num_logits), favoured] += boost
    tied = torch.rand(num_logits, generator=generator) < 0.25
    logits[tied] = logits[tied].round()
    masked = (torch.rand(num_logits, generator=generator) < 0.25) & ~tied
    if vocab_size > 5 and masked.any():
        fifth = logits[masked].topk(5, dim=-1).values[:, -1:]
        logits[masked] = logits[masked].masked_fill(logits[masked] < fifth, float("-inf"))

    metadata = SpecDecodeMetadata.from_drafts([np.zeros(n, dtype=np.int64) for n in num_draft])
    draft_logits = metadata.target_logits_indices
    random_drafts = torch.randint(0, vocab_size, (len(draft_logits),), generator=generator)
    takes_favoured = torch.rand(len(draft_logits), generator=generator) < 0.8
    metadata.draft_token_ids = torch.where(takes_favoured, favoured[draft_logits], random_drafts)

    draft_probs = None
    if with_draft_probs:
        draft_logits_q = torch.randn(len(draft_logits), vocab_size, generator=generator) * 2.0
        draft_logits_q[torch.arange(len(draft_logits)), metadata.draft_token_ids] += boost
        draft_probs = torch.softmax(draft_logits_q, dim=-1)
        # q == p on some drafts: their residual max(p - q, 0) is all zero if they are rejected
        same = torch.rand(len(draft_logits), generator=generator) < 0.2
        draft_probs[same] = torch.softmax(logits[draft_logits[same]], dim=-1)

    is_greedy = {
        "greedy": torch.ones(num_rows, dtype=torch.bool),
        "random": torch.zeros(num_rows, dtype=torch.bool),
        "mixed": torch.rand(num_rows, generator=generator) < 0.5,
    }[row_kinds]
    exponential = torch.empty(num_rows, vocab_size).exponential_(generator=generator)
    exponential[torch.rand(num_rows, vocab_size, generator=generator) < 0.01] = 0.0
    draws = RandomDraws(uniform=torch.rand(len(draft_logits), generator=generator), exponential=exponential)
    return {
        "metadata": metadata,
        "logits": logits,
        "is_greedy": is_greedy,
        "draws": draws,
        "draft_probs": draft_probs,
    }


def assert_backends_agree(kernels, case: dict, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    expected_tokens, expected_accepted = rejection_sample_reference(**case)
    tokens, accepted = kernels.rejection_sample_triton(**case, tiles=tiles)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(tokens, expected_tokens)
    return tokens, accepted


def assert_covers_outcomes(accepted: torch.Tensor, case: dict) -> None:
    """The batch had rejections and fully accepted rows, so both extra-token kinds were compared."""
    num_draft = torch.tensor(case["metadata"].num_draft_tokens)
    assert (accepted < num_draft).any(), "no draft was rejected: recovered tokens went untested"
    assert ((accepted == num_draft) & (num_draft > 0)).any(), "no row accepted all its drafts"


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one_hot", "draft_probs"])
@pytest.mark.parametrize("row_kinds", ROW_KINDS)
@pytest.mark.parametrize("vocab_size", [7, 128, 1000])
def test_kernels_match_reference(kernels, vocab_size, row_kinds, with_draft_probs):
    for seed in range(3):
        case = random_case(
            seed, num_rows=12, vocab_size=vocab_size, row_kinds=row_kinds, with_draft_probs=with_draft_probs
        )
        _, accepted = assert_backends_agree(kernels, case)
        if seed == 0:
            assert_covers_outcomes(accepted, case)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one_hot", "draft_probs"])
@pytest.mark.parametrize("row_kinds", ROW_KINDS)
@pytest.mark.parametrize("vocab_size", [7, 300])
def test_kernels_match_reference_with_gpu_tiles(kernels, vocab_size, row_kinds, with_draft_probs):
    case = random_case(
        7,
        num_rows=4,
        vocab_size=vocab_size,
        row_kinds=row_kinds,
        with_draft_probs=with_draft_probs,
        max_drafts=12,
    )
    assert_backends_agree(kernels, case, tiles=gpu_tiles(kernels, case))
    assert_backends_agree(kernels, case, tiles=chunked_tiles(kernels, 16, 7))


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one_hot", "draft_probs"])
@pytest.mark.parametrize("row_kinds", ROW_KINDS)
def test_kernels_match_reference_large_vocab(kernels, row_kinds, with_draft_probs):
    case = random_case(
        10,  # a seed whose every batch here has a rejection, a fully accepted row and an accepted draft
        num_rows=3,
        vocab_size=50_000,
        row_kinds=row_kinds,
        with_draft_probs=with_draft_probs,
        max_drafts=6,
    )
    _, accepted = assert_backends_agree(kernels, case)
    assert_covers_outcomes(accepted, case)
    if row_kinds == "mixed":
        assert_backends_agree(kernels, case, tiles=gpu_tiles(kernels, case))


def test_gpu_tiles_split_the_vocabulary_only_for_small_launches(kernels):
    """Few (row, position) pairs get their vocabulary split into chunks (enough programs to fill a
    GPU); a batch of 256 gets one chunk. Chunks are whole loop iterations, cover the vocabulary,
    and none is empty."""
    small = kernels.LaunchTiles.choose(1, 5, 151_936, interpreted=False)
    large = kernels.LaunchTiles.choose(256, 9, 151_936, interpreted=False)
    assert small.vocab_splits > 1 and large.vocab_splits == 1
    for vocab_size in (7, 2048, 2049, 50_000, 151_936):
        for vocab_splits in (1, 3, 7, 64):
            tiles = kernels.LaunchTiles(rows=1, positions=1, vocab=512, accept_rows=1, vocab_splits=vocab_splits)
            chunk_columns, num_chunks = tiles.vocab_chunks(vocab_size)
            assert chunk_columns % tiles.vocab == 0 and num_chunks <= vocab_splits
            assert (num_chunks - 1) * chunk_columns < vocab_size <= num_chunks * chunk_columns


def test_ties_break_to_the_first_index(kernels):
    """Tied maxima everywhere: greedy argmax, the exponential race, and all-zero residuals."""
    vocab = 10
    metadata = SpecDecodeMetadata.from_drafts(
        [np.array(d, dtype=np.int64) for d in ([4, 4, 2], [4, 0], [], [9])]
    )
    num_drafts, num_logits = (
        sum(metadata.num_draft_tokens),
        metadata.num_rows + sum(metadata.num_draft_tokens),
    )
    logits = torch.zeros(num_logits, vocab)
    logits[:, [4, 7]] = 1.0  # argmax 4 (the first of two); p, and so the race, ties 4 with 7
    constant_noise = torch.ones(metadata.num_rows, vocab)
    row_kinds = (
        torch.ones(4, dtype=torch.bool),
        torch.zeros(4, dtype=torch.bool),
        torch.tensor([True, False, True, False]),
    )
    for is_greedy in row_kinds:
        for uniform in (
            torch.zeros(num_drafts),
            torch.full((num_drafts,), 0.999),
        ):  # accept whatever p allows / reject
            draws = RandomDraws(uniform=uniform, exponential=constant_noise)
            case = {
                "metadata": metadata,
                "logits": logits,
                "is_greedy": is_greedy,
                "draws": draws,
                "draft_probs": None,
            }
            assert_backends_agree(kernels, case)
            assert_backends_agree(kernels, case, tiles=gpu_tiles(kernels, case))
            # five chunks of two columns: 4 and 7 are in different chunks, so the tie is broken
            # when the accept kernel reduces the chunks
            assert_backends_agree(kernels, case, tiles=chunked_tiles(kernels, 2, 5))

    # q == p and p(first draft) = 0: every drafting row rejects at once, its residual is all zero,
    # so every race value is 0 and the recovered token is column 0
    metadata = SpecDecodeMetadata.from_drafts(
        [np.array(d, dtype=np.int64) for d in ([2, 4], [0], [], [9, 9])]
    )
    num_drafts, num_logits = (
        sum(metadata.num_draft_tokens),
        metadata.num_rows + sum(metadata.num_draft_tokens),
    )
    logits = torch.zeros(num_logits, vocab)
    logits[:, [4, 7]] = 1.0
    logits[:, [0, 2, 9]] = float("-inf")
    draws = RandomDraws(uniform=torch.full((num_drafts,), 0.5), exponential=constant_noise)
    draft_probs = torch.softmax(logits[metadata.target_logits_indices], dim=-1)
    case = {
        "metadata": metadata,
        "logits": logits,
        "is_greedy": torch.zeros(4, dtype=torch.bool),
        "draws": draws,
        "draft_probs": draft_probs,
    }
    tokens, accepted = assert_backends_agree(kernels, case)
    assert accepted.tolist() == [0, 0, 0, 0]
    assert tokens[:, 0].tolist() == [0, 0, 4, 0]

    # u == p(x) exactly (p = 0.5 on two tokens) rejects: the test is u * q(x) < p(x), strict
    metadata = SpecDecodeMetadata.from_drafts([np.array([1, 1])])
    logits = torch.full((3, vocab), float("-inf"))
    logits[:, :2] = 0.0
    for draft_probs in (None, torch.full((2, vocab), 0.1)):
        draws = RandomDraws(
            uniform=torch.tensor([0.4999, 0.5 if draft_probs is None else 5.0]),
            exponential=constant_noise[:1],
        )
        case = {
            "metadata": metadata,
            "logits": logits,
            "is_greedy": torch.zeros(1, dtype=torch.bool),
            "draws": draws,
            "draft_probs": draft_probs,
        }
        tokens, accepted = assert_backends_agree(kernels, case)
        assert accepted.tolist() == [1]


def test_batch_without_drafts_and_full_length_rows(kernels):
    generator = torch.Generator().manual_seed(3)
    for drafts in ([[], [], []], [[5] * 32, [], [5] * 32]):
        metadata = SpecDecodeMetadata.from_drafts([np.array(d, dtype=np.int64) for d in drafts])
        num_logits = metadata.num_rows + sum(metadata.num_draft_tokens)
        logits = torch.randn(num_logits, 64, generator=generator)
        logits[:, 5] += 100.0  # every draft is the argmax and carries p ~ 1: rows run to the bonus token
        for is_greedy in (torch.ones(3, dtype=torch.bool), torch.tensor([False, True, False])):
            draws = RandomDraws(
                uniform=torch.rand(sum(metadata.num_draft_tokens), generator=generator),
                exponential=torch.empty(3, 64).exponential_(generator=generator),
            )
            case = {
                "metadata": metadata,
                "logits": logits,
                "is_greedy": is_greedy,
                "draws": draws,
                "draft_probs": None,
            }
            tokens, accepted = assert_backends_agree(kernels, case)
            assert accepted.tolist() == metadata.num_draft_tokens
            assert_backends_agree(kernels, case, tiles=gpu_tiles(kernels, case))


def test_kernels_reject_bad_input(kernels):
    metadata = SpecDecodeMetadata.from_drafts([np.arange(33)])
    with pytest.raises(ValueError, match="at most 32"):
        kernels.rejection_sample_triton(metadata, torch.randn(34, 40), torch.ones(1, dtype=torch.bool))
    metadata = SpecDecodeMetadata.from_drafts([np.arange(3)])
    with pytest.raises(ValueError, match="random draws"):
        kernels.rejection_sample_triton(metadata, torch.randn(4, 40), torch.zeros(1, dtype=torch.bool))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_rows_on_the_host_match_the_reference(seed):
    """Every row greedy on CPU logits: `rejection_sample` takes the NumPy path, which must give the
    reference's tokens and counts (rows without drafts, rejections, fully accepted rows, tied maxima)."""
    case = random_case(seed, num_rows=1 + seed % 8, vocab_size=(7, 1000, 49152)[seed % 3], row_kinds="greedy",
                       with_draft_probs=False, max_drafts=6)  # fmt: skip
    case["draws"] = None
    expected = rejection_sample_reference(**case)
    for got in (greedy_accept_on_host(case["metadata"], case["logits"]), rejection_sample(**case)):
        assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    tied = SpecDecodeMetadata.from_drafts([np.array(d, dtype=np.int64) for d in ([4, 4, 2], [], [7])])
    logits = torch.zeros(6, 10)
    logits[:, [4, 7]] = 1.0  # the first of tied maxima (4) wins
    assert torch.equal(greedy_accept_on_host(tied, logits)[0], rejection_sample_reference(tied, logits, torch.ones(3, dtype=torch.bool))[0])


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert rejection_backend(torch.device("cpu")) == "torch"
    assert rejection_backend(torch.device("cuda")) == "triton"  # triton is installed here
    for forced in ("triton", "torch", " Triton "):
        monkeypatch.setenv(BACKEND_ENV_VAR, forced)
        assert rejection_backend(torch.device("cpu")) == forced.strip().lower()
    monkeypatch.setenv(BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV_VAR):
        rejection_backend(torch.device("cpu"))


def test_package_imports_without_triton():
    """triton is optional: without it hf_specdec imports, and "auto" picks the reference even for CUDA."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hf_specdec\n"
        "from hf_specdec.sampling.rejection_sampler import rejection_backend\n"
        "assert rejection_backend(torch.device('cuda')) == 'torch'\n"
        "assert not any(name.startswith('triton') and sys.modules[name] for name in sys.modules)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != BACKEND_ENV_VAR}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)


# Compiles both kernels for an H100 / H200 (sm_90) with the tiles a CUDA launch uses, in a process
# without TRITON_INTERPRET: Triton ships ptxas, so this needs no GPU, and it checks what the
# interpreter does not (compiled-mode typing, early return, boolean loads) plus that the race
# divides with IEEE rounding (div.rn.f32), as torch does, not with an approximate division.
AHEAD_OF_TIME_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_specdec.kernels import rejection

INT32_POINTERS = {"best_columns_ptr"}
INT64_POINTERS = {"output_ptr", "num_accepted_ptr", "draft_ids_ptr", "cu_num_draft_ptr",
                  "target_logits_indices_ptr", "bonus_logits_indices_ptr"}

def argument_type(name):
    if name.isupper():
        return "constexpr"
    if name.endswith("_ptr"):
        if name == "is_greedy_ptr":
            return "*i1"
        return "*i32" if name in INT32_POINTERS else "*i64" if name in INT64_POINTERS else "*fp32"
    return "fp32" if name == "noise_floor" else "i32"

def compile_for_sm90(kernel, constexprs, num_warps=4):
    signature = {name: argument_type(name) for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

# batch 256 (one chunk per pair) and batch 1 (the vocabulary split into chunks)
for num_rows, vocab_size, output_width in ((256, 151_936, 9), (256, 50_000, 33), (1, 151_936, 2)):
    tiles = rejection.LaunchTiles.choose(num_rows, output_width, vocab_size, interpreted=False)
    num_chunks = tiles.vocab_chunks(vocab_size)[1]
    for has_draft_probs in (False, True):
        for all_greedy in (False, True):
            ptx = compile_for_sm90(rejection._position_tokens_kernel, {
                "ALL_GREEDY": all_greedy, "HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_ROWS": tiles.rows,
                "BLOCK_POSITIONS": tiles.positions, "BLOCK_V": tiles.vocab,
                "BLOCK_SPEC": triton.next_power_of_2(output_width),
            }, num_warps=tiles.warps)
            if not all_greedy:
                assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        compile_for_sm90(rejection._accept_kernel, {
            "HAS_DRAFT_PROBS": has_draft_probs, "PLACEHOLDER": -1, "BLOCK_ROWS": tiles.accept_rows,
            "BLOCK_SPEC": triton.next_power_of_2(output_width),
            "BLOCK_CHUNKS": triton.next_power_of_2(num_chunks),
        })
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


# --- end to end: the decode loop with the kernels forced on ------------------------------------


@pytest.fixture
def triton_backend(kernels, monkeypatch):
    """Forces the kernels for CPU tensors and counts their calls (so a test proves they ran)."""
    calls = []
    original = kernels.rejection_sample_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(kernels, "rejection_sample_triton", counted)
    return calls


@pytest.mark.parametrize("k,lookup", [(5, (1, 4)), (8, (2, 3))])
def test_greedy_identity_with_kernels(enabled_llama, triton_backend, k, lookup):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=ngram_config(k, *lookup),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    assert out.spec_metrics["num_draft_tokens"] > out.spec_metrics["num_accepted_tokens"]
    assert len(triton_backend) == out.spec_metrics["num_target_forwards"]


def test_sampling_distribution_with_kernels(sampling_model, triton_backend, monkeypatch):  # noqa: F811
    """test_sampling_distribution's chi-square test with the kernels on; and the reference's very samples."""
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(sampling_model, sampling)
    samples, _ = speculative_samples(sampling_model, sampling, NGRAM_CONFIG, num_samples=4000, seed=1234)
    assert triton_backend, "the kernels never ran"
    assert chi_square_pvalue(samples, exact) > 1e-3
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    calls = len(triton_backend)
    reference, _ = speculative_samples(sampling_model, sampling, NGRAM_CONFIG, num_samples=1000, seed=1234)
    assert len(triton_backend) == calls
    assert np.array_equal(samples[:1000], reference)
