"""The loop: `speculative_step` (`step.py`), the `SpeculativeEngine` that runs it for requests that come
and go (`engine.py`), `generate` on top of the engine, the `enable` opt-in, auto k and the metrics.

Depends on everything below it (drafters, cache, sampling, heads, models); nothing below imports it.
"""
