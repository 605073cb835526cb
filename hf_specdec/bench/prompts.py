"""Benchmark prompts: MT-bench, HumanEval (from their PyPI wheels) or a jsonl file, as chat prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.real_models import bfcl_prompts, humaneval_prompts, mtbench_prompts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_SETS = {"mt-bench": mtbench_prompts, "humaneval": humaneval_prompts, "bfcl": bfcl_prompts}


def load_prompts(source: str, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[str]:
    """Prompt strings ready to tokenize.

    `source`: "mt-bench" (first turns), "humaneval", "bfcl" (function calling), or a jsonl file whose records have a "prompt"
    (a user message) or a "messages" field (a chat: [{"role", "content"}, ...]). Every prompt is
    rendered with the tokenizer's chat template (generation prompt added); a tokenizer without
    one takes "prompt" text as is and refuses "messages".
    """
    if source in PROMPT_SETS:
        return PROMPT_SETS[source](tokenizer, limit=limit)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompts={source!r} is neither {' nor '.join(PROMPT_SETS)} nor a jsonl file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if limit is not None and len(prompts) == limit:
            break
        if line.strip():
            prompts.append(_render(tokenizer, _record(line, f"{path}:{number}"), f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"prompts={source!r} holds no records")
    return prompts


def _record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from error
    if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
        raise ValueError(f'{where}: each record needs a "prompt" or a "messages" field')
    return record


def _render(tokenizer, record: dict, where: str) -> str:
    messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
    if tokenizer.chat_template is None:
        if "messages" in record:
            raise ValueError(f'{where}: "messages" need a tokenizer with a chat template')
        return record["prompt"]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
