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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RandomDraws:
    uniform: torch.Tensor  # [total_draft_tokens] float32 in [0, 1), one per draft
    exponential: torch.Tensor  # [rows, vocab] Exp(1) noise for each row's one extra token


def draw_random(
    generators: list[torch.Generator | None], metadata: SpecDecodeMetadata, vocab_size: int, device: torch.device
) -> RandomDraws:
    """One uniform per draft and one exponential vector per row, each row from its own generator.

    Rows whose generator is None (greedy rows) draw nothing and get placeholder values.
    """
    uniform = torch.zeros(sum(metadata.num_draft_tokens), dtype=torch.float32, device=device)
    exponential = torch.ones(metadata.num_rows, vocab_size, dtype=torch.float32, device=device)
    start = 0
    for row, (generator, count) in enumerate(zip(generators, metadata.num_draft_tokens)):
        if generator is not None:
            uniform[start : start + count] = torch.rand(count, generator=generator, device=device)
            exponential[row].exponential_(generator=generator)
        start += count
    return RandomDraws(uniform=uniform, exponential=exponential)


def rejection_sample(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept / reject every row's drafts.

    Args:
        metadata: the step's ragged drafts.
        logits: `[total_draft_tokens + rows, vocab]` processed target logits, laid out as
            `metadata` says (float32).
        is_greedy: `[rows]` bool.
        draws: random draws (required when any row samples).
        draft_probs: `[total_draft_tokens, vocab]` q of each draft, or None for one-hot drafts.

    Returns:
        output_token_ids `[rows, max_spec_len + 1]`: accepted drafts then the extra token,
        padded with -1; num_accepted `[rows]`: drafts accepted per row.
    """
    num_rows, device = metadata.num_rows, logits.device
    draft_ids = metadata.draft_token_ids
    num_draft = torch.tensor(metadata.num_draft_tokens, device=device)
    first_draft = metadata.cu_num_draft_tokens - num_draft  # flat index of each row's first draft
    sampled_any = not bool(is_greedy.all())
    if sampled_any and draws is None:
        raise ValueError("rejection_sample needs random draws for sampled rows")

    # 1. does each draft pass on its own?
    draft_logits = logits[metadata.target_logits_indices]
    passes = draft_ids == draft_logits.argmax(dim=-1)
    if sampled_any:
        target_p = torch.softmax(draft_logits, dim=-1).gather(1, draft_ids[:, None])[:, 0]
        draft_q = 1.0 if draft_probs is None else draft_probs.gather(1, draft_ids[:, None])[:, 0]
        is_greedy_draft = torch.repeat_interleave(is_greedy, num_draft)
        passes = torch.where(is_greedy_draft, passes, draws.uniform * draft_q < target_p)

    # 2. accepted = the leading run of passing drafts; grids are [rows, max_spec_len]
    offsets = torch.arange(metadata.max_spec_len, device=device)
    in_row = offsets[None, :] < num_draft[:, None]
    grid_index = (first_draft[:, None] + offsets[None, :]).clamp(max=max(len(draft_ids) - 1, 0))
    num_accepted = (in_row & passes[grid_index]).to(torch.int64).cumprod(dim=1).sum(dim=1)

    # 3. one extra token per row: at the first rejected position, or at the bonus position
    extra_logits = logits[metadata.bonus_logits_indices - num_draft + num_accepted]
    extra_tokens = extra_logits.argmax(dim=-1)
    if sampled_any:
        weights = torch.softmax(extra_logits, dim=-1)
        rejected = num_accepted < num_draft
        if bool(rejected.any()):
            rejected_draft = torch.where(rejected, first_draft + num_accepted, 0)
            if draft_probs is None:  # one-hot q: max(0, p - q) is p with the rejected token zeroed
                residual = weights.scatter(1, draft_ids[rejected_draft][:, None], 0.0)
            else:
                residual = (weights - draft_probs[rejected_draft]).clamp_min(0.0)
            weights = torch.where(rejected[:, None], residual, weights)
        sampled_extra = (weights / draws.exponential.clamp_min(1e-20)).argmax(dim=-1)
        extra_tokens = torch.where(is_greedy, extra_tokens, sampled_extra)

    output = torch.full(
        (num_rows, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    accepted_grid = offsets[None, :] < num_accepted[:, None]
    output[:, :-1] = torch.where(accepted_grid, draft_ids[grid_index], PLACEHOLDER_TOKEN_ID)
    output[torch.arange(num_rows, device=device), num_accepted] = extra_tokens
    return output, num_accepted
