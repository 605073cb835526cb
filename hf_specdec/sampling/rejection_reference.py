"""Rejection sampling in PyTorch (seed §12.2): the reference every backend is checked against,
and what every backend shares: the random draws and the target probabilities.

The algorithm is described in `rejection_sampler.py`, which dispatches between this reference
and the Triton kernels (`hf_specdec.kernels.rejection`, which import their shared parts from here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import SpecDecodeMetadata
from .tokens_in_play import TokensInPlay

PLACEHOLDER_TOKEN_ID = -1
NOISE_FLOOR = 1e-20  # the exponential race divides by E ~ Exp(1): a draw of 0 must not divide by zero


@dataclass
class RandomDraws:
    uniform: torch.Tensor  # [total_draft_tokens] float32 in [0, 1), one per draft
    exponential: torch.Tensor  # [rows, vocab] Exp(1) noise for each row's one extra token; [rows, width] with in_play
    in_play: TokensInPlay | None = None  # the noise covers each row's tokens in play only, in its narrow layout


def draw_random(
    generators: list[torch.Generator | None],
    metadata: SpecDecodeMetadata,
    vocab_size: int,
    device: torch.device,
    in_play: TokensInPlay | None = None,
) -> RandomDraws:
    """One uniform per draft and one exponential vector per row, each row from its own generator: over the
    vocabulary, or with `in_play` over the row's tokens in play (ones at the padding). The race needs noise
    only where a token can win: outside the tokens in play p is 0, and so is every weight it races with.

    Rows whose generator is None (greedy rows) draw nothing and get placeholder values.
    """
    uniform = torch.zeros(sum(metadata.num_draft_tokens), dtype=torch.float32, device=device)
    if in_play is None:
        noise_columns = [vocab_size] * metadata.num_rows
        exponential = torch.ones(metadata.num_rows, vocab_size, dtype=torch.float32, device=device)
    else:
        noise_columns = in_play.num_columns.tolist()
        exponential = torch.ones(in_play.columns.shape, dtype=torch.float32, device=device)
    start = 0
    for row, (generator, count) in enumerate(zip(generators, metadata.num_draft_tokens)):
        if generator is not None:
            # drawn where the generator lives (a CPU generator cannot fill a CUDA tensor), then copied
            uniform[start : start + count] = torch.rand(count, generator=generator, device=generator.device)
            # Exp(1) by inverse CDF, -log1p(-U): on CPU torch's exponential_ took 4.5x as long for
            # SmolLM2's 49k vocabulary. U has 24 random bits, the resolution at which the race's own
            # float32 division w / E rounds anyway.
            uniform_vector = torch.rand(noise_columns[row], generator=generator, device=generator.device)
            exponential[row, : noise_columns[row]] = uniform_vector.neg_().log1p_().neg_()
        start += count
    return RandomDraws(uniform=uniform, exponential=exponential, in_play=in_play)


def target_probabilities(logits: torch.Tensor, is_greedy: torch.Tensor) -> torch.Tensor | None:
    """p = softmax of every logits row, or None when every row is greedy (no p is needed).

    Both backends take p from here: a softmax computed another way (another summation order)
    can differ in the last bit, and that is enough to flip an accept test or a race now and then.
    """
    if bool(is_greedy.all()):
        return None
    return torch.softmax(logits, dim=-1)


def rejection_sample_reference(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept / reject every row's drafts, in PyTorch.

    Args:
        metadata: the step's ragged drafts.
        logits: `[total_draft_tokens + rows, vocab]` processed target logits, laid out as
            `metadata` says (float32).
        is_greedy: `[rows]` bool.
        draws: random draws (required when any row samples); with `draws.in_play` p and the race run over each
            row's tokens in play, which gives what whole rows give with the same noise there (and the rest
            of the noise anything).
        draft_probs: `[total_draft_tokens, vocab]` q of each draft, or None for one-hot drafts.

    Returns:
        output_token_ids `[rows, max_spec_len + 1]`: accepted drafts then the extra token,
        padded with -1; num_accepted `[rows]`: drafts accepted per row.
    """
    num_rows, device = metadata.num_rows, logits.device
    is_greedy = is_greedy.to(device)
    draft_ids = metadata.draft_token_ids
    num_draft = torch.tensor(metadata.num_draft_tokens, device=device)
    first_draft = metadata.cu_num_draft_tokens - num_draft  # flat index of each row's first draft
    in_play = None if draws is None else draws.in_play
    # p over whole rows, or over each row's tokens in play: the whole row's p there bit for bit (tokens_in_play.py)
    target_probs = target_probabilities(logits if in_play is None else in_play.narrow(logits), is_greedy)
    sampled_any = target_probs is not None
    if sampled_any and draws is None:
        raise ValueError("rejection_sample needs random draws for sampled rows")
    # the argmax at every logits position, read at the drafts and at the extra token; skipped when
    # every row samples (over a 49k vocabulary it was most of such a step's sampler time on CPU)
    argmax_tokens = None if sampled_any and not bool(is_greedy.any()) else logits.argmax(dim=-1)

    # 1. does each draft pass on its own?
    if argmax_tokens is not None:
        passes = draft_ids == argmax_tokens[metadata.target_logits_indices]
    if sampled_any:
        target_p = _probability_at(target_probs, in_play, metadata.target_logits_indices, draft_ids)
        draft_q = 1.0 if draft_probs is None else draft_probs.gather(1, draft_ids[:, None])[:, 0]
        sampled_passes = draws.uniform * draft_q < target_p
        if argmax_tokens is None:
            passes = sampled_passes
        else:
            passes = torch.where(torch.repeat_interleave(is_greedy, num_draft), passes, sampled_passes)

    # 2. accepted = the leading run of passing drafts; grids are [rows, max_spec_len]
    offsets = torch.arange(metadata.max_spec_len, device=device)
    in_row = offsets[None, :] < num_draft[:, None]
    grid_index = (first_draft[:, None] + offsets[None, :]).clamp(max=max(len(draft_ids) - 1, 0))
    num_accepted = (in_row & passes[grid_index]).to(torch.int64).cumprod(dim=1).sum(dim=1)

    # 3. one extra token per row: at the first rejected position, or at the bonus position
    extra_index = metadata.bonus_logits_indices - num_draft + num_accepted
    if sampled_any:
        weights = target_probs[extra_index]
        rejected = num_accepted < num_draft
        if bool(rejected.any()):
            rejected_draft = torch.where(rejected, first_draft + num_accepted, 0)
            if draft_probs is None:  # one-hot q: max(0, p - q) is p with the rejected token zeroed
                residual = _without_token(weights, in_play, draft_ids[rejected_draft])
            else:
                draft_q = draft_probs[rejected_draft]
                residual = (weights - (draft_q if in_play is None else draft_q.gather(1, in_play.columns))).clamp_min(0.0)
            weights = torch.where(rejected[:, None], residual, weights)
        race = weights / draws.exponential.clamp_min(NOISE_FLOOR)
        extra_tokens = race.argmax(dim=-1)
        if in_play is not None:  # the whole row's argmax: its first column where no weight is positive
            in_vocabulary = in_play.columns.gather(1, extra_tokens[:, None])[:, 0]
            extra_tokens = torch.where(race.amax(dim=-1) > 0, in_vocabulary, 0)
        if argmax_tokens is not None:
            extra_tokens = torch.where(is_greedy, argmax_tokens[extra_index], extra_tokens)
    else:
        extra_tokens = argmax_tokens[extra_index]

    output = torch.full(
        (num_rows, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    accepted_grid = offsets[None, :] < num_accepted[:, None]
    output[:, :-1] = torch.where(accepted_grid, draft_ids[grid_index], PLACEHOLDER_TOKEN_ID)
    output[torch.arange(num_rows, device=device), num_accepted] = extra_tokens
    return output, num_accepted


def _probability_at(
    probs: torch.Tensor, in_play: TokensInPlay | None, positions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """p of each token at its logits position: from whole rows, or from narrow ones (0 where the token is
    not in play)."""
    if in_play is None:
        return probs[positions, tokens]
    columns = in_play.narrow_columns(in_play.row_of_position[positions], tokens)
    return torch.where(columns >= 0, probs[positions, columns.clamp_min(0)], 0.0)


def _without_token(weights: torch.Tensor, in_play: TokensInPlay | None, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's weights with its token's zeroed (whole rows, or narrow ones where the token is in play)."""
    if in_play is None:
        return weights.scatter(1, tokens[:, None], 0.0)
    columns = in_play.narrow_columns(torch.arange(len(tokens)), tokens)
    zeroed = weights.scatter(1, columns.clamp_min(0)[:, None], 0.0)
    return torch.where((columns >= 0)[:, None], zeroed, weights)
