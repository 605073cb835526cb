"""Speculation metrics, per generate() call and cumulative on the model (seed §12.7.5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class SpecDecodeMetrics:
    """Counters named after vLLM's spec-decode metrics.

    `num_drafts` counts (row, step) pairs that received at least one draft token;
    `num_accepted_tokens_per_pos[i]` counts drafts accepted at position i of their draft;
    `num_rejected_drafts` the drafts in which a token was rejected (the others were accepted whole);
    `num_row_steps` the (row, step) pairs, drafted or not; `k_chosen_counts[k]` the steps that
    asked for k drafts per row (a fixed k, or what num_speculative_tokens="auto" chose).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_rejected_drafts: int = 0
    num_row_steps: int = 0
    k_chosen_counts: list[int] = field(default_factory=list)
    accepted_length_counts: list[int] = field(default_factory=list)  # [a]: drafted (row, step)s that accepted a
    num_emitted_tokens: int = 0
    num_target_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    sampler_seconds: float = 0.0
    total_seconds: float = 0.0
    # KV cache: the most blocks in use at once (during a verify forward, drafts included), and
    # the blocks the tokens actually held needed at that moment (each row rounded up to blocks)
    kv_peak_blocks_used: int = 0
    kv_blocks_needed_at_peak: int = 0

    def record_step(
        self, num_draft_tokens: list[int], num_accepted: list[int], k_chosen: int, draft_depths: list[int] | None = None
    ) -> None:
        """One step: per active row, the drafts proposed and accepted; the k the step asked for;
        for draft trees, each row's tree depth (its positions; a chain's depth is its length)."""
        self.num_target_forwards += 1
        self.num_row_steps += len(num_draft_tokens)
        _add_counts(self.k_chosen_counts, [0] * k_chosen + [1])
        depths = num_draft_tokens if draft_depths is None else draft_depths
        for drafted, accepted, depth in zip(num_draft_tokens, num_accepted, depths):
            if drafted == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            self.num_rejected_drafts += int(accepted < depth)
            _add_counts(self.num_accepted_tokens_per_pos, [1] * accepted + [0] * (depth - accepted))
            _add_counts(self.accepted_length_counts, [0] * accepted + [1])

    def record_kv_usage(self, blocks_used: int, blocks_needed: int) -> None:
        if blocks_used > self.kv_peak_blocks_used:
            self.kv_peak_blocks_used, self.kv_blocks_needed_at_peak = blocks_used, blocks_needed

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts: tokens a drafted step yields on average."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        """accepted / drafted (vLLM's acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def conditional_acceptance_rate(self) -> float:
        """The alpha of the closed-form speedup (`auto_k.py`): the chance a draft token is accepted
        given the ones before it were, accepted / (accepted + rejections). Drafts after a
        rejection are never tested, so `draft_acceptance_rate` counts them against alpha."""
        tested = self.num_accepted_tokens + self.num_rejected_drafts
        return self.num_accepted_tokens / tested if tested else 0.0

    @property
    def mean_k_chosen(self) -> float:
        """The k steps asked for, on average (0 for steps that drafted nothing by choice)."""
        steps = sum(self.k_chosen_counts)
        return sum(k * n for k, n in enumerate(self.k_chosen_counts)) / steps if steps else 0.0

    def merge(self, other: SpecDecodeMetrics) -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_rejected_drafts", "num_row_steps",
                     "num_emitted_tokens", "num_target_forwards", "draft_seconds", "verify_seconds",
                     "sampler_seconds", "total_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.kv_peak_blocks_used > self.kv_peak_blocks_used:
            self.kv_peak_blocks_used = other.kv_peak_blocks_used
            self.kv_blocks_needed_at_peak = other.kv_blocks_needed_at_peak
        _add_counts(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos)
        _add_counts(self.k_chosen_counts, other.k_chosen_counts)
        _add_counts(self.accepted_length_counts, other.accepted_length_counts)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "conditional_acceptance_rate": self.conditional_acceptance_rate,
            "mean_k_chosen": self.mean_k_chosen,
        }

    @classmethod
    def from_dict(cls, values: dict) -> SpecDecodeMetrics:
        """The inverse of `to_dict` (its derived values are dropped), e.g. to merge `out.spec_metrics`."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def _add_counts(total: list[int], counts: list[int]) -> None:
    """total += counts elementwise, growing total as needed."""
    if len(total) < len(counts):
        total += [0] * (len(counts) - len(total))
    for i, count in enumerate(counts):
        total[i] += count
