"""Regenerate the assistant turns of a conversation dataset with the target itself.

    python -m hf_specdec.trainers.regenerate --target <folder|Hub id> --data <file|Hub id> \\
        --output regenerated.jsonl [--skip-records N] [--max-records N] [--min-prompt-tokens N] \\
        [--max-new-tokens 256] [--batch-size 32]

A head drafts the *target's* continuations. Trained on someone else's text (ShareGPT answers
come from ChatGPT) it sees features of text the target would not write, and learns from positions
the target never reaches at inference. EAGLE-3 and SpecForge therefore regenerate the answers with
the target: the first user turn (after any system turn) of each record is kept, the target
answers it, greedy by default (what a greedy user runs) or sampled with --temperature. Output:
jsonl records `{"messages": [..., {"role": "assistant", "content": <target's answer>}],
"truncated": <cut by --max-new-tokens>}` that the trainer reads directly (a truncated answer is
rendered without its end-of-turn marker). Rows are batched by prompt length with left padding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .data import check_chat_template, load_records, to_messages


def first_turn_prompt(messages: list[dict]) -> list[dict] | None:
    """System turn(s) and the first user turn, or None when the record has no user turn."""
    prompt = []
    for message in messages:
        prompt.append(message)
        if message["role"] == "user":
            return prompt if message["content"].strip() else None
    return None


@torch.no_grad()
def answer_batch(
    model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None
) -> list[dict]:
    """The target's answers to a batch of chat prompts (a left-padding tokenizer), as trainer records
    `{"messages": [*prompt, answer], "truncated": bool}`; empty answers are dropped. Greedy unless
    `sampling` says otherwise."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sequences = model.generate(
        **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        **(sampling or {"do_sample": False}),
    )
    new_tokens = sequences[:, inputs.input_ids.shape[1] :]
    answers = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    eos_ids = torch.tensor(list(eos) if isinstance(eos, (list, tuple)) else [eos])
    # an answer cut by max_new_tokens has no end of turn: the trainer must not teach one there
    truncated = ~torch.isin(new_tokens, eos_ids).any(dim=1)
    return [
        {"messages": [*prompt, {"role": "assistant", "content": answer}], "truncated": cut}
        for prompt, answer, cut in zip(prompts, answers, truncated.tolist())
        if answer.strip()
    ]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.trainers.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--data-split", default="train")
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--skip-records", type=int, default=0, help="start after the first N records (the next slice)")
    parser.add_argument("--max-records", type=int, default=None)
    parser.add_argument("--min-prompt-tokens", type=int, default=1,
                        help="shorter prompts are skipped: prompts are answered shortest first (in characters), so a "
                        "stopped run answered mostly short ones; this answers the longer rest of the same records "
                        "(a token bound: a few prompts near the cut may be answered again)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts are skipped")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the target's weights while it answers; on a 2-core Xeon with AMX, bfloat16 answered "
                        "32 prompts x 64 tokens 2.3x faster than float32 (its greedy answers are then bf16's)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("max_records", "min_prompt_tokens", "max_prompt_tokens", "max_new_tokens", "batch_size", "num_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} is invalid; allowed: an integer >= 1")
    if args.skip_records < 0:
        parser.error(f"--skip-records={args.skip_records} is invalid; allowed: an integer >= 0")
    if args.min_prompt_tokens > args.max_prompt_tokens:
        parser.error(f"--min-prompt-tokens={args.min_prompt_tokens} is invalid; allowed: at most "
                     f"--max-prompt-tokens={args.max_prompt_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature={args.temperature} is invalid; allowed: 0 (greedy) or a number > 0")
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code, padding_side="left")
    check_chat_template(tokenizer)
    records = load_records(args.data, args.data_split)
    if args.skip_records and args.skip_records >= len(records):
        parser.error(f"--skip-records={args.skip_records} is invalid; allowed: fewer than the {len(records)} records of --data")
    end = len(records) if args.max_records is None else min(args.skip_records + args.max_records, len(records))
    records = records.select(range(min(args.skip_records, end), end))
    prompts = []
    for record in records:
        prompt = first_turn_prompt(to_messages(record))
        if prompt is None:
            continue
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if args.min_prompt_tokens <= len(tokenizer(text, add_special_tokens=False).input_ids) <= args.max_prompt_tokens:
            prompts.append((prompt, text))
    prompts.sort(key=lambda p: len(p[1]))  # similar lengths per batch: little padding
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    with open(output, "w") as out:
        for begin in tqdm(range(0, len(prompts), args.batch_size), desc="regenerating"):
            batch = [prompt for prompt, _ in prompts[begin : begin + args.batch_size]]
            for record in answer_batch(model, tokenizer, batch, args.max_new_tokens, sampling):
                out.write(json.dumps(record) + "\n")
            out.flush()
    return output


if __name__ == "__main__":
    main()
