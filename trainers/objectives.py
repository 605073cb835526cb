"""What a head is trained to do: unrolled draft steps over a batch, and their losses.

Notation (as in `hf_specdec.heads.eagle_heads`): pair i is (target feature f[i], token t[i+1]) at
position i; the head's output for it predicts the next feature, and the token t[i+2].

**Training-time test** (EAGLE-3, arXiv:2503.01840). At inference the head drafts k tokens in a
chain, feeding itself its own outputs; a head trained only on target features (step 0) never
learns to read its own. So a batch is unrolled `num_steps` times, as the drafter runs:

- step 0 reads the target's features at every position (causal attention over the sequence);
- step j >= 1 reads, at pair index i, the head's step-(j-1) output there, paired with token
  t[i+1+j], at position i + j, and predicts t[i+2+j].

At inference, draft step j from context position i attends to the head's cache entries of real
context (positions <= i) and to its own earlier drafts from that same position. With every
step's keys appended to one `DynamicCache`, that is the mask below: block 0 causal, blocks 1..j
the diagonal only. Tokens fed at steps >= 1 are the data's (teacher forcing), as SpecForge does;
at inference a draft is only worth anything when it matches the target, which is when the two agree.

**Labels** are the *target's* distributions, not the data's tokens: the head is judged on
whether it predicts what the target would emit. EAGLE-3 scores a reduced draft vocabulary, so
the target's probabilities are restricted to it and renormalised, and positions where the
target's argmax lies outside it are skipped (the head cannot draft that token anyway).
EAGLE (EAGLE-1, arXiv:2401.15077) adds the feature regression (SmoothL1 against the next target
feature) to a 0.1-weighted cross-entropy through the target's own lm_head.

Losses are returned as sums with the number of step-0 label positions; the caller divides by
the count over every process, so one process with a batch of B and N processes with B / N each
train the same head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from hf_specdec.heads.eagle_heads import EagleHead

from .lm_head_loss import block_rows, soft_label_cross_entropy


def full_weight(module: nn.Module) -> torch.Tensor:
    """`module.weight`, whole. Outside its forward, a module FSDP2 shards (a target loaded with
    `--shard-target`) holds only this process's rows, as a DTensor; gathering them is a collective,
    so every process must ask as often as the others."""
    weight = module.weight
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


@dataclass
class TargetBatch:
    """What the frozen target contributes to a batch (online forward or offline cache)."""

    features: torch.Tensor  # [B, T, F] the head's input features (EAGLE-3: 3 layers concatenated)
    final_hidden: torch.Tensor  # [B, T, H] the final norm's output: target logits = lm_head(final_hidden)


def unroll_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, length, length * (step + 1)]` bool: causal over step 0's keys, diagonal over steps 1..step."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


@torch.no_grad()
def target_labels(
    final_hidden: torch.Tensor, target_lm_head: nn.Module, head: EagleHead, matmul_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's argmax, whether it lies in the head's vocabulary, and its distribution over
    that vocabulary (renormalised), for `[labels, H]` final hidden states.

    The logits' matmul runs in `matmul_dtype` (default: the target's weight dtype), whatever
    autocast the head trains under: the labels are the target's, at the target's precision.
    Computed a block of rows at a time: a whole batch's full-vocabulary logits would be one
    buffer of labels x vocabulary floats (800 MB for 4k labels and SmolLM2's 49k tokens).
    """
    labels = final_hidden.shape[0]
    draft_ids = torch.arange(head.output_head().weight.shape[0], device=final_hidden.device)
    draft_ids = head.draft_to_target(draft_ids)  # the target id of each draft-vocabulary entry
    argmax = torch.empty(labels, dtype=torch.long, device=final_hidden.device)
    probs = torch.empty(labels, len(draft_ids), dtype=torch.float32, device=final_hidden.device)
    step = block_rows(target_lm_head.weight.shape[0])
    weight = full_weight(target_lm_head)
    weight = weight.to(matmul_dtype or weight.dtype)  # cast once, not per block
    with torch.autocast(final_hidden.device.type, enabled=False):
        for begin in range(0, labels, step):
            logits = (final_hidden[begin : begin + step].to(weight.dtype) @ weight.T).float()
            argmax[begin : begin + step] = logits.argmax(dim=-1)
            probs[begin : begin + step] = logits.index_select(1, draft_ids).softmax(dim=-1)
    in_draft_vocab = head.t2d[argmax] if head.method == "eagle3" else torch.ones_like(argmax, dtype=torch.bool)
    return argmax, in_draft_vocab, probs


def shifted(tokens: torch.Tensor, shift: int, width: int, fill: int = 0) -> torch.Tensor:
    """`tokens[:, shift : shift + width]`, padded with `fill` past the end."""
    out = tokens.new_full((tokens.shape[0], width), fill)
    piece = tokens[:, shift : shift + width]
    out[:, : piece.shape[1]] = piece
    return out


class DraftTrainingObjective(nn.Module):
    """The module Accelerate prepares (DDP wraps it): one call runs every unrolled step of a batch.

    Everything that needs gradients happens inside `forward`, so a distributed wrapper sees one
    forward per backward however many draft steps are unrolled.
    """

    # Accelerate's FSDP TRANSFORMER_BASED_WRAP, given no class names, shards each of these as a unit
    # (those the head has: EAGLE-3's first layer, the Llama layers after it or EAGLE's)
    _no_split_modules = ["Eagle3FirstDecoderLayer", "LlamaDecoderLayer"]

    def __init__(
        self, head: EagleHead, num_steps: int = 1, step_weight: float = 0.8, eagle_ce_weight: float = 0.1,
        target_matmul_dtype: torch.dtype | None = None,
    ):
        """`target_matmul_dtype`: what the target's logits (the labels) are computed in; default
        its weights' dtype."""
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"--ttt-steps={num_steps} is invalid; allowed: an integer >= 1")
        if getattr(head.output_head(), "bias", None) is not None:
            raise ValueError("training a head whose lm_head has a bias is not supported (Llama-style lm_heads have none)")
        self.head = head
        self.num_steps = num_steps
        self.step_weights = [step_weight**j for j in range(num_steps)]
        self.eagle_ce_weight = eagle_ce_weight
        self.target_matmul_dtype = target_matmul_dtype

    def forward(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, target: TargetBatch, target_lm_head: nn.Module,
        return_hits: bool = False, rank_within: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Returns `loss_sum` (weighted over steps), `num_label_positions` (step 0), and per step
        `correct` / `counted` ([num_steps] each: draft argmax == target argmax), plus
        `accepted_len_sum` / `accepted_len_count` for the simulated acceptance length.
        `return_hits` adds `hits`, `[batch, width - 1, num_steps]` bool: draft step j from pair i
        (the head's draft of token i + 2 + j) equals the target's argmax there.
        `rank_within=R > 0` adds `target_rank`, `[batch, width - 1, num_steps]` long: where the
        target's argmax ranks among the R most likely tokens of draft step j from pair i (0 = the
        head's draft, so `target_rank == 0` is `hits`), R where it is not among them or there is no
        label. Either adds `draft_start`, `[batch, width - 1]` bool: the pairs a draft chain starts
        from (step 0 labelled), those the simulated acceptance length averages over."""
        head = self.head
        batch, width = input_ids.shape
        pairs = width - 1  # pair i = (f[i], t[i+1]) for i < width - 1
        device = input_ids.device
        positions = torch.arange(pairs, device=device).expand(batch, -1)
        # q = i + 1 + j: the position whose target logits label (pair i, step j); valid where t[q+1] is trained on
        label_at = torch.zeros(batch, width, dtype=torch.bool, device=device)
        label_at[:, :-1] = loss_mask[:, 1:].bool()
        with torch.no_grad():
            label_rows, label_cols = label_at.nonzero(as_tuple=True)
            target_argmax, in_draft_vocab, target_probs = target_labels(
                target.final_hidden[label_rows, label_cols], target_lm_head, head, self.target_matmul_dtype
            )
            # index of each (row, q) in the label arrays, -1 where q carries no label
            label_index = torch.full((batch, width), -1, dtype=torch.long, device=device)
            label_index[label_rows, label_cols] = torch.arange(len(label_rows), device=device)

        cache = DynamicCache()
        features = target.features[:, :pairs].to(head.fc.weight.dtype)
        loss_sum = features.new_zeros(())
        correct = torch.zeros(self.num_steps, dtype=torch.long, device=device)
        counted = torch.zeros(self.num_steps, dtype=torch.long, device=device)
        hits = torch.zeros(batch, pairs, self.num_steps, dtype=torch.bool, device=device)
        target_rank = torch.full((batch, pairs, self.num_steps), rank_within, dtype=torch.long, device=device)
        for step in range(self.num_steps):
            hidden = head(
                shifted(input_ids, 1 + step, pairs),
                features,
                positions + step,
                fuse_features=step == 0,
                cache=cache,
                attention_mask=None if step == 0 else unroll_mask(pairs, step, device),
            )
            # past the sequence's end there is no label: -1, not the index 0 of the batch's first label
            index = shifted(label_index, 1 + step, pairs, fill=-1)
            rows, cols = (index >= 0).nonzero(as_tuple=True)
            labels = index[rows, cols]
            keep = in_draft_vocab[labels]
            rows, cols, labels = rows[keep], cols[keep], labels[keep]
            predicted = hidden[rows, cols]
            loss, draft_argmax = soft_label_cross_entropy(
                head.lm_head_input(predicted), full_weight(head.output_head()), target_probs, labels
            )
            if head.method == "eagle":
                next_feature = target.final_hidden[rows, cols + 1 + step].to(predicted.dtype)
                loss = self.eagle_ce_weight * loss + F.smooth_l1_loss(predicted, next_feature, reduction="sum") / predicted.shape[-1]
            loss_sum = loss_sum + self.step_weights[step] * loss
            with torch.no_grad():
                hit = head.draft_to_target(draft_argmax) == target_argmax[labels]
                correct[step] = hit.sum()
                counted[step] = len(labels)
                hits[rows, cols, step] = hit
                if rank_within > 0:
                    target_rank[rows, cols, step] = self._rank_of(
                        predicted, target_argmax[labels], rank_within
                    )
            features = hidden
        with torch.no_grad():
            # simulated acceptance length of a k = num_steps chain drafted from pair i: its leading hits
            starts = shifted(label_index, 1, pairs, fill=-1) >= 0
            leading = hits.long().cumprod(dim=-1).sum(dim=-1)
        out = {
            "loss_sum": loss_sum,
            "num_label_positions": starts.sum(),
            "correct": correct,
            "counted": counted,
            "accepted_len_sum": leading[starts].sum(),
            "accepted_len_count": starts.sum(),
        }
        if return_hits:
            out["hits"] = hits
        if rank_within > 0:
            out["target_rank"] = target_rank
        if return_hits or rank_within > 0:
            out["draft_start"] = starts
        return out

    def _rank_of(self, predicted: torch.Tensor, target_ids: torch.Tensor, within: int) -> torch.Tensor:
        """Per row of `predicted` ([rows, H] head outputs), the rank of `target_ids[row]` among the
        head's `within` most likely drafts there; `within` where it is not among them. A block of
        rows at a time, as the loss: one buffer of rows x draft vocabulary logits would be large."""
        head = self.head
        weight = full_weight(head.output_head())
        ranks = torch.full_like(target_ids, within)
        step = block_rows(weight.shape[0])
        for begin in range(0, len(target_ids), step):
            logits = head.lm_head_input(predicted[begin : begin + step]) @ weight.T
            top = head.draft_to_target(logits.topk(min(within, weight.shape[0]), dim=-1).indices)
            match = top == target_ids[begin : begin + step, None]
            found = match.any(dim=-1)
            ranks[begin : begin + step][found] = match.int().argmax(dim=-1)[found]
        return ranks
