"""The Triton rejection kernels against the PyTorch reference on a CUDA device, compiled (not
interpreted), on the test suite's adversarial batches: ragged drafts 0..32 per row, greedy /
random / mixed rows, one-hot drafts and draft probabilities, tied maxima, -inf-masked logits and
zero noise draws, vocabularies from 7 to 152k.

    python benchmarks/check_kernels_cuda.py

The tests run the same comparison under Triton's CPU interpreter; this is its GPU counterpart
(run on a CUDA machine; exits 1 on any difference). Batches are built on CPU by the tests'
`random_case` and then moved to the GPU, where both backends run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# compiled kernels: tests/conftest.py would otherwise turn Triton's interpreter on
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from test_rejection_kernels import ROW_KINDS, random_case  # noqa: E402

from hf_specdec.kernels.rejection import LaunchTiles, rejection_sample_triton  # noqa: E402
from hf_specdec.sampling.rejection_sampler import RandomDraws, rejection_sample_reference  # noqa: E402

VOCAB_SIZES = (7, 128, 1000, 50_000, 151_936)


def to_device(case: dict, device: torch.device) -> dict:
    metadata = case["metadata"]
    for field in ("draft_token_ids", "cu_num_draft_tokens", "target_logits_indices", "bonus_logits_indices"):
        setattr(metadata, field, getattr(metadata, field).to(device))
    draws = case["draws"]
    return {
        "metadata": metadata,
        "logits": case["logits"].to(device),
        "is_greedy": case["is_greedy"].to(device),
        "draws": RandomDraws(uniform=draws.uniform.to(device), exponential=draws.exponential.to(device)),
        "draft_probs": None if case["draft_probs"] is None else case["draft_probs"].to(device),
    }


def check_case(case: dict) -> bool:
    """Both backends on one batch: with the tiles a launch picks and with one vocabulary chunk per
    pair (the shape a batch of 256 gets)."""
    expected = rejection_sample_reference(**case)
    width, vocab_size = case["metadata"].max_spec_len + 1, case["logits"].shape[-1]
    one_chunk = LaunchTiles.choose(256, width, vocab_size, interpreted=False)
    return all(
        all(torch.equal(a, b) for a, b in zip(expected, rejection_sample_triton(**case, tiles=tiles)))
        for tiles in (None, one_chunk)
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "check_kernels_cuda.py needs a CUDA device; without one, tests/test_rejection_kernels.py runs the "
            "same comparison under Triton's CPU interpreter"
        )
    device = torch.device("cuda")
    checked = differing = 0
    for vocab_size in VOCAB_SIZES:
        for row_kinds in ROW_KINDS:
            for with_draft_probs in (False, True):
                for seed, num_rows in ((0, 12), (1, 12), (2, 1)):
                    case = random_case(seed, num_rows, vocab_size, row_kinds, with_draft_probs)
                    checked += 1
                    if not check_case(to_device(case, device)):
                        differing += 1
                        print(
                            f"DIFFERS: vocab {vocab_size}, {row_kinds} rows, draft probs {with_draft_probs}, "
                            f"seed {seed}, {num_rows} rows"
                        )
    print(
        f"{checked} batches compared with the reference on {torch.cuda.get_device_name(device)}: "
        f"{differing} differ"
    )
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
