"""`hf-specdec serve` over real HTTP: uvicorn in a background thread on a free port, the tiny Llama
with the n-gram drafter, the word tokenizer (with a small chat template), the `openai` client and httpx.

Greedy answers are checked against plain `generate()` on an identical copy of the model (the
server's copy belongs to its engine thread).
"""

from __future__ import annotations

import copy
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import EOS_TOKEN_ID, build_tiny_llama, ngram_config, plain_generate
from prometheus_client.parser import text_string_to_metric_families
from transformers import LogitsProcessorList

from hf_specdec import SpeculativeEngine
from hf_specdec.sampling.penalties import OutputTokenPenalties
from hf_specdec.serving import build_app
from hf_specdec.serving.server import IncrementalText

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512  # the tiny Llama's max_position_embeddings
# role words, then the content's words; the assistant's turn starts with w6
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'w4', 'user': 'w5', 'assistant': 'w6'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w6{% endif %}"
)
PROMPTS = [
    "w10 w11 w12 w10 w11 w12 w10",
    "w20 w21 w20 w21 w20",
    "w30 w31 w32 w33 w30 w31",
    "w40 w41 w42 w43 w44 w40 w41 w42",
    "w50 w60 w50 w60",
    "w70 w71 w72 w73 w74 w75",
    "w80 w81 w80 w81 w80 w81 w80",
    "w90 w91 w92 w90 w91 w92",
]


def wait_for_health(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server at {url} did not answer /health within 30 s"
        time.sleep(0.05)


@contextmanager
def running_server(app):
    """The app served by uvicorn in a thread on a free port; yields the base URL once /health answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_for_health(url)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def tokenizer(word_tokenizer):
    tokenizer = copy.deepcopy(word_tokenizer)  # the session's fixture has no chat template: keep it so
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def engine(tokenizer):
    return SpeculativeEngine(build_tiny_llama(), ngram_config(k=4), max_batch_size=16, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with running_server(build_app(engine, tokenizer, MODEL_NAME)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """An identical copy of the model for plain generate()."""
    return build_tiny_llama()


def plain_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = plain_generate(
        model, input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False,
    )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_completion_greedy_matches_plain_generate(client, tokenizer, reference):
    # the word tokenizer's text maps back to its ids one to one ("w5w17"): equal text is equal tokens
    prompt_ids = ids(tokenizer, PROMPTS[0])
    expected = plain_greedy(reference, prompt_ids, 40)
    assert EOS_TOKEN_ID not in expected[:-1]
    for prompt in (PROMPTS[0], prompt_ids, [PROMPTS[0]]):  # a string, token ids, a list of one string
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, user="u1")
        assert reply.object == "text_completion" and reply.model == MODEL_NAME
        assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.choices[0].finish_reason == ("stop" if expected[-1] == EOS_TOKEN_ID else "length")
        usage = reply.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(expected))
        assert usage.total_tokens == len(prompt_ids) + len(expected)


def test_sampling_fields_reach_the_engine(client, tokenizer, reference):
    prompt_ids = ids(tokenizer, PROMPTS[1])
    greedy = tokenizer.decode(plain_greedy(reference, prompt_ids, 20), skip_special_tokens=True)
    for fields in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):  # each leaves one token: greedy's, sampled
        reply = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=1.5, seed=7, extra_body=fields
        )
        assert reply.choices[0].text == greedy, fields
    penalized = plain_generate(
        reference, input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=20, do_sample=False, repetition_penalty=1.5,
    )[0, len(prompt_ids) :].tolist()  # fmt: skip
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    assert reply.choices[0].text == tokenizer.decode(penalized, skip_special_tokens=True) != greedy
    sampled = [
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=1.5, seed=seed)
        .choices[0].text
        for seed in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] != sampled[2] and greedy not in sampled  # the seed is the request's


def test_penalties_and_logit_bias_match_plain_generate(client, tokenizer, reference):
    """OpenAI's presence_penalty / frequency_penalty (over the completion's tokens) and logit_bias,
    sent by the openai client as it sends them, against plain generate() with the same processors."""
    prompt_ids = ids(tokenizer, PROMPTS[2])
    greedy = plain_greedy(reference, prompt_ids, 24)
    logit_bias = {str(greedy[2]): -100, str(greedy[0] + 1): 5.5}

    def plain(**options) -> str:
        out = plain_generate(
            reference, input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=24, do_sample=False, **options,
        )  # fmt: skip
        return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)

    penalized = plain(logits_processor=LogitsProcessorList([OutputTokenPenalties(0.7, 0.4, prompt_width=len(prompt_ids))]))
    biased = plain(sequence_bias={(int(token),): float(bias) for token, bias in logit_bias.items()})
    plain_text = tokenizer.decode(greedy, skip_special_tokens=True)
    assert plain_text != penalized and plain_text != biased
    request = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    assert client.completions.create(**request, presence_penalty=0.7, frequency_penalty=0.4).choices[0].text == penalized
    assert client.completions.create(**request, logit_bias=logit_bias).choices[0].text == biased
    assert client.completions.create(**request, presence_penalty=0, frequency_penalty=0).choices[0].text == plain_text
    streamed = client.completions.create(**request, presence_penalty=0.7, frequency_penalty=0.4, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == penalized


def test_n_choices_whole_and_streamed(client, server, tokenizer, reference):
    """n choices: n requests in the engine, choice i seeded with seed + i (each as a request of its
    own with that seed), streamed under their indices; usage counts the prompt once."""
    sampled = {"model": MODEL_NAME, "prompt": PROMPTS[4], "max_tokens": 12, "temperature": 1.5}
    reply = client.completions.create(**sampled, n=3, seed=5)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    alone = [client.completions.create(**sampled, seed=5 + i) for i in range(3)]
    assert [choice.text for choice in reply.choices] == [a.choices[0].text for a in alone]
    assert len({choice.text for choice in reply.choices}) > 1
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = list(client.completions.create(**sampled, n=3, seed=5, stream=True, stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].text for c in streamed[:-1] if c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [choice.text for choice in reply.choices]
    assert streamed[-1].usage.completion_tokens == reply.usage.completion_tokens
    # chat, greedy: every choice is plain generate()'s text, each opened by its role chunk
    messages = [{"role": "user", "content": PROMPTS[5]}]
    expected = tokenizer.decode(plain_greedy(reference, [5, *ids(tokenizer, PROMPTS[5]), 6], 10), skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, n=2,
                                                 stream=True))  # fmt: skip
    for index in (0, 1):
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(choice.delta.content or "" for choice in mine) == expected
        assert mine[-1].finish_reason is not None
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, n=2)
    assert [choice.message.content for choice in whole.choices] == [expected, expected]


def test_completion_default_max_tokens_is_16(client, tokenizer, reference):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], temperature=0)
    expected = plain_greedy(reference, ids(tokenizer, PROMPTS[1]), 16)
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(expected) == 16


def test_completion_stream_with_usage(client, tokenizer, reference):
    expected = plain_greedy(reference, ids(tokenizer, PROMPTS[2]), 30)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 2  # streamed, not sent at the end
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.usage is None for chunk in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 30
    assert usage_chunk.usage.prompt_tokens == len(ids(tokenizer, PROMPTS[2]))


def test_chat_greedy_and_stream(client, tokenizer, reference):
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": PROMPTS[3]}]
    prompt_ids = [4, 7, 8, 5, *ids(tokenizer, PROMPTS[3]), 6]  # the template's role words around the contents
    expected = plain_greedy(reference, prompt_ids, 25)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=25, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(expected))
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=25, temperature=0, stream=True,
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)


def test_stop_string_cuts_the_text(client, tokenizer, reference):
    full = tokenizer.decode(plain_greedy(reference, ids(tokenizer, PROMPTS[4]), 30), skip_special_tokens=True)
    # four characters across a token boundary ("3w58"), first found past the 10th character
    start = next(index for index in range(10, len(full)) if full[index] != "w" and full.index(full[index : index + 4]) == index)
    stop = full[start : start + 4]
    expected = full[:start]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[4], max_tokens=30, temperature=0, stop=stop)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 30  # the engine stopped there too
    streamed = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[4], max_tokens=30, temperature=0, stop=["w999", stop], stream=True,
    ))  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def plain_logprobs(model, prompt_ids: list[int], max_new_tokens: int, **options) -> tuple[list[int], torch.Tensor]:
    """Plain greedy generate()'s tokens and the log-softmax of its raw logits at each."""
    tokens, raw, _ = plain_raw_and_processed(model, prompt_ids, max_new_tokens, **options)
    return tokens, raw


def plain_raw_and_processed(model, prompt_ids: list[int], max_new_tokens: int, **options):
    """Plain greedy generate()'s tokens, and the log-softmax of its raw and of its processed logits."""
    out = plain_generate(
        model, input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, output_scores=True,
        return_dict_in_generate=True, **options,
    )  # fmt: skip
    raw, processed = (torch.log_softmax(torch.cat(x).float(), dim=-1) for x in (out.logits, out.scores))
    return out.sequences[0, len(prompt_ids) :].tolist(), raw, processed


def test_completion_logprobs_are_the_models(client, tokenizer, reference):
    prompt_ids = ids(tokenizer, PROMPTS[1])
    tokens, expected = plain_logprobs(reference, prompt_ids, 24)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=True) for t in tokens]
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(tokens))]
    chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs), chosen, atol=1e-4, rtol=0)
    top_values, top_ids = expected.topk(3)
    for position, top in enumerate(logprobs.top_logprobs):  # greedy: the chosen token is the likeliest
        assert list(top) == [tokenizer.decode([t]) for t in top_ids[position].tolist()]
        torch.testing.assert_close(torch.tensor(list(top.values())), top_values[position], atol=1e-4, rtol=0)
    # the raw logits' (before processors): with a repetition penalty they differ from the processed ones
    tokens, raw, processed = plain_raw_and_processed(reference, prompt_ids, 24, repetition_penalty=1.5)
    penalized = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=1, extra_body={"repetition_penalty": 1.5}
    ).choices[0].logprobs
    assert penalized.tokens == [tokenizer.decode([t], skip_special_tokens=True) for t in tokens]
    raw_chosen, processed_chosen = (x.gather(1, torch.tensor(tokens)[:, None])[:, 0] for x in (raw, processed))
    assert not torch.allclose(raw_chosen, processed_chosen, atol=1e-2)
    torch.testing.assert_close(torch.tensor(penalized.token_logprobs), raw_chosen, atol=1e-4, rtol=0)
    none = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    zero = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=0)
    assert none.choices[0].logprobs is None and zero.choices[0].logprobs.top_logprobs == [{}] * 4


def test_chat_logprobs_streamed_and_whole_and_cut_by_a_stop_string(client, tokenizer, reference):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(template, add_special_tokens=False).input_ids
    tokens, expected = plain_logprobs(reference, prompt_ids, 20)
    options = {"model": MODEL_NAME, "messages": messages, "max_tokens": 20, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**options, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t], skip_special_tokens=True) for t in tokens]
    assert all(entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2 for entry in content)
    chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([entry.logprob for entry in content]), chosen, atol=1e-4, rtol=0)
    chunks = list(client.chat.completions.create(**options, top_logprobs=2, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(  # each chunk carries the log-probabilities of the tokens its text completes
        "".join(e.token for e in chunk.choices[0].logprobs.content).startswith(chunk.choices[0].delta.content or "")
        for chunk in chunks[1:] if chunk.choices[0].logprobs
    )
    assert all(not entry.top_logprobs for entry in client.chat.completions.create(**options).choices[0].logprobs.content)
    # a stop string starting inside a token's text (first found there): the text ends there, and the
    # log-probabilities at that token
    text = whole.choices[0].message.content
    ends = [len("".join(entry.token for entry in content[: i + 1])) for i in range(len(content))]
    token, stop_at = next(
        (i, ends[i - 1] + 1) for i in range(5, len(content)) if text.index(text[ends[i - 1] + 1 : ends[i - 1] + 4]) == ends[i - 1] + 1
    )
    cut = client.chat.completions.create(**options, stop=text[stop_at : stop_at + 3])
    assert cut.choices[0].message.content == text[:stop_at] and cut.choices[0].finish_reason == "stop"
    assert [entry.token for entry in cut.choices[0].logprobs.content] == [entry.token for entry in content[: token + 1]]


def test_engine_refuses_bad_logprobs():
    engine = SpeculativeEngine(build_tiny_llama(), ngram_config(k=2), max_batch_size=2)
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs must be an integer from 0 to 20"):
            engine.add_request([5, 6, 7], {"max_new_tokens": 4}, logprobs=bad)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "w5", "foo": 1}, "foo", ["foo", "allowed", "max_tokens"]),
        ({"prompt": "w5", "max_tokens": -3}, "max_tokens", ["greater than or equal to 1"]),
        ({"prompt": "w5", "max_tokens": 0}, "max_tokens", ["greater than or equal to 1"]),
        ({"prompt": "w5", "temperature": -0.5}, "temperature", ["greater than or equal to 0"]),
        ({"prompt": "w5", "top_p": 0}, "top_p", ["greater than 0"]),
        ({"prompt": "w5", "n": 17}, "n", ["allowed: 1 to 16"]),
        ({"prompt": "w5", "n": 0}, "n", ["allowed: 1 to 16"]),
        ({"prompt": "w5", "logprobs": 6}, "logprobs", ["less than or equal to 5"]),
        ({"prompt": "w5", "echo": True}, "echo", ["unknown or unsupported"]),
        ({"prompt": "w5", "presence_penalty": 2.5}, "presence_penalty", ["less than or equal to 2"]),
        ({"prompt": "w5", "frequency_penalty": -3}, "frequency_penalty", ["greater than or equal to -2"]),
        ({"prompt": "w5", "logit_bias": {"w5": 1}}, "logit_bias", ["token ids (strings of digits)", "-100 to 100"]),
        ({"prompt": "w5", "logit_bias": {"5": 101}}, "logit_bias", ["-100 to 100", "'5': 101"]),
        ({"prompt": "w5", "logit_bias": [5, 1]}, "logit_bias", ["an object mapping token ids"]),
        ({"prompt": "w5", "logit_bias": {"500": 1}}, "logit_bias", ["outside the vocabulary", "0 to 127"]),
        ({"prompt": ""}, "prompt", ["allowed"]),
        ({"prompt": [5, 500]}, "prompt", ["outside the vocabulary", "0 to 127"]),
        ({"prompt": " ".join(["w9"] * MAX_MODEL_LEN)}, "prompt", ["512 tokens", "at most 511"]),
        ({"prompt": " ".join(["w9"] * 500), "max_tokens": 20}, "max_tokens", ["max_tokens <= 12"]),
        ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options", ["stream=true"]),
        ({"prompt": "w5", "stop": ["w5", ""]}, "stop", ["non-empty"]),
        ({}, "prompt", ["required"]),
    ],
)
def test_bad_completion_requests_are_400s(server, body, param, words):
    response = httpx.post(f"{server}/v1/completions", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None
    assert all(word in error["message"] for word in words), error["message"]


def test_bad_chat_requests_and_bad_json(server):
    def post(body) -> httpx.Response:
        return httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL_NAME, **body})

    response = post({"messages": [{"role": "robot", "content": "w5"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].role"
    assert "'user'" in response.json()["error"]["message"]
    response = post({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "max_completion_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_completion_tokens"
    response = post({"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    response = post({"messages": [{"role": "user", "content": "w5"}, {"role": "user", "content": [image]}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].content"
    assert "takes no images" in response.json()["error"]["message"]
    response = post({"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert "allowed only with logprobs=true" in response.json()["error"]["message"]
    response = post({"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 21})
    assert response.status_code == 400 and "less than or equal to 20" in response.json()["error"]["message"]
    response = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "w5", ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server}/v1/completions", json={"model": "gpt-4", "prompt": "w5"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n="):
        openai.OpenAI(base_url=f"{server}/v1", api_key="x").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "w5"}], n=17
        )


def test_models_endpoint(client):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME


def test_engine_failure_is_a_500_and_the_server_keeps_serving(server, engine, tokenizer, reference):
    failures = []

    def fail_once(module, args):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected failure")

    hook = engine.model.get_input_embeddings().register_forward_pre_hook(fail_once)
    try:
        response = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 8}, timeout=30)
    finally:
        hook.remove()
    assert failures and response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    response = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0})
    expected = plain_greedy(reference, ids(tokenizer, PROMPTS[5]), 8)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == tokenizer.decode(
        expected, skip_special_tokens=True
    )


def test_engine_failure_mid_stream_is_an_error_event(server, engine):
    calls = []

    def fail_fourth_forward(module, args):
        calls.append(1)
        if len(calls) == 4:  # the prefill and two decode steps have gone out as chunks
            raise RuntimeError("injected failure")

    hook = engine.model.get_input_embeddings().register_forward_pre_hook(fail_fourth_forward)
    try:
        body = {"prompt": PROMPTS[5], "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    finally:
        hook.remove()
    assert response.status_code == 200 and events[-1] == "[DONE]"
    chunks, error = [json.loads(event) for event in events[:-2]], json.loads(events[-2])["error"]
    assert len(chunks) >= 2 and all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    assert httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 4}).status_code == 200


def metric_values(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, engine, stream):
    aborted = ("spec_decode_requests_total", (("endpoint", "completions"), ("finish_reason", "abort")))
    emitted = ("spec_decode_num_emitted_tokens_total", ())
    before = metric_values(server)
    # each step 20 ms slower: the 400 tokens would take seconds, the client leaves after a few
    hook = engine.model.get_input_embeddings().register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    try:
        body = {"prompt": PROMPTS[6], "max_tokens": 400, "temperature": 0, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{server}/v1/completions", json=body) as response:
                assert next(line for line in response.iter_lines() if line).startswith("data: {")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server}/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 10
        while metric_values(server).get(aborted, 0) == before.get(aborted, 0):
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)
    finally:
        hook.remove()
    values = metric_values(server)
    assert values[("spec_decode_num_requests_running", ())] == values[("spec_decode_num_requests_waiting", ())] == 0
    assert values[emitted] - before[emitted] < 200
    assert engine.num_running == engine.num_waiting == 0 and engine.num_kv_blocks_used == 0


def test_metrics_count_speculation_and_requests(server, client):
    before = metric_values(server)
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    after = metric_values(server)
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_emitted_tokens_total", "spec_decode_num_target_forwards_total"):  # fmt: skip
        assert after[(name, ())] > before.get((name, ()), 0), name
    emitted = after[("spec_decode_num_emitted_tokens_total", ())] - before[("spec_decode_num_emitted_tokens_total", ())]
    assert emitted == 30
    done = ("spec_decode_requests_total", (("endpoint", "completions"), ("finish_reason", "length")))
    assert after[done] == before.get(done, 0) + 1
    assert after[("spec_decode_mean_acceptance_length", ())] > 1  # repeated spans: drafts accepted


def test_eight_requests_at_once_match_each_alone(server, client):
    def ask(index: int) -> tuple[str, str]:
        sampled = index % 2 == 1  # half sampled with their own seeds: still what they give alone
        reply = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[index], max_tokens=12 + 3 * index,
            temperature=0.8 if sampled else 0, seed=index if sampled else None,
        )  # fmt: skip
        return reply.choices[0].text, reply.choices[0].finish_reason

    alone = [ask(index) for index in range(8)]
    before = metric_values(server)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    after = metric_values(server)
    assert together == alone
    steps, row_steps = (after[(name, ())] - before[(name, ())] for name in (
        "spec_decode_num_target_forwards_total", "spec_decode_num_row_steps_total"))  # fmt: skip
    assert row_steps > 2 * steps  # they shared steps: more than two rows per step on average


def test_api_key(word_tokenizer):
    engine = SpeculativeEngine(build_tiny_llama(), ngram_config(k=2), max_batch_size=2, tokenizer=word_tokenizer)
    with running_server(build_app(engine, word_tokenizer, MODEL_NAME, api_key="s3cret")) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(f"{url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "w5"}, headers=headers)
            assert response.status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        authorized = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        reply = authorized.completions.create(model=MODEL_NAME, prompt="w5 w6", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3
        response = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer s3cret"},
                              json={"messages": [{"role": "user", "content": "w5"}]})  # fmt: skip
        assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]


def test_encoder_decoder_completions_read_the_prompt_as_the_source(word_tokenizer, tmp_path):
    """A BART: each completion's prompt is its encoder's source, the decoder starts from its start token; four
    at once (sources of other lengths, one batched decoder forward) each give plain generate()'s tokens for the
    source alone, whole and streamed; usage counts the source; chat and a source too long are 400s."""
    import families
    from transformers import AutoModelForSeq2SeqLM

    from hf_specdec.models.auto_class import generation_model_class

    model = families.build_tiny_encoder_decoder("bart")
    model.save_pretrained(tmp_path)  # a folder loads as the seq2seq model, not its decoder (BART is a causal LM too)
    assert generation_model_class(tmp_path) is AutoModelForSeq2SeqLM
    reference = copy.deepcopy(model)
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4, tokenizer=word_tokenizer)
    prompts = PROMPTS[:4]
    expected = []
    for prompt in prompts:
        source = torch.tensor([ids(word_tokenizer, prompt)])
        out = plain_generate(reference, input_ids=source, attention_mask=torch.ones_like(source), max_new_tokens=12, do_sample=False)
        expected.append(out[0, 1:].tolist())  # after the decoder start token
    with running_server(build_app(engine, word_tokenizer, "tiny-bart")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def complete(prompt):
            return client.completions.create(model="tiny-bart", prompt=prompt, max_tokens=12, temperature=0)

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, prompts))
        for prompt, reply, tokens in zip(prompts, replies, expected):
            assert reply.choices[0].text == word_tokenizer.decode(tokens, skip_special_tokens=True)
            assert reply.usage.prompt_tokens == len(ids(word_tokenizer, prompt))
            assert reply.usage.completion_tokens == len(tokens)
        stream = client.completions.create(model="tiny-bart", prompt=prompts[1], max_tokens=12, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == replies[1].choices[0].text
        assert engine.metrics.num_accepted_tokens > 0
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
        assert response.status_code == 400 and "encoder-decoder model" in response.json()["error"]["message"]
        limit = model.config.max_position_embeddings
        response = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * (limit + 1), "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_incremental_text_holds_back_partial_characters_and_stop_strings():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # one token per byte: "é" is two tokens, the first of which decodes to U+FFFD alone
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                      merges=[]))  # fmt: skip
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    token_ids = tokenizer("héllo wörld, bye").input_ids
    assert len(token_ids) == len("héllo wörld, bye".encode())
    for stops, expected, reason in (([], "héllo wörld, bye", "length"), (["ld,", "xyz"], "héllo wör", "stop")):
        text = IncrementalText(tokenizer, stops)
        pieces = []
        for end in range(1, len(token_ids) + 1):
            finished = end == len(token_ids)
            output = SimpleNamespace(token_ids=token_ids[:end], finished=finished, finish_reason="length" if finished else None)
            pieces.append(text.advance(output))
            assert "\ufffd" not in pieces[-1]
            if text.finish_reason is not None:
                break
        assert "".join(pieces) == text.text == expected and text.finish_reason == reason


def test_cli_serve(monkeypatch, capsys, tokenizer):
    import hf_specdec.serving.server as server_module
    from hf_specdec.cli import main

    started = {}
    monkeypatch.setattr(server_module, "load_target", lambda name, dtype, device: (build_tiny_llama(), tokenizer))
    monkeypatch.setattr(server_module, "load_image_processor", lambda name: None)  # a text model
    monkeypatch.setattr(server_module, "run_app", lambda app, host, port: started.update(host=host, port=port))

    def spy_build_app(engine, tokenizer, model_name, api_key=None, engine_thread=True, processor=None):
        started.update(engine=engine, model_name=model_name, api_key=api_key, engine_thread=engine_thread,
                       processor=processor)  # fmt: skip
        return build_app(engine, tokenizer, model_name, api_key, engine_thread, processor)

    def spy_engine(model, speculative_config, **options):
        started.update(speculative_config=speculative_config)
        return SpeculativeEngine(model, speculative_config, **options)

    monkeypatch.setattr(server_module, "build_app", spy_build_app)
    monkeypatch.setattr(server_module, "SpeculativeEngine", spy_engine)
    monkeypatch.setenv("HF_SPECDEC_API_KEY", "from-env")
    config = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(
        ["serve", "--model", "tiny", "--speculative-config", config, "--max-model-len", "256", "--num-kv-blocks", "40"]
    ) == 0
    assert (started["host"], started["port"], started["api_key"], started["model_name"]) == (
        "127.0.0.1", 8000, "from-env", "tiny"
    )  # fmt: skip
    assert started["engine"].max_model_len == 256 and started["speculative_config"].num_speculative_tokens == 3
    assert started["engine"].cache.allocator.num_blocks == 40
    assert started["engine"].prefill_chunk_size == 512  # serve's default: long prompts join in chunks
    assert started["engine_thread"] is False  # run_app drives the engine on the main thread
    assert "warning" not in capsys.readouterr().err
    monkeypatch.delenv("HF_SPECDEC_API_KEY")
    main(["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "9001", "--prefill-chunk-size", "0"])
    assert (started["host"], started["port"], started["api_key"]) == ("0.0.0.0", 9001, None)
    assert started["engine"].prefill_chunk_size is None  # 0: each prompt in one step
    assert started["speculative_config"] is None  # no drafting
    assert "without an API key" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bad config fails before loading anything
        main(["serve", "--model", "tiny", "--speculative-config", '{"method": "nope"}'])
    assert "speculative_config.method='nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", "tiny", "--prefill-chunk-size", "-5"])
    assert "--prefill-chunk-size='-5': allowed: an integer >= 0 (0: off)" in capsys.readouterr().err
    # without the serve extra: what to install
    monkeypatch.setitem(sys.modules, "fastapi", None)
    for name in [name for name in sys.modules if name.startswith("hf_specdec.serving")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit, match=r'pip install "hf-specdec\[serve\]"'):
        main(["serve", "--model", "tiny", "--speculative-config", config])


def test_run_app_drives_the_engine_on_the_calling_thread(tokenizer, reference):
    """What `hf-specdec serve` runs: uvicorn on a thread of its own, the engine loop on the calling
    thread until the server stops (why: engine_loop.py)."""
    from hf_specdec.serving.server import run_app

    engine = SpeculativeEngine(build_tiny_llama(), ngram_config(k=4), max_batch_size=4, tokenizer=tokenizer)
    app = build_app(engine, tokenizer, MODEL_NAME, engine_thread=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stepping_threads = set()
    step = engine.step

    def recording_step():
        stepping_threads.add(threading.current_thread().name)
        return step()

    engine.step = recording_step
    caller = threading.Thread(target=run_app, args=(app, "127.0.0.1", port), name="caller", daemon=True)
    caller.start()
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url)
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    body = {"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": 12, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["text"] == tokenizer.decode(plain_greedy(reference, prompt_ids, 12))
    assert stepping_threads == {"caller"}
    app.state.engine_loop.stop()  # as uvicorn's shutdown does: the loop ends, then the HTTP thread
    caller.join(timeout=30)
    assert not caller.is_alive()


def test_response_format_is_plain_constrained_generate():
    """json_schema / json_object: the reply equals plain greedy generate() with xgrammar's processor
    for the same schema (a tiny random Llama over SmolLM2's tokenizer, which can spell JSON); a bad
    schema or a missing one is a 400 naming it."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

    from hf_specdec.models.real_models import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    special = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id, "pad_token_id": 0}
    model, reference = (build_tiny_llama(vocab_size=len(tokenizer), **special) for _ in range(2))
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4, tokenizer=tokenizer)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok", "n"]}
    prompt_ids = tokenizer("The answer, as JSON:").input_ids

    def constrained(grammar) -> str:
        out = plain_generate(
            reference, input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=24, do_sample=False, logits_processor=[XgrammarProcessor(grammar)],
        )  # fmt: skip
        return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)

    with running_server(build_app(engine, tokenizer, "tiny-json")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        formats = {
            "json_schema": ({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                            compiler.compile_json_schema(json.dumps(schema))),
            "json_object": ({"type": "json_object"}, compiler.compile_json_schema('{"type": "object"}', strict_mode=False)),
        }  # fmt: skip
        texts = {}
        for name, (response_format, grammar) in formats.items():
            reply = client.completions.create(
                model="tiny-json", prompt=prompt_ids, max_tokens=24, temperature=0, extra_body={"response_format": response_format}
            )
            texts[name] = reply.choices[0].text
            assert texts[name] == constrained(grammar), name
            assert texts[name].lstrip().startswith("{"), texts[name]
        free = client.completions.create(model="tiny-json", prompt=prompt_ids, max_tokens=24, temperature=0).choices[0].text
        assert free not in texts.values()  # the constraint changed the output: the comparison proves something
        for bad, param in (
            ({"type": "json_schema"}, "response_format"),
            ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}, "response_format.json_schema.schema"),
            ({"type": "xml"}, "response_format.type"),
        ):  # fmt: skip
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "response_format": bad})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
