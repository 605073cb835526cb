"""The paged attention's two implementations give the same tokens: the Triton kernel reading the pool
in place (the CUDA default) and the gather + SDPA reference (CPU).

The kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1), forced with
`HF_SPECDEC_ATTENTION_BACKEND=triton`. Each family below exercises an attention feature the kernel
takes (causal, sliding windows from transformers' own mask functions, soft-caps, sinks, GQA, a mask
it must apply densely) or one it must hand back to the reference with a warning (MLA). Greedy
speculative output (a draft model close to the target, so drafts are both accepted and rejected)
must equal plain generate() token for token, and the test checks which path
each layer took, so that a silent fallback cannot pass for the kernel.
"""

from __future__ import annotations

import families
import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail these tests, not skip them)
from conftest import left_padded_batch, plain_generate, repeated_span_prompts
from test_architectures import perturbed_copy, speculate
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    padding_mask_function,
    sliding_window_causal_mask_function,
)

from hf_specdec.cache import paged_attention
from hf_specdec.cache.paged_cache import PagedKVCache
from hf_specdec.kernels import paged_attention as kernel_module

MAX_NEW_TOKENS = 16


@pytest.fixture
def kernel_calls(monkeypatch):
    """Force the Triton backend and record the keyword arguments of every kernel launch."""
    monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, "triton")
    calls: list[dict] = []
    launch = kernel_module.paged_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "paged_attention", recording)
    return calls


def test_structured_mask_reads_transformers_functions():
    assert paged_attention.structured_mask(None) == (True, None)
    assert paged_attention.structured_mask(causal_mask_function) == (True, None)
    assert paged_attention.structured_mask(sliding_window_causal_mask_function(7)) == (True, 7)
    # anything else is applied densely: chunks, padding, a function of the model's own
    assert paged_attention.structured_mask(chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))) == (
        False, None
    )
    padding = padding_mask_function(torch.ones(1, 4, dtype=torch.bool))
    assert paged_attention.structured_mask(and_masks(causal_mask_function, padding)) == (False, None)
    assert paged_attention.structured_mask(lambda b, h, q, kv: kv <= q) == (False, None)


def test_backend_choice(monkeypatch):
    monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, "auto")
    assert paged_attention.attention_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="HF_SPECDEC_ATTENTION_BACKEND='cuda' is not a backend; allowed: auto"):
        paged_attention.attention_backend(torch.device("cpu"))


# family -> what its layers must hand the kernel: (windows seen, dense masks seen, soft-cap, sinks)
KERNEL_FAMILIES = {
    "llama": ({None}, False, False, False),
    "mistral": ({families.SLIDING_WINDOW}, False, False, False),
    "gemma2": ({None, families.SLIDING_WINDOW}, False, True, False),
    "gpt_oss": ({None, families.SLIDING_WINDOW}, False, False, True),
    "gemma3n_text": ({None, families.SLIDING_WINDOW}, False, False, False),  # layers reading earlier layers' pools
    "llama4_text": ({None}, True, False, False),
}


@pytest.mark.parametrize("model_type", sorted(KERNEL_FAMILIES))
def test_kernel_backend_matches_plain_generate(model_type, kernel_calls):
    model = families.build_tiny_model(model_type)
    prompts = repeated_span_prompts(3, seed=5)
    inputs = left_padded_batch(prompts, pad_token_id=families.PAD_TOKEN_ID)
    plain = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    # a draft model close to the target (it runs on the kernel too): many drafts accepted, some rejected
    out = speculate(model, inputs, MAX_NEW_TOKENS, method="draft_model", model=perturbed_copy(model), num_speculative_tokens=3)
    assert torch.equal(out.sequences, plain), "the kernel path differs from plain generate()"
    assert out.spec_metrics["num_accepted_tokens"] > 0, "no draft was accepted: the test proves little"

    windows, dense, softcap, sinks = KERNEL_FAMILIES[model_type]
    assert kernel_calls, "the Triton kernel never ran"
    assert {call["window"] for call in kernel_calls if call["mask"] is None} | (
        {None} if dense else set()
    ) >= windows
    assert any(call["mask"] is not None for call in kernel_calls) == dense
    assert any(call["softcap"] is not None for call in kernel_calls) == softcap
    assert any(call["sinks"] is not None for call in kernel_calls) == sinks


def test_mla_falls_back_to_the_reference_with_a_warning(kernel_calls):
    model = families.build_tiny_model("deepseek_v3")
    inputs = left_padded_batch(repeated_span_prompts(2, seed=3), pad_token_id=families.PAD_TOKEN_ID)
    plain = plain_generate(model, **inputs, max_new_tokens=8, do_sample=False)
    paged_attention._WARNED.clear()
    with pytest.warns(UserWarning, match="cannot take MLA latents"):
        out = speculate(model, inputs, 8)
    assert torch.equal(out.sequences, plain)
    assert not kernel_calls


def test_tree_mask_same_in_both_backends(monkeypatch):
    """A tree of drafts (two rows, ragged): the kernel and the reference see the same tree mask."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    cache = PagedKVCache(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, num_blocks=32, block_size=block_size)
    layer = cache.layers[0]
    layer.keys.normal_()
    layer.values.normal_()
    # context 9 and 5 tokens already cached; trees of 5 and 3 new tokens
    cache.prepare_forward([0, 1], [9, 5])
    meta = cache.prepare_forward([0, 1], [5, 3])
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 0]]
    tree = torch.zeros(2, 5, 5, dtype=torch.bool)
    for row, row_parents in enumerate(parents):
        for node, parent in enumerate(row_parents):
            tree[row, node, node] = True
            while parent >= 0:
                tree[row, node, parent] = True
                parent = row_parents[parent]
    meta.tree_mask = tree
    query = torch.randn(1, heads, 8, dim)

    def attend(backend: str) -> torch.Tensor:
        monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, backend)
        meta.scratch.clear()
        module = torch.nn.Module()
        return paged_attention.paged_attention_forward(module, query, layer.keys, layer.values, None, paged_metadata=meta)[0]

    reference, kernel = attend("torch"), attend("triton")
    torch.testing.assert_close(kernel, reference, atol=1e-5, rtol=1e-5)
    # the tree mattered: node 2 of row 0 (a sibling of node 1) must not see node 1
    meta.tree_mask = torch.ones_like(tree).tril()
    assert not np.allclose(attend("torch").numpy(), reference.numpy(), atol=1e-4)


def test_kernel_backend_with_draft_trees(enabled_llama, kernel_calls):
    """EAGLE-2 trees: the target's verify and the head's own tree forwards (whose tree masks also
    cover the head's earlier tree entries) run on the kernel and give plain generate()'s tokens."""
    from test_eagle import random_head

    inputs = left_padded_batch(repeated_span_prompts(3, seed=5))
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=12, do_sample=False)
    config = {"method": "eagle3", "model": random_head(enabled_llama, "eagle3"), "num_speculative_tokens": 3,
              "tree": {"num_nodes": 8, "topk": 2}}
    out = enabled_llama.generate(
        **inputs, max_new_tokens=12, do_sample=False, speculative_config=config, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    spans = {call["tree_mask"].shape[2] for call in kernel_calls if call["tree_mask"] is not None}
    queries = {call["tree_mask"].shape[1] for call in kernel_calls if call["tree_mask"] is not None}
    assert spans and max(spans) > min(queries), "the head's tree forwards (T > new tokens) never ran on the kernel"


def test_auto_backend_falls_back_once_when_the_kernel_fails(monkeypatch, enabled_llama):
    """"auto" picked the kernel (as on CUDA) but it fails to build on this device: one warning, the
    reference path from then on, the same tokens. Forced with HF_SPECDEC_ATTENTION_BACKEND=triton,
    the error surfaces instead."""
    monkeypatch.delenv(paged_attention.BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(paged_attention, "attention_backend", lambda device: "triton")
    monkeypatch.setattr(paged_attention, "_KERNEL_FAILED", [])
    monkeypatch.setattr(paged_attention, "_KERNEL_WORKED", False)
    monkeypatch.setattr(paged_attention, "_WARNED", set())
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernel_module, "paged_attention", broken)
    inputs = left_padded_batch(repeated_span_prompts(2, seed=1))
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=8, do_sample=False)
    with pytest.warns(UserWarning, match="kernel failed on this device"):
        out = speculate(enabled_llama, inputs, 8)
    assert torch.equal(out.sequences, plain)
    assert len(attempts) == 1

    monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(paged_attention, "_KERNEL_FAILED", [])
    with pytest.raises(RuntimeError, match="no kernel image"):
        speculate(enabled_llama, inputs, 8)
