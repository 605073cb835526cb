"""One model instance speculates in one thread at a time: the loop switches the model's attention
implementation (a config setting every forward reads), so a second thread is refused instead of
running on the other's attention or restoring the wrong setting afterwards."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import build_tiny_llama, ngram_config, plain_generate, repeated_span_batch

import hf_specdec
from hf_specdec.cache.paged_attention import use_paged_attention


def test_a_second_thread_is_refused_while_one_speculates():
    model = hf_specdec.enable(build_tiny_llama())
    inputs = repeated_span_batch(2, seed=3)
    expected = plain_generate(model, **inputs, max_new_tokens=12, do_sample=False)
    original = model.config._attn_implementation
    inside, leave = threading.Event(), threading.Event()

    def hold():  # stands for a speculative call running in another thread
        with use_paged_attention(model):
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="another thread is speculating"):
            model.generate(**inputs, max_new_tokens=12, do_sample=False, speculative_config=ngram_config(3))
        with pytest.raises(RuntimeError, match="plain generate"):
            model.generate(**inputs, max_new_tokens=12, do_sample=False)
    finally:
        leave.set()
        holder.join(30)
    assert model.config._attn_implementation == original
    # once it is done, both run again, and right
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False, speculative_config=ngram_config(3))
    assert torch.equal(out, expected)
    assert torch.equal(model.generate(**inputs, max_new_tokens=12, do_sample=False), expected)


def test_concurrent_calls_on_one_model_never_give_wrong_output():
    model = hf_specdec.enable(build_tiny_llama())
    inputs = repeated_span_batch(2, seed=5)
    expected = plain_generate(model, **inputs, max_new_tokens=16, do_sample=False)
    original = model.config._attn_implementation
    results, errors = [], []

    def run():
        for _ in range(3):
            try:
                results.append(
                    model.generate(**inputs, max_new_tokens=16, do_sample=False, speculative_config=ngram_config(4))
                )
            except RuntimeError as error:
                errors.append(str(error))

    threads = [threading.Thread(target=run, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    assert len(results) + len(errors) == 9 and results
    assert all(torch.equal(out, expected) for out in results)
    assert all("another thread is speculating" in error for error in errors)
    assert model.config._attn_implementation == original


def test_the_architecture_probe_holds_the_model_until_its_own_forwards_end():
    """check_architecture compares the paged forward with the model's own: while that runs, another
    thread must not switch the model's attention (it would run the own forward on the paged one, and
    the model would be refused as unsupported: a race seen in CI)."""
    from hf_specdec.cache import architectures

    model = build_tiny_llama()
    in_own_forward, go_on = threading.Event(), threading.Event()

    def pause_in_own_forward(module, args, kwargs):
        if kwargs.get("use_cache") is False:  # the probe's reference forward
            in_own_forward.set()
            go_on.wait(30)

    handle = model.register_forward_pre_hook(pause_in_own_forward, with_kwargs=True)
    verdicts = []
    prober = threading.Thread(target=lambda: verdicts.append(architectures._verdict(model)), daemon=True)
    prober.start()
    try:
        assert in_own_forward.wait(30)
        with pytest.raises(RuntimeError, match="another thread is speculating"), use_paged_attention(model):
            pass
    finally:
        go_on.set()
        prober.join(30)
        handle.remove()
    assert verdicts == [""]  # supported, as it is
