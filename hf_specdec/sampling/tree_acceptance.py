"""Tree acceptance: verify every row's draft tree (`sampling/tree.py`) against the target's logits
and emit the accepted root path plus one extra token.

Logits layout: row r owns `n_r + 1` consecutive logits rows from `first_r` (the sum over earlier
rows of `n + 1`): `first_r` holds the target's logits at the root (the row's last context token),
`first_r + 1 + i` the logits at node i (after node i's token is appended to its path). For a chain
(parents [-1, 0, 1, ...]) this is exactly the layout `SpecDecodeMetadata` gives the chain sampler.

Algorithm, per row, walking down from the root (v = the root first):

- greedy rows: take the argmax of the logits at v. If a child of v holds that token, accept the
  child and continue from it; otherwise emit the argmax as the extra token and stop (at a leaf it
  is the bonus token). The result is the longest root path whose every token is the argmax.
- sampled rows: recursive rejection sampling with the drafter's ranked candidates as point-mass
  drafts (multi-step speculative sampling, SpecInfer: Miao et al., ASPLOS 2024, §4.2, with the
  proof that it samples exactly from the target in the paper's appendix; the one-hot special case
  is sampling without replacement, as in Sequoia, Chen et al. 2024). With p = softmax(logits at v)
  and children x_1..x_m in rank order, start from r = p; child x_j is accepted when its uniform
  draw u satisfies u * |r| < r(x_j) (probability r(x_j) / |r|): then move to it and repeat.
  Otherwise set r(x_j) = 0 and try the next sibling. When every child is rejected (at a leaf
  r = p), emit one token drawn from r / |r| by the row's exponential race argmax(r / E),
  E = draws.exponential[row] clamped by NOISE_FLOOR, and stop.

Why the emitted token follows p: after x_1..x_{j-1} were rejected, r_j = p without them and
|r_j| = 1 - sum_{i<j} p(x_i); each rejection has probability 1 - r_i(x_i)/|r_i| = |r_{i+1}| / |r_i|,
so P(reach x_j) = prod_{i<j} |r_{i+1}| / |r_i| = |r_j| (telescoping, |r_1| = 1) and P(emit x_j) =
|r_j| * r_j(x_j) / |r_j| = p(x_j); a token y outside the candidates is emitted with probability
|r_{m+1}| * p(y) / |r_{m+1}| = p(y). Accepting x_j moves to the logits at its path, so by induction
over depth the whole emitted sequence follows the target's distribution.

Conventions shared with the chain sampler (`rejection_reference.py`), so that on a chain the two
emit the same tokens on the same draws: p comes from `target_probabilities`; |r| is tracked as
1 - (the rejected siblings' p), in float64 on the host, which is exactly 1 for the first child (the
chain's test u < p(x) for a one-hot q); the residual keeps r unnormalised for the race. Should
rounding leave r all zero (every token with p > 0 was a rejected candidate), p is used instead.

The walk is a Python loop over rows and depth (a reference; CPU or GPU tensors): the argmax of every
logits row, each node's p(token) at its parent and its uniform come to the host in one transfer,
and the extra tokens of sampled rows are raced on the device in one batch after the walk.
"""

from __future__ import annotations

import numpy as np
import torch

from ..transfer import to_device
from .metadata import SpecDecodeMetadata
from .rejection_reference import NOISE_FLOOR, PLACEHOLDER_TOKEN_ID, RandomDraws, target_probabilities
from .tree import children_of, tree_depths

__all__ = ["accept_tree"]


def _sampled_child(children: list[int], p_child: np.ndarray, uniform: np.ndarray) -> int | None:
    """The child recursive rejection sampling accepts among `children` (rank order), or None.

    `p_child[c]`: p at the parent of node c of c's token; `uniform[c]`: c's uniform draw. The
    remaining mass |r| starts at 1 and loses each rejected sibling's p.
    """
    mass = 1.0
    for child in children:
        p = float(p_child[child])
        if p > 0.0 and float(uniform[child]) * mass < p:
            return child
        mass -= p
    return None


def _check_inputs(
    metadata: SpecDecodeMetadata,
    parents: list[np.ndarray],
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None,
    sampled_any: bool,
) -> list[np.ndarray]:
    num_rows, total = metadata.num_rows, sum(metadata.num_draft_tokens)
    if len(parents) != num_rows:
        raise ValueError(f"accept_tree: parents has {len(parents)} rows, metadata has {num_rows}")
    checked = []
    for row, (row_parents, count) in enumerate(zip(parents, metadata.num_draft_tokens)):
        row_parents = np.asarray(row_parents, dtype=np.int64)
        if row_parents.ndim != 1 or len(row_parents) != count:
            raise ValueError(
                f"accept_tree: parents[{row}] has shape {row_parents.shape}, "
                f"metadata.num_draft_tokens[{row}] is {count}"
            )
        if np.any(row_parents < -1) or np.any(row_parents >= np.arange(count)):
            raise ValueError(
                f"accept_tree: parents[{row}] = {row_parents.tolist()}: every parent must be -1 or an earlier node"
            )
        checked.append(row_parents)
    if logits.ndim != 2 or logits.shape[0] != total + num_rows:
        raise ValueError(
            f"accept_tree: logits has shape {tuple(logits.shape)}, expected [{total + num_rows}, vocab] "
            f"(one row per node plus one per row)"
        )
    if is_greedy.shape != (num_rows,):
        raise ValueError(f"accept_tree: is_greedy has shape {tuple(is_greedy.shape)}, expected [{num_rows}]")
    if sampled_any:
        if draws is None:
            raise ValueError("accept_tree: draws is required when any row samples (is_greedy has False)")
        if draws.uniform.shape != (total,) or draws.exponential.shape != (num_rows, logits.shape[1]):
            raise ValueError(
                f"accept_tree: draws has uniform {tuple(draws.uniform.shape)} and exponential "
                f"{tuple(draws.exponential.shape)}, expected [{total}] and [{num_rows}, {logits.shape[1]}]"
            )
    return checked


def accept_tree(
    metadata: SpecDecodeMetadata,
    parents: list[np.ndarray],
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a root path of every row's draft tree, then one extra token (module docstring).

    Args:
        metadata: `SpecDecodeMetadata.from_drafts` of every row's node tokens (node order).
        parents: per row, its tree's parents (`sampling/tree.py`); empty for a row without drafts.
        logits: `[total nodes + rows, vocab]` float32 processed target logits; row r's logits at
            the root, then at each of its nodes (module docstring).
        is_greedy: `[rows]` bool.
        draws: `draw_random(generators, metadata, vocab, device)`: one uniform per node, one
            Exp(1) vector per row; required when any row samples.

    Returns:
        output_token_ids `[rows, max_depth + 1]`: the accepted path's tokens then the extra token,
        padded with PLACEHOLDER_TOKEN_ID (-1); num_accepted `[rows]`: nodes accepted; and
        accepted_nodes `[rows, max_depth]`: the accepted path's node indices, the root's child
        first, padded with -1. max_depth is the deepest tree in the batch (0 when none).
    """
    num_rows, device = metadata.num_rows, logits.device
    greedy = is_greedy.detach().cpu().numpy().astype(bool).reshape(-1)
    sampled_any = not bool(greedy.all())
    parents = _check_inputs(metadata, parents, logits, is_greedy, draws, sampled_any)

    num_nodes = np.asarray(metadata.num_draft_tokens, dtype=np.int64)
    node_start = np.cumsum(num_nodes) - num_nodes  # flat index of each row's node 0
    first_logit = node_start + np.arange(num_rows)  # logits row at each row's root
    depths = [tree_depths(row_parents) for row_parents in parents]
    max_depth = max((int(d.max(initial=0)) for d in depths), default=0)

    # every per-node input in one device-to-host transfer: tokens, argmax, p(token) at the parent, uniform
    total = int(num_nodes.sum())
    probs = target_probabilities(logits, is_greedy) if sampled_any else None
    host_parts = [metadata.draft_token_ids.to(torch.float64)]
    if sampled_any:
        flat_parents = np.concatenate(parents) if total else np.zeros(0, dtype=np.int64)
        parent_logit = np.repeat(first_logit, num_nodes) + 1 + flat_parents  # root: parent -1
        (parent_logit_t,) = to_device([parent_logit], device)
        host_parts.append(probs[parent_logit_t, metadata.draft_token_ids].to(torch.float64))
        host_parts.append(draws.uniform.to(torch.float64))
    if greedy.any():
        host_parts.append(logits.argmax(dim=-1).to(torch.float64))
    host = torch.cat(host_parts).cpu().numpy()
    tokens, host = host[:total].astype(np.int64), host[total:]
    if sampled_any:
        p_child, uniform, host = host[:total], host[total : 2 * total], host[2 * total :]
    argmax = host.astype(np.int64) if greedy.any() else None

    output = np.full((num_rows, max_depth + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    accepted_nodes = np.full((num_rows, max_depth), -1, dtype=np.int64)
    num_accepted = np.zeros(num_rows, dtype=np.int64)
    sampled_rows, stop_logit, zero_rows, zero_tokens = [], [], [], []
    for row in range(num_rows):
        start, first = int(node_start[row]), int(first_logit[row])
        row_tokens = tokens[start : start + num_nodes[row]]
        children = children_of(parents[row])
        if not greedy[row]:
            row_p, row_u = p_child[start : start + num_nodes[row]], uniform[start : start + num_nodes[row]]
        node, path = -1, []
        while True:
            kids = children[node + 1]
            if greedy[row]:
                target = argmax[first + 1 + node]
                chosen = next((kid for kid in kids if row_tokens[kid] == target), None)
                if chosen is None:
                    output[row, len(path)] = target
                    break
            else:
                chosen = _sampled_child(kids, row_p, row_u)
                if chosen is None:  # every child rejected (or a leaf): race over p without them
                    sampled_rows.append(row)
                    stop_logit.append(first + 1 + node)
                    zero_rows.extend([len(sampled_rows) - 1] * len(kids))
                    zero_tokens.extend(int(row_tokens[kid]) for kid in kids)
                    break
            path.append(chosen)
            node = chosen
        num_accepted[row] = len(path)
        accepted_nodes[row, : len(path)] = path
        output[row, : len(path)] = row_tokens[path]

    host_arrays = [output, num_accepted, accepted_nodes]
    if sampled_rows:
        sampled = np.asarray(sampled_rows, dtype=np.int64)
        host_arrays += [sampled, np.asarray(stop_logit, dtype=np.int64), num_accepted[sampled]]
        host_arrays += [np.asarray(zero_rows, dtype=np.int64), np.asarray(zero_tokens, dtype=np.int64)]
    output_t, num_accepted_t, accepted_nodes_t, *sampled_t = to_device(host_arrays, device)
    if sampled_rows:
        sampled_idx, stop_idx, column, zero_r, zero_t = sampled_t
        weights = probs[stop_idx]
        residual = weights.index_put((zero_r, zero_t), torch.zeros((), dtype=weights.dtype, device=device))
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, weights)
        noise = draws.exponential[sampled_idx].clamp_min(NOISE_FLOOR)
        output_t[sampled_idx, column] = (residual / noise).argmax(dim=-1)
    return output_t, num_accepted_t, accepted_nodes_t
