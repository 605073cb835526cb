"""Speculation metrics, per generate() call and cumulative on the model (seed §12.7.5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecDecodeMetrics:
    """Counters named after vLLM's spec-decode metrics.

    `num_drafts` counts (row, step) pairs that received at least one draft token;
    `num_accepted_tokens_per_pos[i]` counts drafts accepted at position i of their draft.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
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

    def record_step(self, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        self.num_target_forwards += 1
        for drafted, accepted in zip(num_draft_tokens, num_accepted):
            if drafted == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            if len(self.num_accepted_tokens_per_pos) < drafted:
                self.num_accepted_tokens_per_pos += [0] * (drafted - len(self.num_accepted_tokens_per_pos))
            for position in range(accepted):
                self.num_accepted_tokens_per_pos[position] += 1

    def record_kv_usage(self, blocks_used: int, blocks_needed: int) -> None:
        if blocks_used > self.kv_peak_blocks_used:
            self.kv_peak_blocks_used, self.kv_blocks_needed_at_peak = blocks_used, blocks_needed

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts: tokens a drafted step yields on average."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def merge(self, other: SpecDecodeMetrics) -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                     "num_target_forwards", "draft_seconds", "verify_seconds", "sampler_seconds", "total_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.kv_peak_blocks_used > self.kv_peak_blocks_used:
            self.kv_peak_blocks_used = other.kv_peak_blocks_used
            self.kv_blocks_needed_at_peak = other.kv_blocks_needed_at_peak
        per_pos = other.num_accepted_tokens_per_pos
        if len(self.num_accepted_tokens_per_pos) < len(per_pos):
            self.num_accepted_tokens_per_pos += [0] * (len(per_pos) - len(self.num_accepted_tokens_per_pos))
        for position, count in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
        }
