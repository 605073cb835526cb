"""`SpecDecodeMetadata`: the ragged drafts of one step, passed flat from the loop to the sampler
(the small object vLLM's runner hands its rejection sampler).

The verify forward keeps `num_draft_tokens[i] + 1` logits for row i, row after row: one per draft
(the target's distribution at the draft's position) and one bonus position after the last draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import to_device


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [total_draft_tokens] int64, rows concatenated
    num_draft_tokens: list[int]  # [rows]
    cu_num_draft_tokens: torch.Tensor  # [rows] inclusive prefix sums of num_draft_tokens
    target_logits_indices: torch.Tensor  # [total_draft_tokens] logits row that verifies each draft
    bonus_logits_indices: torch.Tensor  # [rows] logits row after each row's last draft
    max_spec_len: int

    @classmethod
    def from_drafts(cls, draft_token_ids: list[np.ndarray], device: torch.device | str = "cpu") -> SpecDecodeMetadata:
        num_draft = np.array([len(d) for d in draft_token_ids], dtype=np.int64)
        cu_num_draft = np.cumsum(num_draft)
        bonus_indices = cu_num_draft + np.arange(len(num_draft))  # each row also has a bonus logit
        first_logit = bonus_indices - num_draft
        row_of_draft = np.repeat(np.arange(len(num_draft)), num_draft)
        offset_in_row = np.arange(int(num_draft.sum())) - np.repeat(cu_num_draft - num_draft, num_draft)
        target_indices = first_logit[row_of_draft] + offset_in_row
        flat = np.concatenate(draft_token_ids) if len(draft_token_ids) else np.zeros(0)
        arrays = [np.asarray(a, dtype=np.int64) for a in (flat, cu_num_draft, target_indices, bonus_indices)]
        flat_t, cu_num_draft_t, target_indices_t, bonus_indices_t = to_device(arrays, device)
        return cls(
            draft_token_ids=flat_t,
            num_draft_tokens=num_draft.tolist(),
            cu_num_draft_tokens=cu_num_draft_t,
            target_logits_indices=target_indices_t,
            bonus_logits_indices=bonus_indices_t,
            max_spec_len=int(num_draft.max(initial=0)),
        )

    @property
    def num_rows(self) -> int:
        return len(self.num_draft_tokens)
