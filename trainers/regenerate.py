"""Regenerate the assistant turns of a conversation dataset with the target itself.

    python -m hf_specdec.trainers.regenerate --target <folder|Hub id> --data <file|Hub id> \\
        --output regenerated.jsonl [--turns 1] [--skip-records N] [--max-records N] \\
        [--min-prompt-tokens N] [--max-new-tokens 256] [--batch-size 32]

A head drafts the *target's* continuations. Trained on someone else's text (ShareGPT answers
come from ChatGPT) it sees features of text the target would not write, and learns from positions
the target never reaches at inference. EAGLE-3 and SpecForge therefore regenerate the answers with
the target: the first user turn (after any system turn) of each record is kept, the target
answers it, greedy by default (what a greedy user runs) or sampled with --temperature. With
`--turns N` the record's next user turns follow, each answered given the target's own earlier
answers (the record's original answers are dropped), until N turns, a truncated or empty answer,
or a user turn that is empty or longer than --max-prompt-tokens ends the conversation. Output:
jsonl records `{"messages": [..., {"role": "assistant", "content": <target's answer>}],
"truncated": <last answer cut by --max-new-tokens>}` that the trainer reads directly (a truncated
answer is rendered without its end-of-turn marker). Rows are batched by prompt length with left
padding; a conversation is written when it ends, and a run stopped by Ctrl-C or SIGTERM still
writes every answered turn.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from .data import check_chat_template, check_slice, load_records, slice_records, to_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def first_turn_prompt(messages: list[dict]) -> list[dict] | None:
    """System turn(s) and the first user turn, or None when the record has no user turn."""
    prompt = []
    for message in messages:
        prompt.append(message)
        if message["role"] == "user":
            return prompt if message["content"].strip() else None
    return None


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None
) -> list[tuple[str, bool]]:
    """(answer, truncated: cut by max_new_tokens) for each chat prompt of a batch, in order (a
    left-padding tokenizer). Greedy unless `sampling` says otherwise."""
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
    return list(zip(answers, truncated.tolist()))


def answer_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None
) -> list[dict]:
    """The target's answers to a batch of chat prompts as trainer records
    `{"messages": [*prompt, answer], "truncated": bool}`; empty answers are dropped."""
    return [
        {"messages": [*prompt, {"role": "assistant", "content": answer}], "truncated": cut}
        for prompt, (answer, cut) in zip(prompts, generate_answers(model, tokenizer, prompts, max_new_tokens, sampling))
        if answer.strip()
    ]


@dataclass
class Conversation:
    """A record being answered: `messages` ends with the user turn to answer next."""

    messages: list[dict]
    later_user_turns: list[dict]  # the record's user turns after that one, in order
    answered_turns: int = 0
    truncated: bool = False
    ended: bool = False  # written out, or dropped with no answer

    def record(self) -> dict:
        """The trainer record: the turns up to the last answer."""
        last_answer = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return {"messages": self.messages[: last_answer + 1], "truncated": self.truncated}


def _rendered_length(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _next_user_turn(conversation: Conversation, tokenizer, max_turn_tokens: int) -> bool:
    """Append the record's next user turn; False (nothing appended) when there is none, or it is
    empty, or it adds more than `max_turn_tokens` tokens to the prompt."""
    if not conversation.later_user_turns:
        return False
    turn = conversation.later_user_turns[0]
    if not turn["content"].strip():
        return False
    before = _rendered_length(tokenizer, conversation.messages, add_generation_prompt=False)
    if _rendered_length(tokenizer, [*conversation.messages, turn]) - before > max_turn_tokens:
        return False
    conversation.messages.append(conversation.later_user_turns.pop(0))
    return True


def answer_conversations(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], out: TextIO,
    turns: int, max_new_tokens: int, max_turn_tokens: int, batch_size: int, sampling: dict | None = None,
) -> None:
    """Answer up to `turns` user turns of each conversation, one turn of all of them at a time
    (rows batched by prompt length), writing each conversation to `out` (jsonl) when it ends."""
    from tqdm.auto import tqdm

    def end(conversation: Conversation) -> None:
        if conversation.answered_turns:
            out.write(json.dumps(conversation.record()) + "\n")
        conversation.ended = True

    live = conversations
    try:
        for turn in range(1, turns + 1):
            # similar lengths per batch: little padding
            live = sorted(live, key=lambda c: len(tokenizer.apply_chat_template(c.messages, tokenize=False)))
            next_live = []
            for begin in tqdm(range(0, len(live), batch_size), desc=f"regenerating turn {turn}/{turns}"):
                batch = live[begin : begin + batch_size]
                answers = generate_answers(model, tokenizer, [c.messages for c in batch], max_new_tokens, sampling)
                for conversation, (answer, cut) in zip(batch, answers):
                    if not answer.strip():  # nothing to teach here: the conversation ends before this turn
                        end(conversation)
                        continue
                    conversation.messages.append({"role": "assistant", "content": answer})
                    conversation.answered_turns += 1
                    conversation.truncated = cut
                    if not cut and turn < turns and _next_user_turn(conversation, tokenizer, max_turn_tokens):
                        next_live.append(conversation)
                    else:
                        end(conversation)
                out.flush()
            live = next_live
    finally:  # stopped early: keep every answered turn
        for conversation in conversations:
            if not conversation.ended:
                end(conversation)
        out.flush()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.trainers.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--data-split", default="train")
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--turns", type=int, default=1,
                        help="user turns answered per record, each given the target's own earlier answers")
    parser.add_argument("--skip-records", type=int, default=0, help="start after the first N records (the next slice)")
    parser.add_argument("--max-records", type=int, default=None)
    parser.add_argument("--min-prompt-tokens", type=int, default=1,
                        help="shorter first prompts are skipped: prompts are answered shortest first (in characters), "
                        "so a stopped run answered mostly short ones; this answers the longer rest of the same records "
                        "(a token bound: a few prompts near the cut may be answered again)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256,
                        help="longer first prompts are skipped; a later user turn that adds more tokens than this "
                        "ends its conversation")
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
    for name in ("turns", "min_prompt_tokens", "max_prompt_tokens", "max_new_tokens", "batch_size",
                 "num_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} is invalid; allowed: an integer >= 1")
    try:
        check_slice(args.skip_records, args.max_records)
    except ValueError as error:
        parser.error(str(error))
    if args.min_prompt_tokens > args.max_prompt_tokens:
        parser.error(f"--min-prompt-tokens={args.min_prompt_tokens} is invalid; allowed: at most "
                     f"--max-prompt-tokens={args.max_prompt_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature={args.temperature} is invalid; allowed: 0 (greedy) or a number > 0")
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
    try:
        records = slice_records(records, args.skip_records, args.max_records)
    except ValueError as error:
        parser.error(str(error))
    conversations = []
    for record in records:
        messages = to_messages(record)
        prompt = first_turn_prompt(messages)
        if prompt is None:
            continue
        if args.min_prompt_tokens <= _rendered_length(tokenizer, prompt) <= args.max_prompt_tokens:
            later = [m for m in messages[len(prompt) :] if m["role"] == "user"]
            conversations.append(Conversation(prompt, later))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    # SIGTERM (a scheduler's stop, `kill`) unwinds like Ctrl-C, so the answers so far are written
    # (only the main thread may set a handler; elsewhere SIGTERM keeps its default)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main_thread else None
    try:
        with open(output, "w") as out:
            answer_conversations(model, tokenizer, conversations, out, args.turns, args.max_new_tokens,
                                 args.max_prompt_tokens, args.batch_size, sampling)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    return output


if __name__ == "__main__":
    main()
