"""`python -m hf_specdec.trainers.user_turns`: user turns of a conversation dataset as one-turn
prompts for `regenerate` (filters, order, the file it writes) and `--data sharegpt`."""

from __future__ import annotations

import json

import pytest
from hf_specdec.trainers import user_turns
from hf_specdec.trainers.data import load_records, to_messages
from hf_specdec.trainers.regenerate import first_turn_prompt

LONG = " and what it costs, step by step, for a team of five people"  # pads a turn past 60 characters


def _record(*user_turns: str, system: str | None = None) -> dict:
    turns = [{"from": "system", "value": system}] if system else []
    for turn in user_turns:
        turns += [{"from": "human", "value": turn}, {"from": "gpt", "value": "an answer"}]
    return {"conversations": turns}


RECORDS = [
    _record("Plan a trip to Rome" + LONG, "Write a Python function that parses dates" + LONG, system="be brief"),
    _record("Explain how a heat pump works" + LONG, "It should be shorter" + LONG, "items to pack for a hike" + LONG),
    _record("Write a Python function that parses dates" + LONG, "Plan a trip to Rome" + LONG, "too short"),
    _record("Continue the story" + LONG, "  Summarise the French revolution" + LONG + "  ", "Thanks! Now a haiku" + LONG),
    _record("Summarise the French revolution" + LONG + "", "What is a monad in Haskell code" + LONG),
]


def test_later_turns_drop_short_repeated_first_and_back_pointing_turns():
    selected = user_turns.select_user_turns(RECORDS, "later")
    assert selected == [
        # record 0's "Write a Python function ..." is record 2's first turn: answered already
        "items to pack for a hike" + LONG,  # "items" is not the opening "it": whole words only
        "What is a monad in Haskell code" + LONG,
    ]
    # stripped before comparing: record 3's padded turn equals record 4's first turn
    assert "Summarise the French revolution" + LONG not in selected


def test_first_and_all_turns_and_the_filters_that_can_be_turned_off():
    first = user_turns.select_user_turns(RECORDS, "first")
    assert first == [m[0] + LONG for m in (["Plan a trip to Rome"], ["Explain how a heat pump works"],
                                           ["Write a Python function that parses dates"],
                                           ["Summarise the French revolution"])]  # "Continue ..." points back
    everything = user_turns.select_user_turns(RECORDS, "all", min_chars=0, skip_openings=[])
    assert len(everything) == len({t.strip() for r in RECORDS for t in
                                   (m["content"] for m in to_messages(r) if m["role"] == "user")})
    assert "too short" in everything and "It should be shorter" + LONG in everything
    code = user_turns.select_user_turns(RECORDS, "all", match=r"\bpython\b|\bcode\b")
    assert code == ["Write a Python function that parses dates" + LONG, "What is a monad in Haskell code" + LONG]


def test_openai_records_and_bad_values():
    messages = {"messages": [{"role": "user", "content": "Describe the water cycle" + LONG},
                             {"role": "assistant", "content": "..."},
                             {"role": "user", "content": "Describe the carbon cycle" + LONG}]}
    assert user_turns.select_user_turns([messages], "later") == ["Describe the carbon cycle" + LONG]
    with pytest.raises(ValueError, match="--turns='second' is invalid; allowed: first, later, all"):
        user_turns.select_user_turns(RECORDS, "second")
    with pytest.raises(ValueError, match="--min-chars=-1 is invalid"):
        user_turns.select_user_turns(RECORDS, min_chars=-1)
    with pytest.raises(ValueError, match=r"--match='\(code' is not a regular expression"):
        user_turns.select_user_turns(RECORDS, match="(code")
    with pytest.raises(ValueError, match="neither 'conversations'"):
        user_turns.select_user_turns([{"text": "no turns here"}])


@pytest.fixture
def conversations_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_the_written_prompts_are_what_regenerate_answers(conversations_file, tmp_path):
    output = user_turns.main(["--data", str(conversations_file), "--output", str(tmp_path / "later.jsonl")])
    records = load_records(output)
    prompts = [first_turn_prompt(to_messages(r)) for r in records]
    assert [p[0]["content"] for p in prompts] == user_turns.select_user_turns(RECORDS, "later")
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)


def test_shuffle_is_a_seeded_permutation_and_slices_still_know_every_first_turn(conversations_file, tmp_path):
    def run(*extra: str) -> list[str]:
        output = user_turns.main(["--data", str(conversations_file), "--output", str(tmp_path / "out.jsonl"),
                                  "--turns", "all", *extra])
        return [json.loads(line)["conversations"][0]["value"] for line in output.read_text().splitlines()]

    in_order = run()
    shuffled = run("--shuffle-seed", "3")
    assert shuffled != in_order and sorted(shuffled) == sorted(in_order)
    assert run("--shuffle-seed", "3") == shuffled
    # records 0-1 only: the turns are theirs ...
    assert run("--max-records", "2") == [t for t in in_order if any(
        t == m["content"].strip() for r in RECORDS[:2] for m in to_messages(r))]
    # ... and record 0's later turn is still dropped as a first turn of record 2, outside the slice
    later_of_first_two = user_turns.main(["--data", str(conversations_file), "--output", str(tmp_path / "l.jsonl"),
                                          "--max-records", "2"]).read_text()
    assert "parses dates" not in later_of_first_two and "items to pack" in later_of_first_two
    assert run("--skip-records", "4") == ["Summarise the French revolution" + LONG,
                                          "What is a monad in Haskell code" + LONG]


@pytest.mark.parametrize("bad, message", [
    (["--match", "(code"], "--match='(code' is not a regular expression"),
    (["--min-chars", "-5"], "--min-chars=-5 is invalid"),
    (["--skip-records", "5"], "--skip-records=5 is invalid; allowed: fewer than the 5 records"),
    (["--max-records", "0"], "--max-records=0 is invalid; allowed: an integer >= 1"),
    (["--min-chars", "1000"], "no user turn of --data passes"),
    (["--turns", "second"], "invalid choice: 'second'"),
    (["--shuffle-seed", "-1"], "--shuffle-seed=-1 is invalid; allowed: an integer >= 0"),
])
def test_bad_arguments_name_the_flag(conversations_file, tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit):
        user_turns.main(["--data", str(conversations_file), "--output", str(tmp_path / "x.jsonl"), *bad])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_sharegpt_jsonl_is_written_once_whole(tmp_path, monkeypatch):
    from hf_specdec.models import real_models

    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(real_models, "sharegpt_conversations", lambda: RECORDS)
    # another process's unfinished partial file is neither read nor clobbered
    (tmp_path / "sharegpt.jsonl.12345.partial").write_text("{\"conversations\": [")
    path = real_models.sharegpt_jsonl()
    assert [json.loads(line) for line in path.read_text().splitlines()] == RECORDS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharegpt.jsonl", "sharegpt.jsonl.12345.partial"]
    monkeypatch.setattr(real_models, "sharegpt_conversations", lambda: pytest.fail("written twice"))
    assert real_models.sharegpt_jsonl() == path
    assert [to_messages(r) for r in load_records("sharegpt")] == [to_messages(r) for r in RECORDS]


@pytest.mark.slow
def test_data_sharegpt_reads_the_wheels_conversations():
    from hf_specdec.models.real_models import sharegpt_conversations

    records = load_records("sharegpt")
    wheel = sharegpt_conversations()
    assert len(records) == len(wheel) == 17671
    for i in (0, 1234, len(wheel) - 1):
        assert to_messages(records[i]) == to_messages(wheel[i])
