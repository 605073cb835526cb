"""The loop: `generate` (the decode loop and its `speculative_step`), the `enable` opt-in, auto k and the metrics.

Depends on everything below it (drafters, cache, sampling, heads, models); nothing below imports it.
"""
