"""JSON-schema generation with and without speculation: SmolLM2-135M-Instruct, xgrammar's processor.

Plain constrained `generate()` against ours (the n-gram drafter) on the same prompts, arms
interleaved per prompt (alternating which goes first), medians of tokens / s. Also reports whether
every output is token-identical to plain and parses as JSON.

    python benchmarks/bench_grammar.py --num-prompts 20 --max-new-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

import hf_specdec
from hf_specdec.models.real_models import load_smollm2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "country": {"type": "string"},
        "known_for": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "year", "country", "known_for"],
}
SUBJECTS = [
    "Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton", "Albert Einstein",
    "Nikola Tesla", "Rosalind Franklin", "Charles Darwin", "Galileo Galilei", "Katherine Johnson",
    "Tim Berners-Lee", "Linus Torvalds", "Barbara Liskov", "Donald Knuth", "Claude Shannon",
    "John von Neumann", "Dennis Ritchie", "Margaret Hamilton", "Edsger Dijkstra",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

    def run(prompt: str, speculate: bool) -> tuple[torch.Tensor, float, int]:
        inputs = tokenizer(prompt, return_tensors="pt")
        extra = {"speculative_config": config} if speculate else {}
        started = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             logits_processor=[LogitsProcessor(grammar)], **extra)
        seconds = time.perf_counter() - started
        new = out[0, inputs.input_ids.shape[1]:]
        return new, seconds, int((new != tokenizer.pad_token_id).sum())

    rates: dict[str, list[float]] = {"plain": [], "ours": []}
    identical = parsed = 0
    run(SUBJECTS[0], False), run(SUBJECTS[0], True)  # warm-up: numba, CPU linear plan, grammar caches
    for i, subject in enumerate(SUBJECTS[: args.num_prompts]):
        messages = [{"role": "user", "content": f"Give {subject}'s name, birth year, country and what they are known for, as JSON."}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        results = {}
        for arm in (("plain", "ours") if i % 2 == 0 else ("ours", "plain")):
            results[arm] = run(prompt, arm == "ours")
            rates[arm].append(results[arm][2] / results[arm][1])
        identical += torch.equal(results["plain"][0], results["ours"][0])
        try:
            json.loads(tokenizer.decode(results["ours"][0], skip_special_tokens=True))
            parsed += 1
        except json.JSONDecodeError:
            pass
    plain, ours = statistics.median(rates["plain"]), statistics.median(rates["ours"])
    n = min(args.num_prompts, len(SUBJECTS))
    print(f"{n} prompts, {args.max_new_tokens} new tokens, k={args.k}, {args.threads} threads")
    print(f"plain constrained generate(): {plain:.1f} tok/s; ours: {ours:.1f} tok/s; {ours / plain:.2f}x")
    print(f"identical to plain: {identical}/{n}; parse as JSON: {parsed}/{n}")
    print(f"cumulative metrics: {model.spec_decode_metrics.to_dict()['mean_acceptance_length']:.2f} tau")


if __name__ == "__main__":
    main()
