"""Choosing each step's draft-tree size from measurements: `speculative_config["tree"] = "auto"`.

A bigger tree accepts more tokens per step and costs more to draft and verify; where the balance
lies depends on the drafter, the text, the batch size and the machine (on a CPU a verify forward
grows with every token it carries; on a GPU it is flat up to some size). So the controller
measures it directly, per number of active rows: for each candidate size N (4, 8, 16, ... up to the
spec's num_nodes) the tokens a drafted step emitted and the seconds it took, both summed with an
exponential decay (recent steps count more), and picks the N with the most tokens per second.
A size not measured yet at this batch size is tried first; every `probe_interval` steps a
neighbour of the best size is tried again, so a text whose predictability changes moves the
choice. Steps that drafted nothing (no n-gram match, the prefill) are not counted.
"""

from __future__ import annotations

DECAY = 0.9
PROBE_INTERVAL = 16
MIN_SIZE = 4


def candidate_sizes(max_nodes: int) -> list[int]:
    """4, 8, 16, ... below `max_nodes`, then `max_nodes` itself."""
    sizes, size = [], MIN_SIZE
    while size < max_nodes:
        sizes.append(size)
        size *= 2
    return [*sizes, max_nodes]


class AutoTreeController:
    def __init__(self, max_nodes: int, decay: float = DECAY, probe_interval: int = PROBE_INTERVAL):
        self.sizes = candidate_sizes(max_nodes)
        self.decay, self.probe_interval = decay, probe_interval
        self._tokens: dict[tuple[int, int], float] = {}  # (rows, size) -> decayed tokens emitted
        self._seconds: dict[tuple[int, int], float] = {}  # (rows, size) -> decayed seconds
        self._steps = 0
        self._probe_up = True

    def rate(self, num_rows: int, size: int) -> float | None:
        """Measured tokens per second of drafted steps at this size and batch (None: not measured)."""
        seconds = self._seconds.get((num_rows, size))
        return None if not seconds else self._tokens[(num_rows, size)] / seconds

    def next_size(self, num_rows: int) -> int:
        self._steps += 1
        rates = {size: self.rate(num_rows, size) for size in self.sizes}
        untried = [size for size, rate in rates.items() if rate is None]
        if untried:
            return untried[0]
        best = max(self.sizes, key=lambda size: rates[size])
        if self._steps % self.probe_interval == 0:
            index = self.sizes.index(best)
            self._probe_up = not self._probe_up
            neighbour = index + (1 if self._probe_up else -1)
            return self.sizes[min(max(neighbour, 0), len(self.sizes) - 1)]
        return best

    def record_step(self, num_rows: int, size: int, seconds: float, num_emitted: int) -> None:
        key = (num_rows, size)
        self._tokens[key] = self._tokens.get(key, 0.0) * self.decay + num_emitted
        self._seconds[key] = self._seconds.get(key, 0.0) * self.decay + seconds
