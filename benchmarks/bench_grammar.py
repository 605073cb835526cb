"""JSON-schema generation with and without speculation: SmolLM2-135M-Instruct, xgrammar's processor.

Plain constrained `generate()`, the same inside our fp32 CPU linears (speculation's own share), and
ours (the n-gram drafter) on the same prompts, arms interleaved per prompt (order reversed every
other prompt), medians of tokens / s and of per-prompt ratios. Also reports whether
every output is token-identical to plain and parses as JSON.

    python benchmarks/bench_grammar.py --num-prompts 20 --max-new-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

import hf_specdec
from hf_specdec.models.cpu_linear import fast_cpu_linears
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

    def run(prompt: str, arm: str) -> tuple[torch.Tensor, float, int]:
        inputs = tokenizer(prompt, return_tensors="pt")
        extra = {"speculative_config": config} if arm == "ours" else {}
        linears = fast_cpu_linears(model) if arm == "plain_fast_linears" else contextlib.nullcontext()
        started = time.perf_counter()
        with linears:
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 logits_processor=[LogitsProcessor(grammar)], **extra)
        seconds = time.perf_counter() - started
        new = out[0, inputs.input_ids.shape[1]:]
        return new, seconds, int((new != tokenizer.pad_token_id).sum())

    arms = ("plain", "plain_fast_linears", "ours")
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    identical = parsed = 0
    for arm in arms:  # warm-up: numba, CPU linear plan, grammar caches
        run(SUBJECTS[0], arm)
    for i, subject in enumerate(SUBJECTS[: args.num_prompts]):
        messages = [{"role": "user", "content": f"Give {subject}'s name, birth year, country and what they are known for, as JSON."}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        results = {}
        for arm in arms if i % 2 == 0 else arms[::-1]:
            results[arm] = run(prompt, arm)
            rates[arm].append(results[arm][2] / results[arm][1])
        identical += torch.equal(results["plain"][0], results["ours"][0])
        try:
            json.loads(tokenizer.decode(results["ours"][0], skip_special_tokens=True))
            parsed += 1
        except json.JSONDecodeError:
            pass
    median = {arm: statistics.median(rates[arm]) for arm in arms}
    ratio = {base: statistics.median(o / b for o, b in zip(rates["ours"], rates[base])) for base in arms[:2]}
    n = min(args.num_prompts, len(SUBJECTS))
    print(f"{n} prompts, {args.max_new_tokens} new tokens, k={args.k}, {args.threads} threads")
    print(
        f"plain constrained generate(): {median['plain']:.1f} tok/s; the same with our CPU linears: "
        f"{median['plain_fast_linears']:.1f} tok/s; ours: {median['ours']:.1f} tok/s; "
        f"{ratio['plain']:.2f}x plain, {ratio['plain_fast_linears']:.2f}x plain with the same linears (medians of per-prompt ratios)"
    )
    print(f"identical to plain: {identical}/{n}; parse as JSON: {parsed}/{n}")
    print(f"cumulative metrics: {model.spec_decode_metrics.to_dict()['mean_acceptance_length']:.2f} tau")


if __name__ == "__main__":
    main()
