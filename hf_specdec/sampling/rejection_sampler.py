"""Rejection sampling (seed §12.2), PyTorch reference.

Per row: accept drafts left to right while they pass, then emit one more token: the bonus token
when every draft passed, otherwise a recovered token at the first rejected position.

- greedy rows: a draft passes when it equals the argmax of the target's processed logits; the
  extra token is that argmax (exactly what plain greedy `generate()` picks).
- sampled rows: a draft x passes with probability min(1, p(x)/q(x)) (test: u * q(x) < p(x));
  q is one-hot for deterministic drafts. A recovered token is drawn from max(0, p - q)
  normalised, a bonus token from p. Both draws use the exponential race
  argmax(w / E), E ~ Exp(1), which samples proportionally to w without normalising.

Random numbers come in as arguments (`RandomDraws`), drawn from one generator per row, so the
GPU kernels can be checked against this reference on the same draws and seeded runs reproduce.

`rejection_sample` is the one entry point: CUDA tensors go to the Triton kernels
(`hf_specdec.kernels.rejection`), CPU tensors to `rejection_sample_reference` below; the
environment variable `HF_SPECDEC_REJECTION_BACKEND` overrides the choice. Both read the target
probabilities from `target_probabilities`, so given the same draws they emit the same tokens.

`method="block"` (`speculative_config.rejection_sample_method`) runs block verification instead
(`block_verification.py`: Sun et al. 2024, Algorithm 2; Triton kernels in
`hf_specdec.kernels.block_verification`), on the same draws and the same backend choice. It
changes sampled rows only: greedy rows accept the longest prefix equal to the argmax either way.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

from ..config import REJECTION_SAMPLE_METHODS
from .block_verification import block_verify_reference
from .metadata import SpecDecodeMetadata
from .rejection_reference import (
    NOISE_FLOOR,
    PLACEHOLDER_TOKEN_ID,
    RandomDraws,
    draw_random,
    rejection_sample_reference,
    target_probabilities,
)
from .tokens_in_play import tokens_in_play

__all__ = [
    "NOISE_FLOOR",
    "PLACEHOLDER_TOKEN_ID",
    "REJECTION_SAMPLE_METHODS",
    "RandomDraws",
    "block_verify_reference",
    "draw_random",
    "draw_step_random",
    "greedy_accept_on_host",
    "rejection_backend",
    "rejection_sample",
    "rejection_sample_reference",
    "target_probabilities",
]

BACKEND_ENV_VAR = "HF_SPECDEC_REJECTION_BACKEND"
BACKENDS = ("auto", "triton", "torch")


def rejection_backend(device: torch.device) -> str:
    """The implementation `rejection_sample` runs for tensors on `device`: "triton" or "torch".

    `$HF_SPECDEC_REJECTION_BACKEND`, read at every call: "auto" (the default) runs the Triton
    kernels on CUDA tensors when triton is installed and the reference otherwise; "triton" and
    "torch" force one. Forcing "triton" for CPU tensors needs TRITON_INTERPRET=1 in the
    environment before the kernels are first imported (Triton's interpreter; for tests).
    """
    choice = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV_VAR}={choice!r} is not a backend; allowed: {', '.join(BACKENDS)}")
    if choice == "auto":
        kernels_usable = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return "triton" if kernels_usable else "torch"
    return choice


def rejection_sample(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
    method: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept / reject every row's drafts on the backend `rejection_backend` picks.

    `method`: "token" (each draft on its own, `rejection_sample_reference`) or "block" (block
    verification, `block_verify_reference`; greedy rows as with "token"). The other arguments and
    the results are those of `rejection_sample_reference`.
    """
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"rejection_sample method={method!r} is unknown; allowed: {', '.join(REJECTION_SAMPLE_METHODS)}")
    kernels = rejection_backend(logits.device) == "triton"
    if draws is not None and draws.in_play is not None and (kernels or method == "block"):
        raise ValueError("draws over the tokens in play are for the PyTorch token sampler; draw over the vocabulary")
    if not kernels and draws is None and logits.device.type == "cpu" and bool(is_greedy.all()):
        return greedy_accept_on_host(metadata, logits)  # either method: greedy rows accept the same way
    if method == "block":
        if kernels:
            from hf_specdec.kernels.block_verification import block_verify_triton  # triton is optional

            return block_verify_triton(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs)
        return block_verify_reference(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs)
    if kernels:
        from hf_specdec.kernels.rejection import rejection_sample_triton  # triton is optional: import on use

        return rejection_sample_triton(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs)
    return rejection_sample_reference(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs)


def draw_step_random(
    generators: list[torch.Generator | None],
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    method: str = "token",
    tree: bool = False,
) -> RandomDraws | None:
    """A step's random draws, None when no row samples: each sampled row's noise over its tokens in play
    (`tokens_in_play`) where the PyTorch token sampler takes a chain (at Gemma 3's 262k vocabulary, 8 rows:
    26 ms of draws over the vocabulary), over the vocabulary elsewhere."""
    if all(generator is None for generator in generators):
        return None
    narrow = not tree and method == "token" and rejection_backend(logits.device) == "torch"
    in_play = tokens_in_play(logits, metadata, ~is_greedy) if narrow else None
    return draw_random(generators, metadata, logits.shape[-1], logits.device, in_play)


def greedy_accept_on_host(metadata: SpecDecodeMetadata, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample_reference` for CPU logits of greedy rows only, in NumPy after one argmax: each row
    accepts its leading drafts equal to the argmax, then emits the argmax after them. The reference's
    fifteen-odd tensor ops and torch's argmax cost 0.25-0.33 ms a step at batch 1 on a 2-core CPU (0.6-0.8% of a
    SmolLM2 step); this, 0.03-0.05. NumPy's argmax, like torch's, returns the first of tied maxima (or NaNs)."""
    argmax = logits.float().numpy().argmax(axis=-1)
    drafts, num_draft = metadata.draft_token_ids.numpy(), metadata.num_draft_tokens
    passes = drafts == argmax[metadata.target_logits_indices.numpy()]
    output = np.full((len(num_draft), metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    num_accepted = np.zeros(len(num_draft), dtype=np.int64)
    first_draft = 0
    for row, (count, bonus) in enumerate(zip(num_draft, metadata.bonus_logits_indices.tolist())):
        accepted = int(np.argmin(np.append(passes[first_draft : first_draft + count], False)))
        output[row, :accepted] = drafts[first_draft : first_draft + accepted]
        output[row, accepted] = argmax[bonus - count + accepted]
        num_accepted[row] = accepted
        first_draft += count
    return torch.from_numpy(output), torch.from_numpy(num_accepted)
