"""Tool calling in /v1/chat/completions over real HTTP (the `openai` client): a tiny random Qwen2
over SmolLM2's tokenizer (which spells JSON), with a ChatML chat template that renders tools.

A named function and "required" are constrained by xgrammar: the reply equals plain greedy
`generate()` with xgrammar's processor for the same schema, token for token. "auto" replies go
through transformers' response parser with its Qwen template (found by the model type).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import xgrammar as xgr
from conftest import ngram_config, plain_generate
from test_server import running_server
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

from hf_specdec import SpeculativeEngine
from hf_specdec.models.real_models import smollm2_path
from hf_specdec.serving import build_app
from hf_specdec.serving.protocol import ChatCompletionRequest
from hf_specdec.serving.tools import StreamedReply, ToolCalling

MODEL_NAME = "tiny-qwen"
# ChatML with tools, laid out as Qwen2.5's template lays them out
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls is defined %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
            "required": ["unit", "rain"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def tiny_qwen(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=0,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def reference(tokenizer):
    return tiny_qwen(tokenizer)


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = SpeculativeEngine(tiny_qwen(tokenizer), ngram_config(k=3), max_batch_size=4, tokenizer=tokenizer)
    with running_server(build_app(engine, tokenizer, MODEL_NAME)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def constrained(tokenizer, reference, ids: list[int], schema: dict, max_new_tokens: int) -> str:
    """Plain greedy generate() under xgrammar's processor for `schema` (compact JSON, as the server asks)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    out = plain_generate(
        reference, input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, logits_processor=[XgrammarProcessor(grammar)],
    )  # fmt: skip
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_named_function_is_constrained_to_its_arguments(client, tokenizer, reference):
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, max_tokens=40,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    reply = client.chat.completions.create(**request)
    ids = prompt_ids(tokenizer, MESSAGES, [WEATHER, CLOCK])
    expected = constrained(tokenizer, reference, ids, WEATHER["function"]["parameters"], 40)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert call.function.arguments == expected
    assert set(json.loads(expected)) == {"unit", "rain"}
    assert reply.usage.prompt_tokens == len(ids)  # the tools were rendered into the prompt
    # streamed as OpenAI streams a call: its id and name with the first piece of the arguments, then pieces
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    pieces = [call for d in deltas for call in d.tool_calls or []]
    assert len(pieces) > 1 and all(piece.index == 0 for piece in pieces)
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(piece.id is None and piece.function.name is None for piece in pieces[1:])
    assert "".join(piece.function.arguments for piece in pieces) == expected


def test_required_is_a_list_of_calls_to_the_tools(server, client, tokenizer, reference):
    """At least one call, each naming a tool with its parameters; one at most without parallel calls
    (the random model, left free, adds calls until max_tokens)."""
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = reply.choices[0]
    body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    schema = ToolCalling(body, tokenizer, "qwen2").schema
    assert schema["maxItems"] == 1 and {c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]} == {
        "get_weather", "get_time"}  # fmt: skip
    expected = json.loads(constrained(tokenizer, reference, prompt_ids(tokenizer, MESSAGES, [WEATHER, CLOCK]), schema, 60))
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (call["name"], call["parameters"]) for call in expected
    ]
    assert len(expected) == 1
    metrics = httpx.get(f"{server}/metrics").text
    assert 'finish_reason="tool_calls"' in metrics  # counted as the reply ended, not as its text did
    many = ToolCalling(body.model_copy(update={"parallel_tool_calls": True}), tokenizer, "qwen2").schema
    assert "maxItems" not in many


def test_auto_without_a_call_is_text_and_history_with_calls_is_rendered(client, tokenizer, reference):
    """The random model writes no call: the reply is its text (plain greedy generate() of the prompt
    with the tools). Earlier calls and their results reach the template (arguments as a mapping)."""
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c", "rain": false}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, dry"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], temperature=0, max_tokens=12)
    rendered = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"unit": "c", "rain": False}}}]}, history[2]]  # fmt: skip
    ids = prompt_ids(tokenizer, rendered, [WEATHER])
    assert '"arguments": {"unit": "c", "rain": false}' in tokenizer.decode(ids) and "18 C, dry" in tokenizer.decode(ids)
    plain = plain_generate(reference, input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=12, do_sample=False)  # fmt: skip
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == len(ids)
    assert choice.message.content == tokenizer.decode(plain[0, len(ids) :], skip_special_tokens=True)
    assert choice.message.tool_calls is None and choice.finish_reason == "length"


def test_auto_finds_calls_with_the_families_response_template(tokenizer):
    """A finished reply holding a call, as token ids and as text (a stop string cut it): content and
    tool calls split by transformers' parser, arguments back as JSON text."""
    tools = ToolCalling(ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER]), tokenizer, "qwen2")
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f", "rain": true}}\n</tool_call>'
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False).input_ids
    prompt = prompt_ids(tokenizer, MESSAGES, [WEATHER])
    for token_ids in (ids, None):
        message, finish_reason = tools.message(text, token_ids, prompt, "stop")
        assert finish_reason == "tool_calls" and message["content"] == "Checking."
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"unit": "f", "rain": True})}
    assert tools.message("Just text", None, prompt, "stop") == ({"content": "Just text"}, "stop")
    two = text + "\n" + text.split("\n", 1)[1].replace("get_weather", "get_time")
    one = ToolCalling(ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER, CLOCK], parallel_tool_calls=False),
                      tokenizer, "qwen2")  # fmt: skip
    assert len(tools.message(two, None, prompt, "stop")[0]["tool_calls"]) == 2
    assert [c["function"]["name"] for c in one.message(two, None, prompt, "stop")[0]["tool_calls"]] == ["get_weather"]
    assert tools.message(text[:20], None, prompt, "length") == ({"content": text[:20]}, "length")


def test_streamed_auto_replies_are_parsed_as_they_come(tokenizer):
    """Fed a token at a time, the streamed parser sends the content as it comes and each call once
    closed: together they are the whole reply's parse."""
    tools = ToolCalling(ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER, CLOCK]), tokenizer, "qwen2")
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f", "rain": true}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"utc": false}}\n</tool_call>')  # fmt: skip
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False).input_ids
    prompt = prompt_ids(tokenizer, MESSAGES, [WEATHER, CLOCK])
    whole, _ = tools.message(text, ids, prompt, "stop")
    stream = StreamedReply(tools, prompt)
    deltas = [stream.feed([token], "") for token in ids] + [stream.finish()]
    assert sum(bool(d.get("content")) for d in deltas) > 1  # the content came in pieces
    assert "".join(d.get("content", "") for d in deltas).strip() == whole["content"]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and stream.num_calls == 2
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]


def test_streamed_auto_text_matches_the_whole_reply(client):
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    contents = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    assert len(contents) > 1 and "".join(contents) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", ["allowed only with tools"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         ["'nope' is not among tools"]),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ["'none', 'auto', 'required'"]),
        ({"tools": [WEATHER, WEATHER]}, "tools", ["distinct function names"]),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", ["pattern"]),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         ["cannot be combined with tools"]),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
         "messages[0].tool_calls[0].function.arguments", ["a JSON object as a string"]),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0]", ["tool_call_id exactly in tool messages"]),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]", ["content is required"]),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(server, body, param, words):
    response = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(word in error["message"] for word in words), error


def test_models_that_cannot_take_tools_are_told_why(reference):
    """SmolLM2's own template never reads `tools`; a Llama has no response template for "auto"."""
    from conftest import build_tiny_llama

    plain_template = AutoTokenizer.from_pretrained(smollm2_path())
    engine = SpeculativeEngine(tiny_qwen(plain_template), ngram_config(k=3), max_batch_size=2)
    with running_server(build_app(engine, plain_template, MODEL_NAME)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "does not render tools" in response.json()["error"]["message"]
    tools_template = AutoTokenizer.from_pretrained(smollm2_path())
    tools_template.chat_template = TOOLS_TEMPLATE
    llama = build_tiny_llama(vocab_size=len(tools_template), eos_token_id=tools_template.eos_token_id, pad_token_id=0)
    engine = SpeculativeEngine(llama, ngram_config(k=3), max_batch_size=2)
    with running_server(build_app(engine, tools_template, MODEL_NAME)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        assert "model type 'llama'" in response.json()["error"]["message"]
        forced = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60, "temperature": 0})
        assert forced.status_code == 200 and forced.json()["choices"][0]["message"]["tool_calls"]
