"""Block verification in PyTorch: `rejection_sample_method="block"`, the reference every backend
is checked against.

Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification Accelerates
Speculative Decoding" (2024, arXiv 2403.10444), Algorithm 2. Token-wise verification (what
`rejection_sample_reference` does) accepts each draft on its own and stops at the first
rejection; block verification decides on the whole block at once. The output still follows the
target distribution exactly, and the expected number of accepted drafts is at least token-wise's
on the same drafter (the paper's Theorem 2: it is the optimal verification of a single draft
block).

For one row with drafts X_1..X_g, p_j the target's (processed) distribution at logits position j
(j = 0..g: position j verifies X_{j+1}, position g is the bonus position) and q_j the drafter's
distribution X_{j+1} was drawn from (one-hot q_j = delta(X_{j+1}) when the drafter is
deterministic, `draft_probs` None):

1. weights (the paper's p_i, eq. (8) / Algorithm 2 line 4): w_0 = 1,
   w_i = min(w_{i-1} * p_{i-1}(X_i) / q_{i-1}(X_i), 1), i = 1..g.
2. residual masses: Z_i = sum_x max(w_i * p_i(x) - q_i(x), 0) for i = 1..g-1; for one-hot q
   this is w_i - w_i * p_i(X_{i+1}) (p sums to 1), no vocabulary pass.
3. stop probabilities (Algorithm 2 line 5): h_i = Z_i / (Z_i + 1 - w_i) for i < g, h_g = w_g.
4. accepted length tau = the largest i with eta_i < h_i, 0 if none (Algorithm 2 lines 7-9: the
   backward scan), eta_i ~ U[0, 1) one per draft.
5. the extra token (Algorithm 2 lines 10-13): from p_g (the bonus token) when tau = g, otherwise
   from the residual max(w_tau * p_tau - q_tau, 0) normalised; w_0 = 1 makes tau = 0 token-wise's
   recovery, and for one-hot q the residual is p_tau with X_{tau+1} zeroed at any tau.

Why it is exact (the paper's Lemma / Theorem 1, as we check it): h_i is chosen so that
E[P(tau >= i | drafts) | X_1..X_i] = w_i for every i, since
E_{X_{i+1} ~ q_i}[1 - w_{i+1}] = Z_i + 1 - w_i; the probability that the output starts with
X_1..X_i then y is then the target's. For one-hot drafts P(tau >= i) = w_i = prod p(X_j), the same
accepted lengths as token-wise: block verification gains only where drafts are sampled from a q
that is not one-hot (draft models, layer skip, MTP when the target samples).

Greedy rows (`is_greedy`) are not what block verification is about: they keep token-wise's
rule exactly (the longest prefix of drafts equal to the argmax, then the argmax), so greedy
output is identical with either method and to plain greedy `generate()`.

Numerics. Random numbers are token-wise's (`RandomDraws`: eta_i is the draft's uniform, the
extra token is the exponential race argmax(weights / E) over the row's noise vector), so seeded
runs reproduce and the Triton kernels (`hf_specdec.kernels.block_verification`) emit the same
tokens on the same draws. Both take every operation from here in the same order: the weights in
float32 (one IEEE multiply, divide and min per draft, which no backend can round differently),
residual masses and h in float64 (each product w * p(x) of two float32 is exact in float64, so a
fused multiply-add, which the GPU compiler forms where a product feeds an add, cannot change it:
hence the one-hot mass w - w * p, not w * (1 - p), whose product is rounded and would be fused
into h's denominator Z + (1 - w); the sum's order differs between backends, which moves h by
~1e-16 relative: two backends disagree only when eta lands that close to h), and the residual
weights rounded to float32 for the race. Two float edge cases, where exact arithmetic would not
go: 0/0 in h (Z_i = 0 and w_i = 1, where tau >= i + 1 holds surely in exact arithmetic) is 0,
and with the strict eta_i < h_i a position whose residual mass is 0 is never where a row stops
(tau >= 1); a drafted token with q(X) = 0 (not a draw from q) gets weight 1 when p(X) > 0, 0
otherwise.
"""

from __future__ import annotations

import torch

from .metadata import SpecDecodeMetadata
from .rejection_reference import (
    NOISE_FLOOR,
    PLACEHOLDER_TOKEN_ID,
    RandomDraws,
    rejection_sample_reference,
    target_probabilities,
)

# drafts whose residual mass is computed at once (bounds the float64 [drafts, vocab] temporaries)
MASS_CHUNK_DRAFTS = 64


def next_weight(weight: torch.Tensor, target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """w_i = min(w_{i-1} * (p(X_i) / q(X_i)), 1) in float32; q(X_i) = 0: 1 if w_{i-1} * p(X_i) > 0, else 0.

    The kernels compute exactly this: one division rounded to nearest, one multiply, one min.
    """
    drawable = draft_q > 0
    ratio = target_p / torch.where(drawable, draft_q, torch.ones_like(draft_q))
    scaled = torch.minimum(weight * ratio, torch.ones_like(weight))
    return torch.where(drawable, scaled, (weight * target_p > 0).to(weight.dtype))


def stop_probability(mass: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h_i = Z_i / (Z_i + (1 - w_i)) in float64 (mass: float64 Z_i, weight: float32 w_i); 0/0 is 0."""
    denominator = mass + (1.0 - weight.double())
    positive = denominator > 0
    return torch.where(positive, mass / torch.where(positive, denominator, torch.ones_like(denominator)), 0.0)


def residual_weights(
    weight: torch.Tensor, target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_ids: torch.Tensor
) -> torch.Tensor:
    """What the extra token of a row stopping before its last draft is raced over, float32:
    max(w * p - q, 0) (float64, then rounded), or p with the next draft zeroed for one-hot q.

    weight `[rows]` float32 w_tau; target_row `[rows, vocab]` p_tau; draft_row `[rows, vocab]`
    q_tau or None; draft_ids `[rows]` X_{tau+1}.
    """
    if draft_row is None:
        return target_row.scatter(1, draft_ids[:, None], 0.0)
    excess = weight.double()[:, None] * target_row.double() - draft_row.double()
    return excess.clamp_min(0.0).float()


def block_verify_reference(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification of every row's drafts, in PyTorch (greedy rows: token-wise's rule).

    Arguments and results are `rejection_sample_reference`'s: logits `[total_draft_tokens + rows,
    vocab]` processed target logits laid out as `metadata` says, is_greedy `[rows]`, draws (eta_i =
    `draws.uniform` of draft i, the race noise `draws.exponential`), draft_probs `[total_draft_tokens,
    vocab]` q or None for one-hot drafts. Returns output_token_ids `[rows, max_spec_len + 1]` (accepted
    drafts, the extra token, -1 padding) and num_accepted `[rows]`.
    """
    device = logits.device
    is_greedy = is_greedy.to(device=device, dtype=torch.bool)
    target_probs = target_probabilities(logits, is_greedy)
    if target_probs is None:  # every row greedy: token-wise's rule is the rule
        return rejection_sample_reference(metadata, logits, is_greedy)
    if draws is None:
        raise ValueError("rejection_sample needs random draws for sampled rows")
    num_rows, width = metadata.num_rows, metadata.max_spec_len
    draft_ids = metadata.draft_token_ids
    num_draft = torch.tensor(metadata.num_draft_tokens, device=device, dtype=torch.int64)
    first_draft = metadata.cu_num_draft_tokens - num_draft
    offsets = torch.arange(width, device=device)
    in_row = offsets[None, :] < num_draft[:, None]
    grid_index = (first_draft[:, None] + offsets[None, :]).clamp(max=max(len(draft_ids) - 1, 0))

    # 1. weights w_0..w_g of the sampled rows, float32, [rows, width + 1]
    sampled_draft = in_row & ~is_greedy[:, None]
    target_p = target_probs[metadata.target_logits_indices, draft_ids]
    draft_q = (
        torch.ones_like(target_p) if draft_probs is None else draft_probs.gather(1, draft_ids[:, None])[:, 0]
    )
    weights = torch.ones(num_rows, width + 1, dtype=torch.float32, device=device)
    for i in range(width):
        updated = next_weight(weights[:, i], target_p[grid_index[:, i]], draft_q[grid_index[:, i]])
        weights[:, i + 1] = torch.where(sampled_draft[:, i], updated, weights[:, i])

    # 2. residual masses Z_i at the positions i = 1..g-1 that need one, float64, [rows, width]
    mass = torch.zeros(num_rows, width, dtype=torch.float64, device=device)
    needed = sampled_draft & (offsets[None, :] >= 1)
    if draft_probs is None:
        weight = weights[:, :width].double()  # w - w * p: the product is exact (see Numerics)
        mass = torch.where(needed, weight - weight * target_p[grid_index].double(), mass)
    else:
        mass_rows, mass_columns = needed.nonzero(as_tuple=True)
        for start in range(0, len(mass_rows), MASS_CHUNK_DRAFTS):
            rows = mass_rows[start : start + MASS_CHUNK_DRAFTS]
            columns = mass_columns[start : start + MASS_CHUNK_DRAFTS]
            drafts = first_draft[rows] + columns
            excess = (
                weights[rows, columns].double()[:, None]
                * target_probs[metadata.target_logits_indices[drafts]].double()
                - draft_probs[drafts].double()
            )
            mass[rows, columns] = excess.clamp_min(0.0).sum(dim=-1)

    # 3. stop probabilities h_1..h_g (column c holds h_{c+1}) and 4. tau = the last i with eta_i < h_i
    next_mass = torch.cat([mass[:, 1:], torch.zeros(num_rows, 1, dtype=torch.float64, device=device)], dim=1)
    h = stop_probability(next_mass[:, :width], weights[:, 1:])
    last = offsets[None, :] + 1 == num_draft[:, None]
    h = torch.where(last, weights[:, 1:].double(), h)
    eta = draws.uniform.to(device)[grid_index].double() if width else torch.zeros(num_rows, 0, device=device)
    stops = sampled_draft & (eta < h)
    candidates = torch.where(stops, offsets[None, :] + 1, 0)
    num_accepted = torch.cat(
        [torch.zeros(num_rows, 1, dtype=torch.int64, device=device), candidates], 1
    ).amax(1)

    argmax_tokens = None
    if bool(is_greedy.any()):  # greedy rows: the leading run of drafts equal to the argmax
        argmax_tokens = logits.argmax(dim=-1)
        passes = draft_ids == argmax_tokens[metadata.target_logits_indices]
        greedy_accepted = (in_row & passes[grid_index]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        num_accepted = torch.where(is_greedy, greedy_accepted, num_accepted)

    # 5. the extra token: bonus from p_g, otherwise from the residual at tau
    extra_index = metadata.bonus_logits_indices - num_draft + num_accepted
    race_weights = target_probs[extra_index]
    stopped = (num_accepted < num_draft) & ~is_greedy
    if bool(stopped.any()):
        stop_draft = torch.where(stopped, first_draft + num_accepted, 0)
        residual = residual_weights(
            weights.gather(1, num_accepted[:, None])[:, 0],
            race_weights,
            None if draft_probs is None else draft_probs[stop_draft],
            draft_ids[stop_draft],
        )
        race_weights = torch.where(stopped[:, None], residual, race_weights)
    extra_tokens = (race_weights / draws.exponential.to(device).clamp_min(NOISE_FLOOR)).argmax(dim=-1)
    if argmax_tokens is not None:
        extra_tokens = torch.where(is_greedy, argmax_tokens[extra_index], extra_tokens)

    output = torch.full((num_rows, width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    accepted_grid = offsets[None, :] < num_accepted[:, None]
    if width:
        output[:, :-1] = torch.where(accepted_grid, draft_ids[grid_index], PLACEHOLDER_TOKEN_ID)
    output[torch.arange(num_rows, device=device), num_accepted] = extra_tokens
    return output, num_accepted
