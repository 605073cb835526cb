"""The fast routes for fp32 CPU linears (`cpu_linear.py`): the numba small-batch kernel and oneDNN
give F.linear's numbers, "auto" runs each row count through the route it measured fastest, all
are restored afterwards, are used by speculative generate unless turned off, and bad settings
get clear errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import pytest
import torch
from conftest import PAD_TOKEN_ID, build_tiny_llama

import hf_specdec
from hf_specdec.models import cpu_linear
from hf_specdec.models.cpu_linear import (
    SMALL_BATCH_ROWS,
    BackendPlan,
    fast_cpu_linears,
    onednn_available,
    plan_backends,
    resolve_backend,
)

BACKENDS = ["auto", "numba", "onednn"]


def _patched(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_this_torch_has_onednn():
    # CI's CPU torch ships oneDNN; if this fails, the speedups measured in the README do not apply
    assert onednn_available()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 40])
def test_numba_linear_matches_float64(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_transposed_torch_route_matches_float64(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad():
        got = cpu_linear._FORWARDS["torch_t"](layer, x)
    assert got.dtype == torch.float32 and got.shape == (2, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_numba_backend_routes_by_row_count(monkeypatch):
    # the kernel must really run up to SMALL_BATCH_ROWS rows (a fallback would pass the value tests)
    kernel_rows = []
    kernel = cpu_linear._small_batch_linear

    def counting(x, weight, bias, out):
        kernel_rows.append(x.shape[0])
        kernel(x, weight, bias, out)

    monkeypatch.setattr(cpu_linear, "_small_batch_linear", counting)
    layer = torch.nn.Linear(32, 16)
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        for rows in (1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1):
            layer(torch.randn(1, rows, 32))
    with fast_cpu_linears(layer, backend="numba"):  # grad enabled: F.linear
        layer(torch.randn(2, 32))
    assert kernel_rows == [1, SMALL_BATCH_ROWS]


def test_numba_linear_keeps_leading_dims_and_takes_strided_input():
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(2, 3, 128)[..., ::2]  # [1, 2, 3 tokens] style input, not contiguous
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        got = layer(x)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_numba_row_does_not_depend_on_the_other_rows():
    # the kernel sums each (row, output) the same way whatever the batch: bit-identical rows
    layer = torch.nn.Linear(576, 300, bias=False)
    x = torch.randn(SMALL_BATCH_ROWS, 576)
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        together = layer(x)
    assert torch.equal(alone, together)


def test_numba_linear_propagates_nan_and_inf():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        got = layer(x)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all() and not torch.isfinite(got[2]).any()


def test_numba_linear_from_several_threads_at_once():
    layer = torch.nn.Linear(256, 512)
    inputs = [torch.randn(3, 256) for _ in range(8)]
    expected = [torch.nn.functional.linear(x, layer.weight, layer.bias) for x in inputs]
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"), ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: [layer(x) for _ in range(20)][-1], inputs))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_numba_threads_follow_torch_and_come_back():
    layer = torch.nn.Linear(8, 8)
    before = numba.get_num_threads()
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(numba.get_num_threads()))
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        layer(torch.randn(1, 8))
    assert seen == [min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)]
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_logits_inside_and_outside_and_restored(tiny_llama, backend):
    with torch.no_grad():
        for shape in ((1, 1), (1, 5), (3, 17)):  # numba's rows, and more than SMALL_BATCH_ROWS
            ids = torch.randint(3, 128, shape)
            expected = tiny_llama(ids).logits
            with fast_cpu_linears(tiny_llama, backend=backend):
                linears = sum(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
                assert len(_patched(tiny_llama)) == linears > 0
                got = tiny_llama(ids).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert _patched(tiny_llama) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_fall_back_to_torch(tiny_llama, backend):
    layer = tiny_llama.model.layers[0].mlp.up_proj
    x = torch.randn(1, 2, layer.in_features, requires_grad=True)
    with fast_cpu_linears(layer, backend=backend):
        layer(x).sum().backward()  # neither route has autograd: F.linear runs instead
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_other_dtypes_and_linear_subclasses_are_left_alone():
    model = build_tiny_llama().to(torch.bfloat16)
    with fast_cpu_linears(model):
        assert _patched(model) == []
    assert resolve_backend("auto", [model]) == "torch"

    class ScaledLinear(torch.nn.Linear):  # its own forward: replacing it would change its output
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = ScaledLinear(4, 4)
    with fast_cpu_linears(scaled):
        assert "forward" not in scaled.__dict__


@pytest.mark.parametrize("backend", ["auto", "numba", "onednn", "torch"])
def test_generate_identical_with_every_backend(enabled_llama, backend):
    ids = torch.randint(3, 40, (2, 12))
    ids[:, 6:] = ids[:, :6]  # a repeated span, so n-gram drafts get accepted
    seen_forward = []
    hook = enabled_llama.lm_head.register_forward_pre_hook(
        lambda module, args: seen_forward.append(module.__dict__.get("forward"))
    )
    try:
        plain = enabled_llama.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID)
        seen_forward.clear()
        out = enabled_llama.generate(
            ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID, return_dict_in_generate=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "cpu_linear_backend": backend},
        )  # fmt: skip
    finally:
        hook.remove()
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    expected = {"auto": "_planned_forward", "numba": "_numba_forward", "onednn": "_onednn_forward", "torch": None}
    assert {f and getattr(f, "func", getattr(f, "__func__", None)).__name__ for f in seen_forward} == {expected[backend]}
    assert _patched(enabled_llama) == []


@pytest.mark.parametrize("route", ["torch_t", "numba", "onednn"])
def test_generate_identical_with_every_planned_route(monkeypatch, enabled_llama, route):
    # "auto" may plan any route for any row count: each, given every row count, keeps greedy identity
    plan = BackendPlan(rows=(64,), backends=(route,))
    monkeypatch.setattr(cpu_linear, "_plan_for", lambda linears: plan)
    calls = []
    forward = cpu_linear._FORWARDS[route]
    monkeypatch.setitem(cpu_linear._FORWARDS, route, lambda self, x: calls.append(x.shape) or forward(self, x))
    ids = torch.randint(3, 40, (2, 12))
    ids[:, 6:] = ids[:, :6]  # a repeated span, so n-gram drafts get accepted
    plain = enabled_llama.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID)
    out = enabled_llama.generate(
        ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID, return_dict_in_generate=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "cpu_linear_backend": "auto"},
    )  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0
    assert any(shape[-2] > 1 for shape in calls)  # the route ran the multi-token verifies, not only decode steps


def test_bad_backend_names_the_field():
    with pytest.raises(ValueError, match=r"cpu_linear_backend='mkl' is unknown; allowed: auto, numba, onednn, torch"):
        hf_specdec.SpeculativeConfig(cpu_linear_backend="mkl")
    with pytest.raises(ValueError, match=r"backend='torch' is unknown; allowed: auto, numba, onednn"):
        with fast_cpu_linears(torch.nn.Linear(2, 2), backend="torch"):
            pass


def test_onednn_demanded_where_missing(monkeypatch, tiny_llama):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="cpu_linear_backend='onednn'.*allowed here: 'auto', 'numba' or 'torch'"):
        resolve_backend("onednn", [tiny_llama])
    assert resolve_backend("auto", [tiny_llama]) == "auto"
    ids = torch.randint(3, 128, (3, 17))  # more rows than the numba kernel takes: F.linear without oneDNN
    with torch.no_grad():
        expected = tiny_llama(ids).logits
        with fast_cpu_linears(tiny_llama, backend="numba"):
            torch.testing.assert_close(tiny_llama(ids).logits, expected, rtol=1e-5, atol=1e-5)
    timed = []
    plan = plan_backends(
        [torch.nn.Linear(8, 8)], rows=(1, 16), repeats=1, time_pass=lambda route, rows, linears: timed.append(route) or 1.0
    )
    assert "onednn" not in timed and set(plan.backends) <= {"torch", "torch_t", "numba"}  # never plans a missing route


# --- "auto": the route measured fastest per row count ---------------------------------------------
def test_plan_takes_the_fastest_route_per_row_count():
    # a machine where torch's BLAS wins up to 3 rows, numba at 4, oneDNN at 8, weight @ x.T at 16
    def time_pass(route, rows, linears):
        return {"torch": 1.0 if rows <= 3 else 3.0, "numba": 2.0 if rows != 4 else 0.5, "onednn": 2.5 if rows < 8 else 1.5,
                "torch_t": 1.2 if rows == 16 else 4.0}[route]

    timed = []
    plan = plan_backends([torch.nn.Linear(8, 8)], rows=(1, 3, 4, 8, 16), repeats=3,
                         time_pass=lambda route, rows, linears: timed.append((route, rows)) or time_pass(route, rows, linears))
    assert plan == BackendPlan(rows=(1, 3, 4, 8, 16), backends=("torch", "torch", "numba", "onednn", "torch_t"))
    assert ("numba", 16) not in timed  # the kernel's limit is SMALL_BATCH_ROWS
    assert sum(1 for route, rows in timed if rows == 8) == 4 * 3  # every route, every repeat
    assert [plan.backend_for(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 500)] == [
        "torch", "torch", "torch", "numba", "onednn", "onednn", "torch_t", "torch_t", "torch", "torch"
    ]  # between measured counts the next one up; past the last, torch's BLAS (prefills, as plain generate)
    assert plan.describe() == "rows 1-3: torch, 4: numba, 5-8: onednn, 9-16: torch_t, more: torch"


def test_plan_is_not_fooled_by_disturbed_passes():
    # numba is the faster route (1.0 against 1.2), but another process slows two of its three
    # passes: a disturbance only adds time, so the fastest pass still tells the routes apart
    calls = {"numba": 0}

    def time_pass(route, rows, linears):
        if route != "numba":
            return {"torch": 3.0, "torch_t": 1.2, "onednn": 2.0}[route]
        calls["numba"] += 1
        return 1.0 if calls["numba"] % 3 == 0 else 1.9

    plan = plan_backends([torch.nn.Linear(8, 8)], rows=(2,), repeats=3, time_pass=time_pass)
    assert plan.backends == ("numba",)


def test_auto_runs_each_row_count_through_its_planned_route(monkeypatch, tiny_llama):
    plan = BackendPlan(rows=(1, 2, 4), backends=("torch", "numba", "onednn"))
    monkeypatch.setattr(cpu_linear, "_plan_for", lambda linears: plan)
    used = []
    for route, forward in list(cpu_linear._FORWARDS.items()):
        monkeypatch.setitem(
            cpu_linear._FORWARDS, route, lambda self, x, route=route, forward=forward: used.append(route) or forward(self, x)
        )
    layer = tiny_llama.lm_head
    with torch.no_grad(), fast_cpu_linears(layer):
        outputs = {rows: layer(torch.randn(1, rows, layer.in_features)) for rows in (1, 2, 3, 4, 5)}
    assert used == ["torch", "numba", "onednn", "onednn"]  # 5 rows, past the plan: F.linear itself
    for rows, out in outputs.items():
        assert out.shape == (1, rows, layer.out_features)


def test_auto_measures_a_bounded_sample_once(monkeypatch):
    linears = [torch.nn.Linear(64, 64, bias=False) for _ in range(6)]  # 16 KiB of weights each
    monkeypatch.setattr(cpu_linear, "PLAN_BYTES", 3 * 64 * 64 * 4)
    monkeypatch.setattr(cpu_linear, "_PLANS", {})
    sampled = []

    def fake_plan(sample):
        sampled.append(len(sample))
        return BackendPlan(rows=(1,), backends=("torch",))

    monkeypatch.setattr(cpu_linear, "plan_backends", fake_plan)
    with torch.no_grad():
        for _ in range(2):
            with fast_cpu_linears(*linears):
                linears[0](torch.randn(1, 64))
    assert sampled == [3]  # the first PLAN_BYTES of weights, measured once per process


def test_real_plan_uses_only_available_routes(tiny_llama):
    plan = plan_backends([m for m in tiny_llama.modules() if isinstance(m, torch.nn.Linear)], repeats=1)
    assert plan.rows == cpu_linear.PLAN_ROWS and len(plan.backends) == len(plan.rows)
    for rows, route in zip(plan.rows, plan.backends):
        assert route in ({"torch", "torch_t", "onednn"} | ({"numba"} if rows <= SMALL_BATCH_ROWS else set()))
