"""SpeculativeEngine: requests that join a running batch get exactly what each gets alone.

Greedy identity with plain generate() for requests added mid-flight (every kind of drafter), rows
freed on finish and abort, admission that waits for KV blocks, per-request sampling (the exact
distribution, seeds), stop reasons, bad input, and a failing step that ends only its requests.
"""

from __future__ import annotations

import copy
import random

import families
import numpy as np
import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    FIRST_WORD_ID,
    SMALL_VOCAB_SIZE,
    VOCAB_SIZE,
    build_small_vocab_llama,
    build_tiny_llama,
    ngram_config,
    plain_generate,
    repeated_span_prompts,
)
from test_architectures import image_prompts, tiny_gemma3_vlm
from test_draft_model import perturbed_copy
from test_eagle import random_head
from test_sampling_distribution import (
    NEW_TOKENS,
    PENALTIES,
    PROMPT,
    SETTINGS,
    chi_square_pvalue,
    exact_distribution,
)
from transformers import LogitsProcessorList

import hf_specdec
from hf_specdec import SpeculativeEngine
from hf_specdec.cache.architectures import UnsupportedModelError
from hf_specdec.cache.paged_attention import ATTENTION_NAME
from hf_specdec.drafters.drafting import DraftTokenPicker
from hf_specdec.drafters.eagle import EagleProposer
from hf_specdec.loop import engine as engine_module
from hf_specdec.loop.step import DecodeState, prompt_chunks
from hf_specdec.sampling.penalties import OutputTokenPenalties


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama()


def _configs(model) -> dict:
    return {
        "none": None,
        "ngram": ngram_config(k=4),
        "draft_model": {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": random_head(model, "eagle3"), "num_speculative_tokens": 2},
        "layer_skip": {"method": "layer_skip", "early_exit_layer": 1, "num_speculative_tokens": 2},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "ngram_auto_k": ngram_config(k="auto"),
        "ngram_tree": ngram_config(k=4, tree={"num_nodes": 8, "topk": 2}),
    }


def _alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = plain_generate(
        model, input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _run(engine: SpeculativeEngine, arrivals: dict[int, list[tuple]], max_steps: int = 500) -> dict[str, list]:
    """Step the engine; before step s add the requests `arrivals[s]` ((prompt, config) pairs). Returns
    every request's outputs, in order."""
    outputs: dict[str, list] = {}
    for step in range(max_steps):
        for prompt, config in arrivals.get(step, []):
            outputs[engine.add_request(prompt, config)] = []
        for output in engine.step():
            outputs[output.request_id].append(output)
        if not engine.has_unfinished() and step >= max(arrivals):
            return outputs
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize(
    "method", ["none", "ngram", "draft_model", "eagle3", "layer_skip", "suffix", "ngram_auto_k", "ngram_tree"]
)
def test_requests_joining_mid_flight_match_plain_generate(model, method):
    prompts = repeated_span_prompts(7, seed=3)
    lengths = [12, 30, 7, 25, 18, 3, 22]
    engine = SpeculativeEngine(model, _configs(model)[method], max_batch_size=4)
    arrivals = {0: [], 2: [], 5: []}
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        arrivals[(0, 2, 5)[i % 3]].append((prompt, {"max_new_tokens": length, "do_sample": False}))
    outputs = _run(engine, arrivals)
    expected = {tuple(p): _alone(model, p, n) for p, n in zip(prompts, lengths)}
    assert len(outputs) == len(prompts)
    for request_outputs, (prompt, _) in zip(outputs.values(), [a for s in sorted(arrivals) for a in arrivals[s]]):
        final = request_outputs[-1]
        assert final.finished and sum(not o.finished for o in request_outputs) == len(request_outputs) - 1
        assert [t for o in request_outputs for t in o.new_token_ids] == final.token_ids
        assert final.token_ids == expected[tuple(prompt)], method
        assert final.finish_reason == ("stop" if final.token_ids[-1] == EOS_TOKEN_ID else "length")
    assert engine.num_kv_blocks_used == 0
    assert engine.num_running == 0 and engine.num_waiting == 0
    if method not in ("none",):
        assert engine.metrics.num_draft_tokens > 0
    # idle: the model is handed back (its attention restored), plain generate works on it
    assert model.config._attn_implementation != ATTENTION_NAME
    assert _alone(model, prompts[0], 5) == expected[tuple(prompts[0])][:5]


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle3", "layer_skip", "ngram_tree"])
def test_chunked_prefill_matches_plain_generate(model, method):
    """Prompts fed 5 tokens a step (`prefill_chunk_size`): rows in the middle of their prompt sit in
    the same forwards as rows decoding, and every output is still plain generate()'s."""
    prompts = repeated_span_prompts(6, seed=3)
    lengths = [12, 30, 7, 25, 18, 3]
    engine = SpeculativeEngine(model, _configs(model)[method], max_batch_size=4, prefill_chunk_size=5)
    arrivals = {0: [], 3: []}
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        arrivals[0 if i < 3 else 3].append((prompt, {"max_new_tokens": length, "do_sample": False}))
    outputs = _run(engine, arrivals)
    assert [o[-1].token_ids for o in outputs.values()] == [_alone(model, p, n) for p, n in zip(prompts, lengths)]
    assert engine.num_kv_blocks_used == 0 and (method == "none" or engine.metrics.num_draft_tokens > 0)


@pytest.mark.parametrize("model_type", ["mistral", "lfm2"])
def test_chunked_prefill_on_windows_and_recurrent_state(model_type):
    other = families.build_tiny_model(model_type)
    prompts = repeated_span_prompts(4, seed=6)
    engine = SpeculativeEngine(other, ngram_config(k=3), max_batch_size=3, prefill_chunk_size=4)
    outputs = _run(engine, {0: [(p, {"max_new_tokens": 12, "do_sample": False}) for p in prompts[:3]],
                            2: [(prompts[3], {"max_new_tokens": 12, "do_sample": False})]})  # fmt: skip
    assert [o[-1].token_ids for o in outputs.values()] == [_alone(other, p, 12) for p in prompts]


def test_prompt_chunks_share_the_budget_begun_prompts_first():
    """Rows 0-3: a new 30-token prompt, a decoding row, a prompt begun earlier (20 left), a new
    5-token prompt. Budget 24: the begun prompt takes 20 (its last chunk: it steps), the new long
    one the 4 left; the short one waits; the decoding row always steps."""
    state = DecodeState(
        token_buffer=torch.zeros(4, 64, dtype=torch.long), pad_lens=np.zeros(4, dtype=np.int64),
        seq_lens=np.array([30, 12, 40, 5]), num_cached=np.array([0, 11, 20, 0]), finished=np.zeros(4, dtype=bool),
        max_lengths=np.full(4, 64), pad_token_id=0, position_offsets=np.zeros(4, dtype=np.int64),
    )  # fmt: skip
    rows, chunk_rows, chunk_lens = prompt_chunks(state, np.arange(4), budget=24)
    assert rows.tolist() == [1, 2] and chunk_rows.tolist() == [0] and chunk_lens.tolist() == [4]
    rows, chunk_rows, chunk_lens = prompt_chunks(state, np.arange(4), budget=100)
    assert rows.tolist() == [0, 1, 2, 3] and len(chunk_rows) == 0


def test_chunked_prefill_gives_drafters_the_whole_prompt_at_once(model, monkeypatch):
    """A drafter sees a chunked prompt as it sees an unchunked one: not at all while it is fed, then
    every position's target features at once (EAGLE-3: the same drafts, step for step)."""
    prompt = repeated_span_prompts(1, seed=5)[0]
    config = _configs(model)["eagle3"]
    calls = []
    propose = EagleProposer.propose

    def logged(self, request):
        proposal = propose(self, request)
        calls.append([(len(t), d.tolist()) for t, d in zip(request.token_ids, proposal.draft_token_ids)])
        return proposal

    monkeypatch.setattr(EagleProposer, "propose", logged)
    runs = {}
    for chunk in (None, 4):
        calls.clear()
        engine = SpeculativeEngine(model, config, max_batch_size=1, prefill_chunk_size=chunk)
        request_id, steps_to_first_token = engine.add_request(prompt, {"max_new_tokens": 20, "do_sample": False}), 0
        while not any(o.request_id == request_id for o in engine.step()):
            steps_to_first_token += 1
        while engine.has_unfinished():
            engine.step()
        runs[chunk] = (list(calls), steps_to_first_token)
    assert runs[4][1] == -(-len(prompt) // 4) - 1 and runs[None][1] == 0  # the chunks' steps emit nothing
    assert runs[4][0] == runs[None][0] and sum(len(d) for step in runs[None][0] for _, d in step) > 0


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "lfm2"])
def test_other_architectures_joining_mid_flight_match_plain_generate(model_type):
    """A sliding window (Mistral), sliding + global layers with soft-caps (Gemma 3) and a hybrid whose
    recurrent state runs one row per forward (LFM2): rows that join and leave keep each its own."""
    other = families.build_tiny_model(model_type)
    prompts = repeated_span_prompts(5, seed=6)
    lengths = [14, 6, 20, 9, 16]
    engine = SpeculativeEngine(other, ngram_config(k=3), max_batch_size=3)
    arrivals = {0: [], 3: []}
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        arrivals[0 if i < 3 else 3].append((prompt, {"max_new_tokens": length, "do_sample": False}))
    outputs = _run(engine, arrivals)
    assert [o[-1].token_ids for o in outputs.values()] == [_alone(other, p, n) for p, n in zip(prompts, lengths)]
    assert engine.metrics.num_accepted_tokens > 0 and engine.num_kv_blocks_used == 0


@pytest.mark.parametrize(("method", "prefill_chunk_size"), [("ngram", None), ("ngram_auto_k", 5), ("eagle3", None)])
def test_image_requests_joining_mid_flight_match_plain_generate(method, prefill_chunk_size):
    """Requests with images (`model_inputs`) are prefilled by the model's own forward as they join, one
    of them while the other rows decode on the paged attention; each equals plain generate() alone."""
    model = tiny_gemma3_vlm()
    batch = image_prompts()
    prompts = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    prompts.append(repeated_span_prompts(1, seed=4)[0])  # text only
    inputs = [{"pixel_values": batch["pixel_values"][i : i + 1], "token_type_ids": (torch.tensor([p]) == 299).long()}
              for i, p in enumerate(prompts[:2])] + [None]  # fmt: skip
    expected = [
        plain_generate(model, input_ids=torch.tensor([p]), **(extra or {}), max_new_tokens=20, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, extra in zip(prompts, inputs)
    ]
    config = ngram_config(k=3 if method == "ngram" else "auto") if method != "eagle3" else {
        "method": "eagle3", "model": hf_specdec.EagleHead.for_target(model, "eagle3", seed=0), "num_speculative_tokens": 2,
    }  # fmt: skip
    engine = SpeculativeEngine(model, config, max_batch_size=3, prefill_chunk_size=prefill_chunk_size)
    order = [2, 0, 1]  # the text request first, an image request at once, the other two steps later
    ids, finished = {}, {}
    for step in range(200):
        for i in {0: order[:2], 2: order[2:]}.get(step, []):
            ids[engine.add_request(prompts[i], {"max_new_tokens": 20, "do_sample": False}, model_inputs=inputs[i])] = i
        for output in engine.step():
            if output.finished:
                finished[ids[output.request_id]] = output.token_ids
        if step >= 2 and not engine.has_unfinished():
            break
    assert [finished[i] for i in range(3)] == expected
    assert engine.metrics.num_draft_tokens > 0 and engine.num_kv_blocks_used == 0
    assert model.config.text_config._attn_implementation != ATTENTION_NAME


def test_with_chunked_prefill_one_image_prompt_joins_per_step():
    """A burst of image requests: with `prefill_chunk_size` each step admits one (the running rows wait
    for one image prefill at a time); without it, every one that fits joins at once."""
    model = tiny_gemma3_vlm()
    batch = image_prompts()
    prompt = batch["input_ids"][1].tolist()
    inputs = {"pixel_values": batch["pixel_values"][1:], "token_type_ids": (torch.tensor([prompt]) == 299).long()}
    running = {}
    for chunk in (None, 64):
        engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4, prefill_chunk_size=chunk)
        for _ in range(3):
            engine.add_request(prompt, {"max_new_tokens": 24, "do_sample": False}, model_inputs=inputs)
        running[chunk] = []
        while engine.has_unfinished():
            engine.step()
            running[chunk].append(engine.num_running)
        assert engine.num_kv_blocks_used == 0
    assert running[None][0] == 3 and running[64][:3] == [1, 2, 3]


@pytest.mark.parametrize("with_a_bad_request", [False, True])
def test_image_requests_joining_together_share_one_prefill(monkeypatch, with_a_bad_request):
    """Image requests of one shape that join in one step are prefilled by one forward of the model (a batch),
    and each equals plain generate() alone (drafts accepted and rejected after it). One whose image tokens do not match its image fails the batch: then each runs alone, that one fails
    ("error") and the others are as before."""
    model = tiny_gemma3_vlm()
    image = [297, 299, 299, 299, 299, 298]
    prompts = [[2, 5, 6, *image, 7, 8, 9, 7, 8], [2, 9, 4, *image, 20, 21, 22, 20, 21], [2, 7, *image, 5, 6, 5, 6, 5, 6]]
    pixels = [sign * (1 + 0.1 * torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(i))) for i, sign in enumerate((1, -1, 0.5))]
    if with_a_bad_request:  # 3 image tokens for an image of 4: the model's forward raises
        prompts.insert(1, [2, 5, 6, 297, 299, 299, 299, 298, 7, 8, 9, 7, 8, 9])
        pixels.insert(1, pixels[0])
    inputs = [{"pixel_values": p, "token_type_ids": (torch.tensor([prompt]) == 299).long()} for prompt, p in zip(prompts, pixels)]
    batches = []
    prefill = engine_module.prefill_with_model
    monkeypatch.setattr(engine_module, "prefill_with_model", lambda model, ids, *a, **kw: batches.append(len(ids)) or prefill(model, ids, *a, **kw))
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4)
    greedy = {"max_new_tokens": 16, "do_sample": False}
    ids = [engine.add_request(prompt, greedy, model_inputs=extra) for prompt, extra in zip(prompts, inputs)]
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert batches == ([4, 1, 1, 1, 1] if with_a_bad_request else [3])
    for request_id, prompt, extra in zip(ids, prompts, inputs):
        if with_a_bad_request and prompt is prompts[1]:
            assert finished[request_id].finish_reason == "error" and "tokens" in finished[request_id].error
            continue
        plain = plain_generate(model, input_ids=torch.tensor([prompt]), **extra, **greedy)
        assert finished[request_id].token_ids == plain[0, len(prompt) :].tolist()
    assert engine.metrics.num_accepted_tokens > 0 and engine.num_kv_blocks_used == 0


def test_image_requests_refused_where_generate_refuses_them():
    """Hybrids (recurrent state): the engine refuses their image inputs, naming them."""
    engine = SpeculativeEngine(families.build_tiny_model("lfm2"), ngram_config(k=3), max_batch_size=2)
    with pytest.raises(ValueError, match=r"model inputs \['pixel_values'\] are not supported .*recurrent state"):
        engine.add_request([2, 5, 6, 7], model_inputs={"pixel_values": torch.zeros(1, 3, 8, 8)})
    assert engine.num_waiting == 0


def test_aborts_free_every_block_and_drafter_row(model):
    config = {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}
    engine = SpeculativeEngine(model, config, max_batch_size=4)
    prompts = repeated_span_prompts(6, seed=5)
    ids = [engine.add_request(p, {"max_new_tokens": 40}) for p in prompts]
    engine.step()
    engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 2
    assert engine.abort(ids[1]) and engine.abort(ids[5])  # one running, one waiting
    assert not engine.abort(ids[1]) and not engine.abort("unknown")
    assert engine.num_running == 3 and engine.num_waiting == 1
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id not in (ids[1], ids[5])
            if output.finished:
                finished[output.request_id] = output.token_ids
    assert sorted(finished) == sorted(ids[i] for i in (0, 2, 3, 4))
    for i in (0, 2, 3, 4):
        assert finished[ids[i]] == _alone(model, prompts[i], 40)
    assert engine.num_kv_blocks_used == 0
    assert engine.proposer.cache.num_blocks_used == 0


def test_admission_waits_for_blocks(model):
    """A pool for two requests at a time: the others queue (never an exhausted pool) and all finish exactly."""
    prompts = repeated_span_prompts(5, seed=8)
    needed = max(-(-(len(p) + 20 + 1) // 16) for p in prompts)
    engine = SpeculativeEngine(model, ngram_config(k=4), max_batch_size=4, num_kv_blocks=2 * needed)
    ids = [engine.add_request(p, {"max_new_tokens": 20, "do_sample": False}) for p in prompts]
    most_running, finished = 0, {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
        most_running = max(most_running, engine.num_running)
    assert most_running == 2
    assert [finished[i] for i in ids] == [_alone(model, p, 20) for p in prompts]
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.add_request(prompts[0], {"max_new_tokens": 2 * needed * 16})


def test_two_hundred_requests_with_random_aborts(model):
    rng = random.Random(0)
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=16, num_kv_blocks=40)
    live, results, aborted = set(), {}, set()
    submitted = 0
    while submitted < 200 or engine.has_unfinished():
        while submitted < 200 and engine.num_running + engine.num_waiting < 16:
            prompt = [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
            config = {"max_new_tokens": rng.randint(1, 12), "do_sample": rng.random() < 0.5, "temperature": 0.8}
            live.add(engine.add_request(prompt, config, seed=submitted))
            submitted += 1
        for output in engine.step():
            assert output.request_id in live
            if output.finished:
                live.discard(output.request_id)
                results[output.request_id] = output
        if live and rng.random() < 0.2:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            live.discard(victim)
            aborted.add(victim)
    assert not live
    assert len(results) + len(aborted) == 200
    assert all(o.finish_reason in ("stop", "length") for o in results.values())
    assert engine.num_kv_blocks_used == 0 and engine._reserved_blocks == 0
    assert engine.num_running == engine.num_waiting == 0


def test_sampled_requests_follow_the_exact_distribution():
    """Each request samples with its own processors and seed; the engine's drafts are greedy (one-hot q)."""
    small = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(small, sampling)
    engine = SpeculativeEngine(small, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, max_batch_size=64)
    config = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0, **sampling}

    def samples(config: dict, seeds: range) -> np.ndarray:
        for seed in seeds:
            engine.add_request(PROMPT, config, seed=seed)
        out = []
        while engine.has_unfinished():
            out.extend(o.token_ids for o in engine.step() if o.finished)
        return np.array(out)

    assert chi_square_pvalue(samples(config, range(3000)), exact) > 1e-3
    assert engine.metrics.num_draft_tokens > 0
    # the same test fails for requests processed with another temperature: it has power
    assert chi_square_pvalue(samples({**config, "temperature": 0.6}, range(3000, 4000)), exact) < 1e-6


def test_sampled_image_requests_follow_the_exact_distribution():
    """A 16-token Gemma 3 with a SigLIP tower: sampled requests with an image, prefilled by the model's
    own forward as they join, follow the exact distribution plain generate() gives with that image;
    the same requests with another image (what a prefill that lost the image would give) fail it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=SMALL_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, pad_token_id=0, eos_token_id=None, bos_token_id=None, initializer_range=0.3,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=15, boi_token_index=13,
        eoi_token_index=14, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    vlm = Gemma3ForConditionalGeneration(config).eval()
    torch.nn.init.normal_(vlm.model.multi_modal_projector.mm_input_projection_weight, std=0.3)  # zeros at init
    prompt = [2, 3, 13, 15, 15, 15, 15, 14, 5, 7, 5, 7]
    images = {sign: sign * (1 + 0.1 * torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))) for sign in (1, -1)}

    def inputs(input_ids: torch.Tensor, sign: int = 1) -> dict:
        return {"pixel_values": images[sign].expand(len(input_ids), -1, -1, -1), "token_type_ids": (input_ids == 15).long()}

    # the image token is never sampled (a prefix holding more of them than the image has features is no prompt)
    sampling = {**SETTINGS["temperature_topk_topp"], "suppress_tokens": [15]}
    exact = exact_distribution(vlm, sampling, prompt, inputs, tokens=range(15))
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    engine = SpeculativeEngine(vlm, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, max_batch_size=64)
    generation = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0, **sampling}
    samples = {1: [], -1: []}
    for sign, count in ((1, 2000), (-1, 500)):
        ids = {engine.add_request(prompt, generation, seed=seed, model_inputs=inputs(torch.tensor([prompt]), sign)): sign
               for seed in range(count)}  # fmt: skip
        while engine.has_unfinished():
            samples[sign].extend(o.token_ids for o in engine.step() if o.finished and ids.get(o.request_id) == sign)
    assert engine.metrics.num_draft_tokens > 0 and engine.num_kv_blocks_used == 0
    right, wrong = chi_square_pvalue(np.array(samples[1]), exact), chi_square_pvalue(np.array(samples[-1]), exact)
    # measured: 0.55 with the image, 7e-19 with the other one
    assert right > 1e-3 and wrong < 1e-6


@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram_tree"])
def test_requests_with_their_own_processors_match_plain_generate(model, method):
    """Each request brings its own processors (`logits_processor=`: here OpenAI's penalties, some with
    none) next to the others; each equals plain generate() of its prompt alone with that processor.
    With trees, each node's logits go through the processors of the request it belongs to."""
    prompts = repeated_span_prompts(5, seed=8)
    penalties = [(0.0, 0.0), (0.8, 0.0), (0.0, 0.5), (-0.5, 0.3), (0.4, 0.4)]
    engine = SpeculativeEngine(model, _configs(model)[method], max_batch_size=3)
    greedy = {"max_new_tokens": 24, "do_sample": False}
    expected, outputs = {}, {}
    for prompt, (presence, frequency) in zip(prompts, penalties):
        processors = [OutputTokenPenalties(presence, frequency, prompt_width=len(prompt))]
        request_id = engine.add_request(prompt, greedy, logits_processor=processors)
        plain = plain_generate(model, input_ids=torch.tensor([prompt]), pad_token_id=0,
                               logits_processor=LogitsProcessorList(processors), **greedy)  # fmt: skip
        expected[request_id] = plain[0, len(prompt) :].tolist()
    while engine.has_unfinished():
        outputs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert outputs == expected
    assert sum(expected[r] != _alone(model, p, 24) for r, p in zip(expected, prompts)) >= 3, "penalties did not bite"
    assert engine.metrics.num_accepted_tokens > 0 and engine.num_kv_blocks_used == 0


@pytest.mark.parametrize(("prefill_chunk_size", "count"), [(None, 3000), (3, 1500)])
def test_sampled_requests_with_penalties_follow_the_exact_distribution(prefill_chunk_size, count):
    """Sampled requests with OpenAI's penalties, drafted by the target itself (most positions sit
    behind accepted drafts, which the penalties must count), against the exact distribution; also
    with the 8-token prompts fed 3 tokens a step (fewer requests: at 3 prompt tokens a step in all,
    1500 requests' prompts alone take 4000 steps)."""
    small = hf_specdec.enable(build_small_vocab_llama())
    exact = exact_distribution(small, PENALTIES)
    engine = SpeculativeEngine(
        small, {"method": "draft_model", "model": copy.deepcopy(small), "num_speculative_tokens": 3}, max_batch_size=64,
        prefill_chunk_size=prefill_chunk_size,
    )  # fmt: skip
    config = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0, "temperature": PENALTIES["temperature"]}
    for seed in range(count):
        engine.add_request(PROMPT, config, seed=seed, logits_processor=PENALTIES["logits_processor"])
    samples = []
    while engine.has_unfinished():
        samples.extend(o.token_ids for o in engine.step() if o.finished)
    assert engine.metrics.num_accepted_tokens > count
    assert chi_square_pvalue(np.array(samples), exact) > 1e-3


def _sampled_run(small, draft, config, seeds) -> tuple[np.ndarray, SpeculativeEngine]:
    engine = SpeculativeEngine(small, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}, max_batch_size=64)
    for seed in seeds:
        engine.add_request(PROMPT, config, seed=seed)
    samples = []
    while engine.has_unfinished():
        samples.extend(o.token_ids for o in engine.step() if o.finished)
    return np.array(samples), engine


def test_sampled_requests_draft_from_their_own_distribution(monkeypatch):
    """A draft model samples each sampled request's drafts from q warped by the request's own
    processors (exact with the p/q test), and they pass far more often than argmax drafts would."""
    small = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(small, sampling)
    config = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0, **sampling}
    draft_probs_given = []
    step_module = __import__("hf_specdec.loop.step", fromlist=["rejection_sample"])
    sample = step_module.rejection_sample
    monkeypatch.setattr(
        step_module, "rejection_sample",
        lambda spec, *a, draft_probs=None, **kw: draft_probs_given.append(draft_probs is not None) or sample(
            spec, *a, draft_probs=draft_probs, **kw
        ),
    )  # fmt: skip
    samples, engine = _sampled_run(small, perturbed_copy(small), config, range(3000))
    assert engine.metrics.num_draft_tokens > 0 and any(draft_probs_given)
    assert chi_square_pvalue(samples, exact) > 1e-3
    # the draft model is the target itself: q is the request's p, so nearly every draft passes
    # (a one-hot q, the argmax drafted, passes with p(argmax): well under half here)
    _, same = _sampled_run(small, copy.deepcopy(small), config, range(300))
    assert same.metrics.num_accepted_tokens / same.metrics.num_draft_tokens > 0.97
    # q must be the distribution the draft was drawn from: the argmax passed off with the sampled q
    # is biased, and the test sees it (any draft passed off as one-hot would be exact)
    pick = DraftTokenPicker.pick
    monkeypatch.setattr(DraftTokenPicker, "pick", lambda self, logits, rows: (logits.argmax(-1), pick(self, logits, rows)[1]))
    wrong, _ = _sampled_run(small, perturbed_copy(small), config, range(3000, 5000))
    assert chi_square_pvalue(wrong, exact) < 1e-6


def test_mixed_greedy_and_sampled_requests_with_a_draft_model(model):
    """Greedy requests beside sampled ones still equal plain greedy generate() (their q is one-hot)."""
    config = {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}
    engine = SpeculativeEngine(model, config, max_batch_size=4)
    prompts = repeated_span_prompts(4, seed=21)
    sampled = {"max_new_tokens": 24, "do_sample": True, "temperature": 0.8}
    for prompt, seed in zip(prompts[1:], (3, -5, 2**64 - 1)):  # any seed torch takes
        engine.add_request(prompt, sampled, seed=seed)
    assert _finished(engine, prompts[0], {"max_new_tokens": 24, "do_sample": False}, seed=None) == _alone(model, prompts[0], 24)


def _finished(engine, prompt, config, seed) -> list[int]:
    request_id = engine.add_request(prompt, config, seed=seed)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.token_ids


def test_seeds_reproduce_whatever_else_runs(model):
    sampled = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.9, "top_k": 20}
    prompts = repeated_span_prompts(4, seed=11)
    alone = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=1)
    expected = _finished(alone, prompts[0], sampled, seed=7)
    crowded = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4)
    for prompt in prompts[1:]:
        crowded.add_request(prompt, {**sampled, "temperature": 1.3}, seed=1)
    assert _finished(crowded, prompts[0], sampled, seed=7) == expected
    assert _finished(alone, prompts[0], sampled, seed=8) != expected


def test_stop_strings_and_finish_reasons(model, word_tokenizer):
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=2, tokenizer=word_tokenizer)
    prompt = repeated_span_prompts(1, seed=2)[0]
    full = _alone(model, prompt, 12)
    stop = word_tokenizer.decode(full[3:5])
    output = _finished(engine, prompt, {"max_new_tokens": 12, "stop_strings": [stop]}, None)
    assert output == full[:5]
    request_id = engine.add_request(prompt, {"max_new_tokens": 4})
    reasons = [o.finish_reason for _ in range(10) for o in engine.step() if o.request_id == request_id and o.finished]
    assert reasons == ["length"]
    no_tokenizer = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=1)
    with pytest.raises(ValueError, match="tokenizer"):
        no_tokenizer.add_request(prompt, {"max_new_tokens": 4, "stop_strings": ["w5"]})


@pytest.mark.parametrize(
    ("prompt", "config", "message"),
    [
        ([], None, "prompt_ids must be a non-empty"),
        ([[3, 4]], None, "prompt_ids must be a non-empty 1-D"),
        ([3, VOCAB_SIZE], None, r"prompt_ids must be token ids in \[0, 128\)"),
        ([3, 4], {"max_new_tokens": 0}, "max_new_tokens` must be greater than 0"),
        ([3, 4], {"max_new_tokens": 600}, "exceeds max_model_len=512"),
        ([3, 4], {"num_beams": 2}, "num_beams=2 is not supported"),
        ([3, 4], {"dola_layers": "high"}, "generation_config.dola_layers='high' asks for DoLa decoding"),
        ([3, 4], {"not_a_field": 1}, r"unknown fields \['not_a_field'\]"),
        ([3, 4], "greedy", "generation_config must be a GenerationConfig"),
    ],
)
def test_bad_requests_are_refused(model, prompt, config, message):
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=1)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, config)
    assert not engine.has_unfinished()


def test_bad_engine_arguments(model):
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        SpeculativeEngine(model, None, max_batch_size=0)
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        SpeculativeEngine(model, None, max_model_len=10_000)
    with pytest.raises(ValueError, match="prefill_chunk_size must be a positive integer"):
        SpeculativeEngine(model, None, prefill_chunk_size=0)
    engine = SpeculativeEngine(model, None, max_batch_size=1)
    engine.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="request_id='a' must be a string not already in use"):
        engine.add_request([3, 4], request_id="a")
    for processors in ("greedy", [1.5], OutputTokenPenalties(0.5, prompt_width=2)):
        with pytest.raises(ValueError, match="logits_processor must be a list of transformers LogitsProcessor"):
            engine.add_request([3, 4], logits_processor=processors)


def test_models_it_cannot_run_exactly_are_refused():
    """The engine runs the same architecture check as generate(): a refusal naming the reason, not a wrong output."""
    with pytest.raises(UnsupportedModelError, match=r"model_type='rwkv'.*keeps its own cache class"):
        SpeculativeEngine(families.build_tiny_model("rwkv"), ngram_config(k=3))


def test_a_failing_step_ends_its_requests_only(model, monkeypatch):
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=2)
    prompts = repeated_span_prompts(3, seed=4)
    first = [engine.add_request(p, {"max_new_tokens": 10}) for p in prompts[:2]]
    waiting = engine.add_request(prompts[2], {"max_new_tokens": 10})
    engine.step()
    original = engine_module.speculative_step

    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine_module, "speculative_step", failing)
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == sorted(first)
    assert all(o.finish_reason == "error" and "RuntimeError: boom" in o.error for o in failed)
    assert engine.num_kv_blocks_used == 0 and engine.num_waiting == 1
    monkeypatch.setattr(engine_module, "speculative_step", original)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.finished)
    assert [o.request_id for o in outputs] == [waiting]
    assert outputs[0].token_ids == _alone(model, prompts[2], 10)
