"""The oneDNN route for fp32 CPU linears (`cpu_linear.py`): same numbers, restored afterwards,
used by speculative generate unless turned off, and clear errors for bad settings."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD_TOKEN_ID, build_tiny_llama

import hf_specdec
from hf_specdec import cpu_linear
from hf_specdec.cpu_linear import onednn_available, onednn_linears, resolve_backend


def _patched(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_this_torch_has_onednn():
    # CI's CPU torch ships oneDNN; if this fails, the speedups measured in the README do not apply
    assert onednn_available()


def test_same_logits_inside_and_outside_and_restored(tiny_llama):
    ids = torch.randint(3, 128, (3, 17))
    with torch.no_grad():
        expected = tiny_llama(ids).logits
        with onednn_linears(tiny_llama):
            linears = sum(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
            assert len(_patched(tiny_llama)) == linears > 0
            got = tiny_llama(ids).logits
    assert _patched(tiny_llama) == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gradients_fall_back_to_torch(tiny_llama):
    layer = tiny_llama.model.layers[0].mlp.up_proj
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    with onednn_linears(layer):
        layer(x).sum().backward()  # the oneDNN op has no autograd: F.linear runs instead
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_other_dtypes_and_linear_subclasses_are_left_alone():
    model = build_tiny_llama().to(torch.bfloat16)
    with onednn_linears(model):
        assert _patched(model) == []
    assert resolve_backend("auto", [model]) == "torch"

    class ScaledLinear(torch.nn.Linear):  # its own forward: replacing it would change its output
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = ScaledLinear(4, 4)
    with onednn_linears(scaled):
        assert "forward" not in scaled.__dict__


@pytest.mark.parametrize("backend", ["auto", "onednn", "torch"])
def test_generate_identical_with_every_backend(enabled_llama, backend):
    ids = torch.randint(3, 40, (2, 12))
    ids[:, 6:] = ids[:, :6]  # a repeated span, so n-gram drafts get accepted
    seen_patched = []
    hook = enabled_llama.lm_head.register_forward_pre_hook(
        lambda module, args: seen_patched.append("forward" in module.__dict__)
    )
    try:
        plain = enabled_llama.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID)
        seen_patched.clear()
        out = enabled_llama.generate(
            ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID, return_dict_in_generate=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "cpu_linear_backend": backend},
        )  # fmt: skip
    finally:
        hook.remove()
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    assert set(seen_patched) == {backend != "torch"}
    assert _patched(enabled_llama) == []


def test_bad_backend_names_the_field():
    with pytest.raises(ValueError, match=r"cpu_linear_backend='mkl' is unknown; allowed: auto, onednn, torch"):
        hf_specdec.SpeculativeConfig(cpu_linear_backend="mkl")


def test_onednn_demanded_where_missing(monkeypatch, tiny_llama):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="cpu_linear_backend='onednn'.*allowed here: 'auto' or 'torch'"):
        resolve_backend("onednn", [tiny_llama])
    assert resolve_backend("auto", [tiny_llama]) == "torch"
