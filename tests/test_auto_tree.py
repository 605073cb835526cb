"""`"tree": "auto"`: the size controller picks the measured-fastest size, and generate() with it stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_generate, repeated_span_batch
from test_eagle import random_head

from hf_specdec.config import SpeculativeConfig
from hf_specdec.loop.auto_tree import AutoTreeController, candidate_sizes


def test_candidate_sizes():
    assert candidate_sizes(64) == [4, 8, 16, 32, 64]
    assert candidate_sizes(20) == [4, 8, 16, 20]
    assert candidate_sizes(4) == [4]


def test_controller_settles_on_the_fastest_size_and_probes_neighbours():
    """Synthetic costs: tokens per step grow with the tree, time grows faster past 16 nodes."""
    controller = AutoTreeController(64, probe_interval=10)
    tokens = {4: 2.0, 8: 2.4, 16: 2.8, 32: 3.0, 64: 3.1}
    seconds = {4: 1.0, 8: 1.05, 16: 1.1, 32: 1.6, 64: 2.5}
    chosen = []
    for _ in range(60):
        size = controller.next_size(num_rows=1)
        chosen.append(size)
        controller.record_step(1, size, seconds[size], tokens[size])
    assert chosen[:5] == [4, 8, 16, 32, 64], "every size is measured once first"
    later = chosen[5:]
    assert later.count(16) >= 45
    assert set(later) - {16} <= {8, 32}, "probes go to a neighbour of the best size"
    # another batch size is measured on its own
    assert controller.next_size(num_rows=3) == 4


def test_auto_tree_config():
    spec = SpeculativeConfig(method="eagle3", model="x", num_speculative_tokens=4, tree="auto").tree
    assert spec.auto and spec.num_nodes == 64 and spec.depth == 4
    assert spec.for_step(8).num_nodes == 8 and spec.for_step(None) is spec
    with pytest.raises(ValueError, match="tree='automatic' is invalid"):
        SpeculativeConfig(method="eagle3", model="x", tree="automatic")


@pytest.mark.parametrize("method", ("eagle3", "ngram"))
def test_auto_tree_matches_plain_generate(enabled_llama, method):
    inputs = repeated_span_batch(3)
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False)
    config = {"method": method, "num_speculative_tokens": 4, "tree": "auto"}
    if method == "eagle3":
        config["model"] = random_head(enabled_llama, method)
    out = enabled_llama.generate(
        **inputs, max_new_tokens=30, do_sample=False, speculative_config=config, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] > 4 * metrics["num_drafts"] * 0.5
