"""The fast routes for fp32 CPU linears (`cpu_linear.py`): the numba small-batch kernel and oneDNN
give F.linear's numbers, "auto" runs each row count through the route it measured fastest, all
are restored afterwards, are used by speculative generate unless turned off, and bad settings
get clear errors. The "auto" plan is stored per machine and reused by later processes, timed
again when its key changes, when asked, or when its file cannot be read (`hf-specdec plan-linears`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import pytest
import torch
from conftest import PAD_TOKEN_ID, build_tiny_llama

import hf_specdec
from hf_specdec import cli
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


@pytest.fixture(autouse=True)
def plan_cache(tmp_path, monkeypatch):
    """Every test here stores plans in a folder of its own and starts as a fresh process would."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(folder))
    monkeypatch.delenv(cpu_linear.REPLAN_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "_PLANS", {})
    # no test may depend on the machine's load (other tests and processes run at the same time)
    monkeypatch.setattr(cpu_linear._CpuWatch, "others_cores", lambda self: None)
    return folder / cpu_linear.PLAN_FOLDER


MEASURED_OTHERS_CORES = cpu_linear._CpuWatch.others_cores


def _patched(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_this_torch_has_onednn():
    # CI's CPU torch ships oneDNN; if this fails, the speedups measured in the README do not apply
    assert onednn_available()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 40])
def test_numba_linear_matches_float64(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 203, bias=bias)  # 25 blocks of KERNEL_BLOCK output features and a partial one
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        got = layer(x)
        alone = [layer(x[i : i + 1]) for i in range(min(rows, 3))]
    assert got.dtype == torch.float32 and got.shape == (rows, 203)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    if rows <= cpu_linear.SMALL_BATCH_ROWS:  # the kernel computes a row the same whatever rows come with it
        assert all(torch.equal(row, got[i : i + 1]) for i, row in enumerate(alone))


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


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_onednn_route_matches_float64_and_packs_each_weight_once(monkeypatch, rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)
    packs = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(cpu_linear, "_reorder", lambda weight: packs.append(1) or reorder(weight))
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad(), fast_cpu_linears(layer, backend="onednn"):
        assert len(packs) == 1  # packed as the block starts, not in the middle of a decode
        first, second = layer(x), layer(x)
    assert first.shape == (2, rows, 200) and torch.equal(first, second)
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-5)
    assert len(packs) == 1  # reused by every call (and by the next block)
    with torch.no_grad(), fast_cpu_linears(layer, backend="onednn"):
        layer(x)
    assert len(packs) == 1


@pytest.mark.parametrize("backend", ["onednn", "numba"])
def test_routes_follow_the_weight_after_it_changes(backend):
    """oneDNN's packed copy is packed again; the numba route's NumPy views of the weight and bias are taken again."""
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    with torch.no_grad(), fast_cpu_linears(layer, backend=backend):
        layer(x)
        layer.weight.mul_(2)  # in place (training steps, load_state_dict)
        doubled = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
        layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # replaced
        replaced = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
        layer.bias = torch.nn.Parameter(torch.randn(32))  # the bias alone replaced
        new_bias = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    for got, expected in (doubled, replaced, new_bias):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_onednn_route_does_not_pack_where_memory_is_short(monkeypatch):
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    monkeypatch.setattr(cpu_linear, "_available_memory", lambda: cpu_linear.PACK_MEMORY_MARGIN)
    monkeypatch.setattr(cpu_linear, "_UNPACKED_WARNED", [])
    with pytest.warns(UserWarning, match="too little to keep"), torch.no_grad(), fast_cpu_linears(layer, backend="onednn"):
        got = layer(x)
    assert layer not in cpu_linear._PACKED_WEIGHTS  # oneDNN packs per call instead
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_numba_kernel_is_loaded_as_the_block_starts_only_where_a_route_takes_it(monkeypatch):
    """Loading the kernel costs ~0.4 s once per process: at the first call it landed inside a
    decode step, which auto k read as the price of drafting."""
    loads = []
    monkeypatch.setattr(cpu_linear, "_load_numba_kernel", lambda: loads.append(1))
    layer = torch.nn.Linear(64, 32)
    with torch.no_grad(), fast_cpu_linears(layer, backend="numba"):
        assert loads  # before any forward
    loads.clear()
    if cpu_linear.onednn_available():
        with torch.no_grad(), fast_cpu_linears(layer, backend="onednn"):
            layer(torch.randn(2, 64))
        assert not loads
    # the real loader runs the kernel's signature once and is cached for the process
    monkeypatch.undo()
    cpu_linear._load_numba_kernel()
    assert cpu_linear._small_batch_linear.signatures and cpu_linear._load_numba_kernel.cache_info().currsize == 1


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


def test_auto_linears_compute_only_the_token_positions_of_a_padded_forward():
    """Inside `tokens_at` (a `[rows, width]` forward on the model's own cache) the planned linears compute the
    token positions only, as the whole input would give them, padding as zeros; inputs of another shape, with
    rows == width (a `[width, rows]` layout could not be told apart), or with a token at every position (no
    padding to skip: no gather and scatter either) are computed whole."""
    from hf_specdec.token_rows import token_positions, tokens_at

    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 5, 64)
    tokens = torch.tensor([0, 1, 5, 10, 11, 12])  # row 0: 2 tokens, row 1: 1, row 2: 3
    with torch.no_grad(), fast_cpu_linears(layer, backend="auto"):
        whole = layer(x)
        with tokens_at((3, 5), tokens):
            padded = layer(x).reshape(15, 32)
            other = layer(x[:, :4])
        with tokens_at((5, 5), tokens):
            square = layer(torch.randn(5, 5, 64))
        with tokens_at((3, 5), torch.arange(15)):
            assert token_positions(x) is None
            full = layer(x)
    assert torch.allclose(full, whole, atol=1e-5)
    assert torch.allclose(padded[tokens], whole.reshape(15, 32)[tokens], atol=1e-5)
    assert padded[[i for i in range(15) if i not in tokens.tolist()]].eq(0).all()
    assert other.ne(0).all() and square.ne(0).all()


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


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba runs one thread here: nothing to reset")
def test_torch_keeps_its_thread_count_when_numba_starts(tmp_path):
    # numba's OpenMP pool, launched on first use in a process, reset OpenMP's thread count: torch set
    # to 1 thread ran at NUMBA_NUM_THREADS afterwards (a fresh process: this one's pool runs already)
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from hf_specdec.models.cpu_linear import fast_cpu_linears\n"
        "layer = torch.nn.Linear(64, 64)\n"
        "with torch.no_grad(), fast_cpu_linears(layer, backend='numba'):\n"
        "    layer(torch.randn(2, 64)); inside = torch.get_num_threads()\n"
        "print(inside, torch.get_num_threads())\n"
    )
    env = {**os.environ, "HF_SPECDEC_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.split() == ["1", "1"]


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
    config = {"method": "ngram", "num_speculative_tokens": 3, "cpu_linear_backend": backend}
    try:
        plain = enabled_llama.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID)
        # the first speculative call probes the architecture with one forward of the model as it is
        enabled_llama.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=PAD_TOKEN_ID, speculative_config=config)
        seen_forward.clear()
        out = enabled_llama.generate(
            ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID, return_dict_in_generate=True,
            speculative_config=config,
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
    monkeypatch.setattr(cpu_linear, "_plan_for", lambda network, linears, **options: plan)
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
    monkeypatch.setattr(cpu_linear, "_plan_for", lambda network, linears, **options: plan)
    used = []
    for route, forward in list(cpu_linear._FORWARDS.items()):
        monkeypatch.setitem(
            cpu_linear._FORWARDS, route, lambda self, x, route=route, forward=forward: used.append(route) or forward(self, x)
        )
    layer = tiny_llama.lm_head
    with torch.no_grad(), fast_cpu_linears(layer):
        assert layer in cpu_linear._PACKED_WEIGHTS  # its plan takes oneDNN at some row count: packed at once
        outputs = {rows: layer(torch.randn(1, rows, layer.in_features)) for rows in (1, 2, 3, 4, 5)}
    assert used == ["torch", "numba", "onednn", "onednn"]  # 5 rows, past the plan: F.linear itself
    for rows, out in outputs.items():
        assert out.shape == (1, rows, layer.out_features)


def test_each_weight_shape_takes_its_own_fastest_route(monkeypatch):
    # a head-like shape fastest on oneDNN from 2 rows, the body's shape on torch: each runs its own,
    # and all linears together (the plan's overall routes) take what their summed passes favour
    body, head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 512)
    network = torch.nn.Sequential(body, torch.nn.Linear(64, 64), head)

    def time_pass(route, rows, linears, weights=None):  # by shape, as `_time_pass` times them
        head_seconds = {"torch": 4.0 if rows > 1 else 1.0, "torch_t": 9.0, "onednn": 2.0, "numba": 9.0}[route]
        return {"64x64": {"torch": 1.0, "torch_t": 9.0, "onednn": 1.5, "numba": 9.0}[route], "512x64": head_seconds}

    monkeypatch.setattr(cpu_linear, "_time_pass", time_pass)
    (plan,) = cpu_linear.plan_linears(network, rows=(1, 2, 4))
    assert plan.shape_backends == {"64x64": ("torch",) * 3, "512x64": ("torch", "onednn", "onednn")}
    assert plan.backends == ("torch", "onednn", "onednn")  # 4.0 + 1.0 against 2.0 + 1.5
    assert plan.describe() == "rows 1: torch, 2-4: onednn, more: torch; 64x64: rows 1-4: torch, more: torch"
    assert plan.timings[2] == {"torch": 5.0, "torch_t": 18.0, "onednn": 3.5, "numba": 18.0}
    used = []
    for route, forward in list(cpu_linear._FORWARDS.items()):
        monkeypatch.setitem(
            cpu_linear._FORWARDS, route, lambda self, x, route=route, forward=forward: used.append(route) or forward(self, x)
        )
    with torch.no_grad(), fast_cpu_linears(network):
        body(torch.randn(3, 64))
        head(torch.randn(3, 64))
        head(torch.randn(1, 64))
    assert used == ["torch", "onednn", "torch"]


def test_auto_times_a_bounded_sample_with_every_shape_once(monkeypatch):
    # 6 decoder-like linears then a head of another shape, last (as an LM head comes last): the
    # sample takes about PLAN_BYTES of them, every shape in proportion, the head included
    linears = [torch.nn.Linear(64, 64, bias=False) for _ in range(6)] + [torch.nn.Linear(64, 128, bias=False)]
    monkeypatch.setattr(cpu_linear, "_plan_bytes", lambda: 3 * 64 * 64 * 4)
    sampled = []

    def fake_plan(sample, rows, time_pass, repeats, method=cpu_linear.PER_LINEAR):
        sampled.append(([linear.out_features for linear in sample], time_pass.keywords["weights"]))
        return BackendPlan(rows=(1,), backends=("torch",))

    monkeypatch.setattr(cpu_linear, "plan_backends", fake_plan)
    network = torch.nn.Sequential(*linears)
    with torch.no_grad():
        for _ in range(2):
            with fast_cpu_linears(network):
                network[0](torch.randn(1, 64))
    # 7 linears of 16 KiB (the head 32 KiB) in 48 KiB: 2 of the 6 (each standing for 3) and the head
    assert sampled == [([64, 64, 128], [3.0, 3.0, 1.0])]  # and once per process


def test_weighted_pass_counts_each_linear_as_often_as_it_stands_for():
    linears = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)]
    with torch.no_grad():
        once = cpu_linear._time_pass("torch", 2, linears, weights=[0.0, 0.0])
        weighted = cpu_linear._time_pass("torch", 2, linears, weights=[0.0, 1000.0])
    # timed by weight shape ("out x in")
    assert once == {"8x8": 0.0, "16x8": 0.0} and weighted["8x8"] == 0.0 and weighted["16x8"] > 0.0


def test_real_plan_uses_only_available_routes(tiny_llama):
    plan = plan_backends([m for m in tiny_llama.modules() if isinstance(m, torch.nn.Linear)], repeats=1)
    assert plan.rows == cpu_linear.PLAN_ROWS and len(plan.backends) == len(plan.rows)
    for rows, route in zip(plan.rows, plan.backends):
        assert route in ({"torch", "torch_t", "onednn"} | ({"numba"} if rows <= SMALL_BATCH_ROWS else set()))


# --- plans stored per machine: reused, re-timed when the key changes or when asked -----------------
@pytest.fixture
def counted_timing(monkeypatch):
    """Stubbed pass timings (torch fastest up to 3 rows, numba above): the calls, by route and rows."""
    calls = []

    def time_pass(route, rows, linears, weights=None):
        calls.append((route, rows))
        return {"torch": 1.0 if rows <= 3 else 3.0, "torch_t": 4.0, "onednn": 2.5, "numba": 2.0}[route]

    monkeypatch.setattr(cpu_linear, "_time_pass", time_pass)
    return calls


def _fresh_process(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_PLANS", {})  # what a new process starts with: no plan in memory


def test_plan_is_stored_and_reused_by_the_next_process(monkeypatch, counted_timing, plan_cache, tiny_llama):
    (plan,) = cpu_linear.plan_linears(tiny_llama)
    assert counted_timing and plan.source == "timed" and plan.method == "per-linear"
    assert plan.backends == tuple("torch" if rows <= 3 else "numba" for rows in cpu_linear.PLAN_ROWS[:7]) + ("onednn",) * 6
    (path,) = plan_cache.iterdir()
    assert plan.path == str(path) and [p.name for p in plan_cache.iterdir()] == [path.name]  # no temporary left
    stored = json.loads(path.read_text())
    assert stored["key"] == plan.key == cpu_linear.plan_key(list(cpu_linear._fp32_cpu_linears([tiny_llama])))
    assert stored["key"]["threads"] == torch.get_num_threads() and stored["key"]["torch"] == torch.__version__
    # (in, out, dtype, how many): gate_proj and up_proj of both layers and the LM head; both down_proj
    assert [64, 128, "float32", 5] in stored["key"]["linears"] and [128, 64, "float32", 2] in stored["key"]["linears"]
    assert stored["plan"]["rows"] == list(cpu_linear.PLAN_ROWS) and stored["plan"]["timings_ms"]["4"]["numba"] == 2000.0

    counted_timing.clear()
    _fresh_process(monkeypatch)
    (again,) = cpu_linear.plan_linears(tiny_llama)
    assert counted_timing == [] and again == plan and again.source == "stored"
    assert again.timings == plan.timings and again.path == plan.path
    _fresh_process(monkeypatch)
    with torch.no_grad(), fast_cpu_linears(tiny_llama):  # "auto" reads the stored plan too: no timing
        tiny_llama(torch.randint(3, 100, (1, 4)))
    assert cpu_linear.linear_plan(tiny_llama) == plan and counted_timing == []


@pytest.mark.parametrize("change", ["threads", "shapes", "torch", "numba", "cpu", "routes"])
def test_another_key_is_planned_anew(monkeypatch, counted_timing, plan_cache, tiny_llama, change):
    cpu_linear.plan_linears(tiny_llama)
    model = tiny_llama
    if change == "threads":
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # restored below, not by the code under test
    elif change == "shapes":
        model = build_tiny_llama(intermediate_size=96)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0.0")
    elif change == "numba":
        monkeypatch.setattr(numba, "__version__", "99.0.0")
    elif change == "cpu":
        monkeypatch.setattr(cpu_linear, "_cpu_name", lambda: "another CPU, 2 CPUs")
    else:
        monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    try:
        counted_timing.clear()
        _fresh_process(monkeypatch)
        (plan,) = cpu_linear.plan_linears(model)
    finally:
        if change == "threads":
            monkeypatch.undo()
            torch.set_num_threads(threads)
    assert counted_timing and plan.source == "timed"
    assert len(list(plan_cache.iterdir())) == 2  # one file per key: the first plan is still there


def test_unreadable_plan_is_ignored_with_a_warning_and_rewritten(monkeypatch, counted_timing, tiny_llama):
    (plan,) = cpu_linear.plan_linears(tiny_llama)
    good = json.loads(open(plan.path).read())
    wrong_key = {**good, "key": {**good["key"], "threads": 999}}
    unknown_route = {**good, "plan": {**good["plan"], "backends": ["mkl"] * len(good["plan"]["backends"])}}
    torn = json.dumps(good)[:200]
    for content in ("", "{not json", torn, json.dumps(wrong_key), json.dumps(unknown_route), json.dumps([1, 2])):
        with open(plan.path, "w") as file:
            file.write(content)
        counted_timing.clear()
        _fresh_process(monkeypatch)
        with pytest.warns(UserWarning, match="ignoring the stored CPU linear plan .* timing the routes again"):
            (again,) = cpu_linear.plan_linears(tiny_llama)
        assert counted_timing and again == plan and again.source == "timed"
        assert json.loads(open(plan.path).read())["plan"]["backends"] == list(plan.backends)  # rewritten whole


def test_replan_times_again_and_replaces_the_stored_plan(monkeypatch, counted_timing, tiny_llama):
    (plan,) = cpu_linear.plan_linears(tiny_llama)
    monkeypatch.setattr(cpu_linear, "_time_pass", lambda route, rows, linears, weights=None: 0.5 if route == "onednn" else 1.0)
    (again,) = cpu_linear.plan_linears(tiny_llama)
    assert again is plan  # in memory already: no timing
    (replanned,) = cpu_linear.plan_linears(tiny_llama, replan=True)
    assert set(replanned.backends) == {"onednn"} and replanned.path == plan.path
    _fresh_process(monkeypatch)
    assert cpu_linear.linear_plan(tiny_llama).backends == replanned.backends  # the stored plan was replaced
    (rows_asked,) = cpu_linear.plan_linears(tiny_llama, rows=(1, 2))  # other row counts than stored: timed
    assert rows_asked.rows == (1, 2) and rows_asked.source == "timed"


def test_env_var_replans_once_per_process(monkeypatch, counted_timing, tiny_llama):
    cpu_linear.plan_linears(tiny_llama)
    _fresh_process(monkeypatch)
    monkeypatch.setenv(cpu_linear.REPLAN_ENV, "1")
    counted_timing.clear()
    with torch.no_grad():
        for _ in range(2):
            with fast_cpu_linears(tiny_llama):
                tiny_llama(torch.randint(3, 100, (1, 3)))
    timed_passes = len(counted_timing)
    assert timed_passes > 0  # re-timed on the process's first use, not again on the second
    _fresh_process(monkeypatch)
    monkeypatch.setenv(cpu_linear.REPLAN_ENV, "0")
    cpu_linear.plan_linears(tiny_llama)
    assert len(counted_timing) == timed_passes  # "0": the stored plan


def test_busy_machine_retimes_and_does_not_store(monkeypatch, counted_timing, plan_cache, tiny_llama):
    # other processes took our cores all along: every row count is timed again, then given up on
    monkeypatch.setattr(cpu_linear._CpuWatch, "others_cores", lambda self: 1.0)
    with pytest.warns(UserWarning, match=r"other processes took this machine's cores .* not stored"):
        (plan,) = cpu_linear.plan_linears(tiny_llama, rows=(1, 2, 4))
    assert plan.disturbed == (1, 2, 4) and plan.path is None and not plan_cache.exists()
    routes = len(cpu_linear._routes())
    warm_up = 2 * routes  # a second pass costs what the first did: warm
    # 1 row: 1 + PLAN_RETRIES attempts; after that the machine is taken as busy: one attempt each
    assert len(counted_timing) == warm_up + routes * 3 * (1 + cpu_linear.PLAN_RETRIES) + 2 * routes * 3
    # quiet again: the next process times it afresh and stores it
    monkeypatch.setattr(cpu_linear._CpuWatch, "others_cores", lambda self: 0.0)
    _fresh_process(monkeypatch)
    (quiet,) = cpu_linear.plan_linears(tiny_llama, rows=(1, 2, 4))
    assert quiet.disturbed == () and quiet.path is not None


def test_busy_attempt_is_replaced_by_a_quieter_one(monkeypatch):
    # another process slows torch's BLAS during the first attempt (as it did, 7x, on a 2-core Xeon),
    # the watch says so, the second attempt is quiet: the quiet one decides
    state = {"quiet": False}

    def others_cores(self):
        busy = 0.1 if state["quiet"] else 2.0
        state["quiet"] = True
        return busy

    monkeypatch.setattr(cpu_linear._CpuWatch, "others_cores", others_cores)

    def time_pass(route, rows, linears):
        return {"torch": 1.0 if state["quiet"] else 9.0, "torch_t": 4.0, "onednn": 2.5, "numba": 2.0}[route]

    plan = plan_backends([torch.nn.Linear(8, 8)], rows=(2,), repeats=3, time_pass=time_pass)
    assert plan.backends == ("torch",) and plan.disturbed == () and plan.timings[2]["torch"] == 1.0


def test_warm_up_lasts_until_a_route_is_warm():
    # numba's first calls in a process are slow (its kernel loading, its threads starting)
    numba_calls = []

    def time_pass(route, rows, linears):
        if route != "numba":
            return {"torch": 1.0, "torch_t": 4.0, "onednn": 2.5}[route]
        numba_calls.append(rows)
        return {1: 2.0, 2: 1.2, 3: 0.2}.get(len(numba_calls), 0.5)

    plan = plan_backends([torch.nn.Linear(8, 8)], rows=(1,), repeats=1, time_pass=time_pass)
    assert len(numba_calls) == 5  # 4 warm-up passes (the 4th cost what the 3rd did), then the timed one
    assert plan.backends == ("numba",) and plan.timings[1]["numba"] == 0.5


def test_cpu_watch_counts_other_processes_only():
    watch = cpu_linear._CpuWatch()
    assert MEASURED_OTHERS_CORES(watch) is None  # too short a window to tell at /proc/stat's resolution
    if watch.start is None:
        pytest.skip("no /proc/stat here")
    watch.start = (watch.start[0], watch.start[1], watch.start[2] - 1.0)  # as if a second had passed
    others = MEASURED_OTHERS_CORES(watch)
    assert others is not None and others >= 0.0


def test_writers_never_leave_a_torn_file(monkeypatch, tiny_llama):
    linears = list(cpu_linear._fp32_cpu_linears([tiny_llama]))
    key = cpu_linear.plan_key(linears)
    path = cpu_linear.plan_path(key)
    big = {rows: {f"route{i}": float(i) for i in range(2000)} for rows in range(1, 9)}  # a file of ~400 KB
    plans = [BackendPlan(rows=tuple(range(1, 9)), backends=(route,) * 8, timings=big) for route in ("torch", "numba")]
    stop, seen, errors = threading.Event(), [], []

    def read():
        while not stop.is_set():
            try:
                seen.append(json.loads(path.read_text())["plan"]["backends"][0])
            except FileNotFoundError:
                pass
            except ValueError as error:  # a torn file
                errors.append(error)

    def write(plan):
        for _ in range(15):
            cpu_linear._store_plan(key, plan)

    reader = threading.Thread(target=read)
    reader.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, plans * 2))
    stop.set()
    reader.join()
    assert errors == [] and set(seen) <= {"torch", "numba"}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # every temporary file was renamed away
    # a writer that dies half way through leaves the previous file whole, and no temporary
    before = path.read_text()

    def dies(data, file, **kwargs):
        file.write(json.dumps(data)[:100])
        raise OSError("disk full")

    monkeypatch.setattr(cpu_linear.json, "dump", dies)
    with pytest.warns(UserWarning, match="could not store the CPU linear plan"):
        assert cpu_linear._store_plan(key, plans[0]) is None
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == [path.name]


def test_each_network_has_its_own_plan(counted_timing, plan_cache, tiny_llama):
    drafter = build_tiny_llama(num_hidden_layers=1, intermediate_size=96)
    plans = cpu_linear.plan_linears([tiny_llama, drafter, tiny_llama.model.layers[0]])
    assert plans[0].key["linears"] != plans[1].key["linears"] and plans[2] is None  # its linears: the target's
    assert len(list(plan_cache.iterdir())) == 2


def test_whole_forward_plan_times_the_model_forward(monkeypatch, plan_cache, tiny_llama):
    calls = []
    forward = type(tiny_llama).forward

    def counting_forward(self, *args, **kwargs):
        routes = {m.forward.__func__.__name__ for m in self.modules() if isinstance(m, torch.nn.Linear)}
        calls.append((kwargs["input_ids"].shape[1], routes))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_llama), "forward", counting_forward)
    (plan,) = cpu_linear.plan_linears(tiny_llama, whole_forward=True, rows=(1, 3), repeats=1)
    assert plan.method == "whole-forward" and plan.rows == (1, 3) and plan.path is not None
    assert all(len(routes) == 1 for _, routes in calls)  # every linear of a forward on one route
    assert {rows for rows, _ in calls} == {1, 3}
    assert {next(iter(routes)) for rows, routes in calls if rows == 3} == {
        f"_{name}_forward" for name in ("torch", "onednn", "numba")
    } | {"_torch_transposed_forward"}
    assert _patched(tiny_llama) == []  # restored
    assert json.loads(open(plan.path).read())["plan"]["method"] == "whole-forward"
    with pytest.raises(ValueError, match="whole-forward planning needs a model whose forward takes input_ids"):
        cpu_linear.plan_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), whole_forward=True)


def test_plan_table_shows_every_route_and_the_choice():
    plan = BackendPlan(
        rows=(1, 16), backends=("torch", "onednn"), disturbed=(16,),
        timings={1: {"torch": 0.001, "torch_t": 0.002, "onednn": 0.003, "numba": 0.0015},
                 16: {"torch": 0.004, "torch_t": 0.005, "onednn": 0.0035}},
    )  # fmt: skip
    lines = plan.table().splitlines()
    assert lines[0].split()[:6] == ["rows", "torch", "torch_t", "onednn", "numba", "chosen"]
    assert lines[1].split() == ["1", "1.00", "2.00", "3.00", "1.50", "torch"]
    assert lines[2].split()[:6] == ["16", "4.00", "5.00", "3.50", "-", "onednn"] and "busy" in lines[2]


@pytest.mark.parametrize("whole_forward", [False, True])
def test_cli_plan_linears_on_a_tiny_model(tmp_path, capsys, plan_cache, whole_forward):
    folder = tmp_path / "tiny"
    build_tiny_llama().save_pretrained(folder)
    threads = torch.get_num_threads()
    try:
        status = cli.main(
            ["plan-linears", "--model", str(folder), "--threads", "1", "--rows", "1,2,4", "--repeats", "1",
             *(["--whole-forward"] if whole_forward else [])]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    printed = capsys.readouterr().out
    (path,) = plan_cache.iterdir()
    stored = json.loads(path.read_text())
    assert stored["key"]["threads"] == 1 and stored["plan"]["rows"] == [1, 2, 4]
    assert stored["plan"]["method"] == ("whole-forward" if whole_forward else "per-linear")
    assert f"plan: {stored['plan']['text']}" in printed and f"stored in {path}" in printed
    assert "chosen" in printed and "1 threads" in printed
    for rows, route in zip((1, 2, 4), stored["plan"]["backends"]):
        assert any(line.split()[:1] == [str(rows)] and line.split()[-1] == route for line in printed.splitlines())


def test_bench_replan_linears_times_whole_forwards_first(tmp_path, capsys, plan_cache, word_tokenizer):
    folder = tmp_path / "tiny"
    build_tiny_llama().save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6 w7 w8 w5 w6 w7"}) + "\n")
    out = tmp_path / "results.json"
    status = cli.main(
        ["bench", "--model", str(folder), "--prompts", str(prompts), "--method", "ngram", "--k", "2",
         "--max-new-tokens", "4", "--device", "cpu", "--no-progress", "--replan-linears", "--out", str(out)]
    )  # fmt: skip
    assert status == 0
    assert "fp32 CPU linears timed again" in capsys.readouterr().out
    plan = json.loads(out.read_text())["cpu_linear_plan"]  # the arms ran by the plan timed before them
    assert plan["method"] == "whole-forward" and plan["path"] == str(next(plan_cache.iterdir()))
