"""The EAGLE / EAGLE-3 trainer (`python -m hf_specdec.trainers.eagle`) on a tiny random target.

A few steps of each method must lower the loss and leave a folder the drafter loads (and
generate with it stays token-identical to plain generate); a run resumed from a checkpoint must
continue with exactly the loss the uninterrupted run had; the data pipeline must mask exactly the
assistant tokens; two processes under `accelerate launch` on CPU must train the same head as one;
bad input must fail with a clear error.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import EOS_TOKEN_ID, build_tiny_llama, left_padded_batch, plain_generate
from hf_specdec.trainers import eagle as trainer
from hf_specdec.trainers.data import load_records, to_messages, tokenize_conversation, tokenize_records
from safetensors.torch import load_file

import hf_specdec
from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head

# role markers are words of the tiny vocabulary: w3 = user, w4 = assistant, w5 = system
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ {'user': 'w3', 'assistant': 'w4', 'system': 'w5'}[m['role']] }} "
    "{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> w4 {% endif %}"
)


def _conversation(rng: random.Random, sharegpt: bool) -> dict:
    # the assistant repeats the user's words twice: structure a head can pick up
    words = [f"w{rng.randrange(10, 60)}" for _ in range(rng.randint(3, 8))]
    question, answer = " ".join(words), " ".join(words + words)
    if sharegpt:
        return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory, word_tokenizer):
    folder = tmp_path_factory.mktemp("target")
    model = build_tiny_llama(initializer_range=0.5)
    model.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    # both record shapes in one file would not load as one table: ShareGPT here, OpenAI in a test below
    path.write_text("\n".join(json.dumps(_conversation(rng, sharegpt=True)) for _ in range(64)) + "\n")
    return path


def _train(target_folder, data_file, output, *extra: str) -> list[dict]:
    args = [
        "--target", str(target_folder), "--data", str(data_file), "--output", str(output),
        "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "0",
        "--save-every", "0", "--report-to", "none", "--num-threads", "1", "--max-length", "64",
        "--eval-fraction", "0.1", *extra,
    ]
    trainer.main(args)
    return [json.loads(line) for line in (output / trainer.TRAIN_LOG).read_text().splitlines()]


def test_assistant_mask_covers_exactly_the_answers(word_tokenizer):
    word_tokenizer.chat_template = CHAT_TEMPLATE
    try:
        messages = to_messages(
            {"conversations": [{"from": "human", "value": "w10 w11"}, {"from": "gpt", "value": "w12 w13 w14"},
                               {"from": "human", "value": "w15"}, {"from": "gpt", "value": "w16"}]}
        )
        ids, mask = tokenize_conversation(word_tokenizer, messages, max_length=100)
    finally:
        word_tokenizer.chat_template = None
    trained = [word_tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    # the answers and the end-of-turn marker after each; never the user's words or role markers
    assert trained == ["w12", "w13", "w14", "</s>", "w16", "</s>"]
    assert ids[0] == word_tokenizer.bos_token_id and ids[-1] == EOS_TOKEN_ID

    # an answer cut off by a token limit (regenerated data): no end-of-turn marker is taught
    word_tokenizer.chat_template = CHAT_TEMPLATE
    try:
        ids, mask = tokenize_conversation(word_tokenizer, messages, max_length=100, open_ending=True)
    finally:
        word_tokenizer.chat_template = None
    trained = [word_tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    assert trained == ["w12", "w13", "w14", "</s>", "w16"]
    assert word_tokenizer.convert_ids_to_tokens(ids[-1]) == "w16"


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_training_lowers_loss_and_the_head_loads(target_folder, data_file, tmp_path, method):
    extra = ["--draft-vocab-size", "96", "--ttt-steps", "3"] if method == "eagle3" else []
    log = _train(target_folder, data_file, tmp_path, "--method", method, "--num-epochs", "6", *extra)
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 48  # 58 training records in batches of 8: 8 batches per epoch, 6 epochs
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    final = log[-1]
    assert 1.0 <= final["eval/simulated_tau"] <= 1.0 + (3 if method == "eagle3" else 1)

    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["steps"] == 48 and state["method"] == method
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point())
    assert "embed_tokens.weight" not in tensors  # borrowed from the target, never saved
    assert (tmp_path / "README.md").read_text().strip()

    model = hf_specdec.enable(build_tiny_llama(initializer_range=0.5))
    head = load_eagle_head(tmp_path, target=model, method=method)
    if method == "eagle3":
        assert head.head_config.draft_vocab_size == 96
    rng = random.Random(5)
    prompts = [[2, 3] + [rng.randrange(10, 60) for _ in range(rng.randint(3, 8))] + [1, 2, 4] for _ in range(3)]
    inputs = left_padded_batch(prompts)
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False)
    out = model.generate(
        **inputs, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
        speculative_config={"method": method, "model": str(tmp_path), "num_speculative_tokens": 3},
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_draft_tokens"] > 0


def test_resume_continues_exactly(target_folder, data_file, tmp_path):
    common = ["--method", "eagle3", "--draft-vocab-size", "96", "--ttt-steps", "2", "--max-steps", "5",
              "--save-every", "2", "--keep-checkpoints", "5"]
    full = _train(target_folder, data_file, tmp_path / "full", *common)
    # a run killed after its step-2 checkpoint and after logging step 3: what it leaves is the
    # checkpoint and the log so far
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_2", killed / "checkpoints" / "step_2")
    (killed / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full if r["step"] <= 3))
    resumed = _train(target_folder, data_file, killed, *common, "--resume")
    full_losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4, 5]  # step 3 logged once, by the resumed run
    resumed_losses = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    for step in (3, 4, 5):
        assert resumed_losses[step] == full_losses[step], (step, resumed_losses[step], full_losses[step])
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_init_from_continues_a_trained_head(target_folder, data_file, tmp_path):
    common = ["--method", "eagle3", "--ttt-steps", "2"]
    first = tmp_path / "first"
    first_log = _train(target_folder, data_file, first, *common, "--draft-vocab-size", "96", "--num-epochs", "4")
    trained = load_file(str(first / "model.safetensors"))
    # a near-zero learning rate: what comes out is what went in, so the run really started from it
    # (architecture and draft vocabulary included; a bf16 round trip hides a 1e-12 update)
    still = tmp_path / "still"
    still_log = _train(target_folder, data_file, still, *common, "--init-from", str(first), "--lr", "1e-12",
                       "--max-steps", "1", "--seed", "3")
    first_state, still_state = (json.loads((f / "trainer_state.json").read_text()) for f in (first, still))
    assert still_state["init_from"] == str(first)
    # another data order (--seed), the same held-out records: what the first run held out stays unseen
    assert still_state["held_out"] == first_state["held_out"]
    assert first_state["held_out"]["seed"] == 0 and first_state["held_out"]["records"] == 6
    assert f"(continuing the head {first})" in (still / "README.md").read_text()
    kept = load_file(str(still / "model.safetensors"))
    assert sorted(kept) == sorted(trained)
    assert all(torch.equal(kept[name], trained[name]) for name in trained)
    # its first loss is the trained head's, well below a random head's first loss
    assert still_log[0]["loss"] < 0.8 * first_log[0]["loss"]
    with pytest.raises(ValueError, match="--draft-vocab-size=64 does not match --init-from .* which has 96"):
        _train(target_folder, data_file, tmp_path / "bad", *common, "--init-from", str(first), "--draft-vocab-size", "64")
    with pytest.raises(ValueError, match="method"):
        _train(target_folder, data_file, tmp_path / "bad", "--method", "eagle", "--init-from", str(first))


@pytest.mark.parametrize("method, bias", [("eagle3", False), ("eagle", False), ("eagle3", True)])
def test_deepened_head_starts_as_the_trained_head_and_trains_its_new_layers(method, bias):
    # bias: a target whose attention / MLP projections have biases; the head's layers copy them
    target = build_tiny_llama(initializer_range=0.5, attention_bias=bias, mlp_bias=bias)
    head = EagleHead.for_target(target, method, draft_vocab=list(range(96)) if method == "eagle3" else None, seed=1)
    deeper = trainer.deepen_head(head, 3, target, seed=2)
    assert len(deeper.layers) == 3 and deeper.head_config.num_layers == 3 and head.head_config.num_layers == 1
    assert (deeper.layers[2].self_attn.o_proj.bias is not None) == bias == (deeper.layers[2].mlp.down_proj.bias is not None)
    features = torch.randn(2, 9, head.fc.in_features - (head.head_config.hidden_size if method == "eagle" else 0))
    input_ids, positions = torch.randint(5, 60, (2, 9)), torch.arange(9).expand(2, -1)
    out = deeper(input_ids, features, positions)
    assert torch.equal(out, head(input_ids, features, positions))
    deeper.compute_logits(out).logsumexp(-1).sum().backward()
    # the zeroed projections are where the new layers' gradient first arrives
    for layer in deeper.layers[1:]:
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0


def test_init_from_with_more_layers_continues_the_same_head(target_folder, data_file, tmp_path):
    common = ["--method", "eagle3", "--ttt-steps", "2", "--save-dtype", "float32"]
    first = tmp_path / "first"
    _train(target_folder, data_file, first, *common, "--draft-vocab-size", "96", "--num-epochs", "2")
    continued = _train(target_folder, data_file, tmp_path / "same", *common, "--init-from", str(first),
                       "--max-steps", "3", "--seed", "3")
    deeper = tmp_path / "deeper"
    deepened = _train(target_folder, data_file, deeper, *common, "--init-from", str(first), "--num-layers", "2",
                      "--max-steps", "3", "--seed", "3")
    # the first loss comes before any update: the added layer starts as the identity
    assert deepened[0]["loss"] == pytest.approx(continued[0]["loss"], rel=1e-5)
    assert deepened[2]["loss"] != continued[2]["loss"]  # and then it trains
    model = hf_specdec.enable(build_tiny_llama(initializer_range=0.5))
    assert load_eagle_head(deeper, target=model, method="eagle3").head_config.num_layers == 2
    inputs = left_padded_batch([[2, 3, 11, 12, 13, 1, 2, 4], [2, 3, 40, 41, 1, 2, 4]])
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False,
                         speculative_config={"method": "eagle3", "model": str(deeper), "num_speculative_tokens": 3})
    assert torch.equal(out, plain_generate(model, **inputs, max_new_tokens=16, do_sample=False))
    with pytest.raises(ValueError, match=r"--num-layers=1 is fewer than --init-from .* has \(2\); allowed: an integer >= 2"):
        _train(target_folder, data_file, tmp_path / "bad", *common, "--init-from", str(deeper), "--num-layers", "1")


def test_offline_hidden_states_cache(target_folder, data_file, tmp_path):
    cache = tmp_path / "cache"
    common = ["--method", "eagle3", "--draft-vocab-size", "96", "--ttt-steps", "2", "--num-epochs", "4",
              "--hidden-states-cache", str(cache)]
    log = _train(target_folder, data_file, tmp_path / "a", *common)
    shards = sorted(p.name for p in (cache / "train").glob("*.safetensors"))
    assert shards and (cache / "eval" / "fingerprint.json").is_file()
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
    # a second run reads the cache (no new shard) and, from the same cached states, trains identically
    again = _train(target_folder, data_file, tmp_path / "b", *common)
    assert sorted(p.name for p in (cache / "train").glob("*.safetensors")) == shards
    assert [r["loss"] for r in again if "loss" in r] == losses
    # states cached for other records are refused, not reused
    with pytest.raises(ValueError, match="hidden-states-cache .* was built for"):
        _train(target_folder, data_file, tmp_path / "c", *common, "--max-records", "40")
    # ... and so are states cached at another target precision
    with pytest.raises(ValueError, match="hidden-states-cache .* was built for"):
        _train(target_folder, data_file, tmp_path / "d", *common, "--target-precision", "bf16")


def test_target_forward_under_bf16_autocast_keeps_fp32_states():
    # --target-precision bf16: the matmuls run in bf16 (states differ from fp32's by bf16 rounding),
    # the residual stream and the captured states stay fp32, and the target's weights are untouched
    from hf_specdec.trainers.target_states import run_target

    torch.manual_seed(0)
    model = build_tiny_llama(initializer_range=0.5)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    full, half = run_target(model, input_ids, (0, 1)), run_target(model, input_ids, (0, 1), torch.bfloat16)
    assert half.features.dtype == half.final_hidden.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(half.final_hidden, full.final_hidden)
    for got, fp32 in ((half.final_hidden, full.final_hidden), (half.features, full.features)):
        assert (got - fp32).norm() < 0.05 * fp32.norm()  # bf16 rounding (2.6% here), not another computation


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_target_and_head_train(target_folder, data_file, tmp_path, precision):
    # target forward and head both under half-precision autocast (bf16: the fast path on AMX CPUs), weights in fp32
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate keeps one precision per process
    log = _train(target_folder, data_file, tmp_path / precision, "--method", "eagle3", "--draft-vocab-size", "96",
                 "--ttt-steps", "2", "--num-epochs", "4", "--target-precision", precision, "--mixed-precision", precision)
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
    assert (tmp_path / precision / "model.safetensors").is_file()
    AcceleratorState._reset_state(reset_partial_state=True)


def test_openai_messages_and_bad_input(target_folder, tmp_path, word_tokenizer, capsys):
    rng = random.Random(1)
    messages = tmp_path / "messages.jsonl"
    messages.write_text("\n".join(json.dumps(_conversation(rng, sharegpt=False)) for _ in range(16)))
    log = _train(target_folder, messages, tmp_path / "ok", "--method", "eagle", "--max-steps", "2")
    assert [r["step"] for r in log if "loss" in r] == [1, 2]

    # an empty conversation (real ShareGPT dumps hold some) teaches nothing: dropped, not an error
    with_empty = tmp_path / "with_empty.jsonl"
    with_empty.write_text(messages.read_text() + "\n" + json.dumps({"messages": []}) + "\n")
    assert [r["step"] for r in _train(target_folder, with_empty, tmp_path / "ok2", "--max-steps", "1") if "loss" in r] == [1]

    no_turns = tmp_path / "no_turns.jsonl"
    no_turns.write_text(json.dumps({"text": "w10 w11"}) + "\n")
    with pytest.raises(ValueError, match="neither 'conversations'.*'messages'.*fields are \\['text'\\]"):
        _train(target_folder, no_turns, tmp_path / "bad1")

    no_template = tmp_path / "no_template"
    shutil.copytree(target_folder, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in no_template.glob("chat_template.*"):
        extra.unlink()
    with pytest.raises(ValueError, match="no chat template"):
        _train(no_template, messages, tmp_path / "bad2")

    from transformers import BertConfig, BertLMHeadModel

    # a BERT decoder keeps its layers inside bert.encoder.layer: no decoder layer list to read features at
    bert = tmp_path / "bert"
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, is_decoder=True)
    BertLMHeadModel(config).save_pretrained(bert)
    word_tokenizer.save_pretrained(bert)
    shutil.copy(target_folder / "tokenizer_config.json", bert / "tokenizer_config.json")
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        _train(bert, messages, tmp_path / "bad3")

    base = ["--target", "x", "--data", "y", "--output", "z"]
    for bad, field in ((["--method", "medusa"], "--method"), (["--ttt-steps", "0"], "--ttt-steps"),
                       (["--lr", "0"], "--lr"), (["--max-steps", "0"], "--max-steps"),
                       (["--save-every", "-1"], "--save-every"), (["--step-weight", "-0.5"], "--step-weight"),
                       (["--eval-seed", "-1"], "--eval-seed"),
                       (["--draft-vocab-size", "0"], "--draft-vocab-size"),
                       (["--method", "eagle", "--draft-vocab-size", "64"], "--draft-vocab-size")):
        with pytest.raises(SystemExit):
            trainer.parse_args(base + bad)
        assert field in capsys.readouterr().err
    from hf_specdec.trainers import regenerate

    for bad, field in ((["--batch-size", "0"], "--batch-size"), (["--temperature", "-1"], "--temperature"),
                       (["--skip-records", "-1"], "--skip-records"), (["--min-prompt-tokens", "0"], "--min-prompt-tokens"),
                       (["--min-prompt-tokens", "300"], "--min-prompt-tokens"), (["--turns", "0"], "--turns")):
        with pytest.raises(SystemExit):
            regenerate.main(["--target", "x", "--data", "y", "--output", "z", *bad])
        assert field in capsys.readouterr().err


def test_two_processes_train_the_same_head(target_folder, data_file, tmp_path):
    common = ["--method", "eagle3", "--draft-vocab-size", "96", "--ttt-steps", "2", "--max-steps", "3"]
    _train(target_folder, data_file, tmp_path / "one", *common)
    # `--cpu` would start ONE process (Accelerate's simple launcher): two gloo processes need
    # --multi_gpu with ACCELERATE_USE_CPU
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "ACCELERATE_USE_CPU": "true"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_specdec.trainers.eagle",
        "--target", str(target_folder), "--data", str(data_file), "--output", str(tmp_path / "two"),
        "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "0", "--save-every", "0",
        "--report-to", "none", "--num-threads", "1", "--max-length", "64", "--eval-fraction", "0.1", *common,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    states = [json.loads((tmp_path / run / "trainer_state.json").read_text()) for run in ("one", "two")]
    assert [state["num_processes"] for state in states] == [1, 2]
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert one.keys() == two.keys()
    for name in one:
        # saved in bf16: equal up to one bf16 rounding step of fp32 noise
        torch.testing.assert_close(one[name].float(), two[name].float(), rtol=1e-2, atol=1e-2, msg=name)
    one_log = [json.loads(x) for x in (tmp_path / "one" / trainer.TRAIN_LOG).read_text().splitlines()]
    two_log = [json.loads(x) for x in (tmp_path / "two" / trainer.TRAIN_LOG).read_text().splitlines()]
    one_losses, two_losses = ([r["loss"] for r in log if "loss" in r] for log in (one_log, two_log))
    assert len(one_losses) == len(two_losses) == 3
    for a, b in zip(one_losses, two_losses):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a))
    # the learning rate followed the same schedule: one scheduler step per optimizer step
    assert [r["lr"] for r in one_log if "lr" in r] == [r["lr"] for r in two_log if "lr" in r]


def test_regenerated_answers_are_the_targets_greedy_output(target_folder, data_file, tmp_path):
    from hf_specdec.trainers import regenerate
    from transformers import AutoTokenizer

    output = regenerate.main([
        "--target", str(target_folder), "--data", str(data_file), "--output", str(tmp_path / "regen.jsonl"),
        "--max-records", "5", "--max-new-tokens", "6", "--batch-size", "2", "--num-threads", "1",
    ])
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 5
    model = build_tiny_llama(initializer_range=0.5)
    tokenizer = AutoTokenizer.from_pretrained(target_folder, padding_side="left")
    for record in records:
        user, assistant = record["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
        greedy = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = tokenizer.decode(greedy[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        assert assistant["content"] == expected
        assert record["truncated"] == (EOS_TOKEN_ID not in greedy[0, inputs.input_ids.shape[1] :].tolist())
    # the trainer reads what regenerate writes, and teaches no end of turn after a truncated answer
    # (this tokenizer decodes words fused, so each answer re-tokenizes to one token)
    data = tokenize_records(load_records(output), tokenizer, max_length=64, min_loss_tokens=1)
    assert len(data) == len(records)
    for record, ids, mask in zip(records, data.input_ids, data.loss_masks):
        assert (ids[-1] == EOS_TOKEN_ID) == (not record["truncated"])
        assert mask[-1] == 1


def test_regenerate_in_bf16_gives_the_bf16_targets_greedy_answers(target_folder, data_file, tmp_path, monkeypatch):
    from hf_specdec.trainers import regenerate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded_dtypes = []
    load = AutoModelForCausalLM.from_pretrained

    def spying_load(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded_dtypes.append(model.dtype)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spying_load)
    output = regenerate.main([
        "--target", str(target_folder), "--data", str(data_file), "--output", str(tmp_path / "regen.jsonl"),
        "--max-records", "3", "--max-new-tokens", "6", "--batch-size", "1", "--num-threads", "1", "--dtype", "bfloat16",
    ])
    assert loaded_dtypes == [torch.bfloat16]  # the answers come from the bf16 target
    model = load(target_folder, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_folder, padding_side="left")
    for line in output.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
        greedy = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert assistant["content"] == tokenizer.decode(greedy[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


def test_regenerate_skip_records_takes_the_next_slice(target_folder, data_file, tmp_path, capsys):
    from hf_specdec.trainers import regenerate

    def user_turns(*args):
        output = regenerate.main([
            "--target", str(target_folder), "--data", str(data_file), "--output", str(tmp_path / "regen.jsonl"),
            "--max-new-tokens", "2", "--num-threads", "1", *args,
        ])
        return sorted(json.loads(line)["messages"][0]["content"] for line in output.read_text().splitlines())

    first_five = user_turns("--max-records", "5")
    first_two, next_three = user_turns("--max-records", "2"), user_turns("--skip-records", "2", "--max-records", "3")
    assert len(first_two) == 2 and len(next_three) == 3
    assert sorted(first_two + next_three) == first_five
    with pytest.raises(SystemExit):  # past the end: an error, not an empty file
        user_turns("--skip-records", str(len(load_records(data_file))))
    assert "--skip-records" in capsys.readouterr().err


def test_regenerate_min_prompt_tokens_answers_the_longer_prompts(target_folder, data_file, tmp_path):
    from hf_specdec.trainers import regenerate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_folder)

    def prompt_lengths(*args):
        output = regenerate.main([
            "--target", str(target_folder), "--data", str(data_file), "--output", str(tmp_path / "regen.jsonl"),
            "--max-records", "12", "--max-new-tokens", "2", "--num-threads", "1", *args,
        ])
        prompts = [json.loads(line)["messages"][:-1] for line in output.read_text().splitlines()]
        return sorted(
            len(tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False).input_ids)
            for p in prompts
        )

    every = prompt_lengths()
    threshold = every[len(every) // 2]
    assert every[0] < threshold  # the split below is not trivial
    shorter, longer = prompt_lengths("--max-prompt-tokens", str(threshold - 1)), prompt_lengths(
        "--min-prompt-tokens", str(threshold))
    assert shorter and all(n < threshold for n in shorter)
    assert longer and all(n >= threshold for n in longer)
    assert sorted(shorter + longer) == every  # together: the same records, none lost or answered twice


def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch):
    from types import SimpleNamespace

    printed = []
    accelerator = SimpleNamespace(device=torch.device("cpu"), print=printed.append)
    args = SimpleNamespace(mixed_precision="no", target_precision="bf16")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    trainer._warn_if_emulated_bf16(accelerator, args)
    assert len(printed) == 1 and "--target-precision bf16" in printed[0]
    args.target_precision = "fp32"
    trainer._warn_if_emulated_bf16(accelerator, args)
    assert len(printed) == 1


@pytest.fixture(scope="module")
def multi_turn_file(tmp_path_factory):
    rng = random.Random(1)
    records = []
    for _ in range(24):
        turns = []
        for _ in range(rng.randint(1, 3)):  # user, assistant pairs
            turns += _conversation(rng, sharegpt=True)["conversations"]
        records.append({"conversations": turns})
    path = tmp_path_factory.mktemp("data") / "multi_turn.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_regenerate_turns_answers_later_turns_given_the_targets_own_answers(target_folder, multi_turn_file, tmp_path):
    from hf_specdec.trainers import regenerate
    from transformers import AutoTokenizer

    output = regenerate.main([
        "--target", str(target_folder), "--data", str(multi_turn_file), "--output", str(tmp_path / "regen.jsonl"),
        "--turns", "2", "--max-new-tokens", "12", "--batch-size", "3", "--num-threads", "1",
    ])
    written = [json.loads(line) for line in output.read_text().splitlines()]
    sources = [to_messages(r) for r in load_records(multi_turn_file)]
    model = build_tiny_llama(initializer_range=0.5)
    tokenizer = AutoTokenizer.from_pretrained(target_folder, padding_side="left")
    seen = set()
    for record in written:
        messages = record["messages"]
        # the record it came from: the same user turns, in order, its answers replaced
        users = [m["content"] for m in messages if m["role"] == "user"]
        matches = [i for i, s in enumerate(sources) if [m["content"] for m in s if m["role"] == "user"][: len(users)] == users]
        assert len(matches) == 1 and matches[0] not in seen
        seen.add(matches[0])
        assert [m["role"] for m in messages] == ["user", "assistant"] * len(users) and len(users) <= 2
        cuts = []
        for j in range(1, len(messages), 2):
            prompt = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True)
            inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
            new = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, inputs.input_ids.shape[1] :]
            assert messages[j]["content"] == tokenizer.decode(new, skip_special_tokens=True)
            cuts.append(EOS_TOKEN_ID not in new.tolist())
        assert record["truncated"] == cuts[-1]
        # a conversation stops early only after a cut answer, or where its record has no next user turn
        source_users = sum(m["role"] == "user" for m in sources[matches[0]])
        if len(users) == 1:
            assert cuts[0] or source_users == 1
    assert len(written) == len(sources)  # no answer here is empty: every record gives a conversation
    turn_counts = [len(r["messages"]) // 2 for r in written]
    assert 1 in turn_counts and 2 in turn_counts  # both endings happen in this data


def test_regenerate_stopped_midway_keeps_every_answered_turn(target_folder, multi_turn_file, tmp_path, monkeypatch):
    from hf_specdec.trainers import regenerate

    def stopped_on_the_second_turn(model, tokenizer, prompts, *args):
        if any(sum(m["role"] == "user" for m in p) == 2 for p in prompts):
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop: regenerate unwinds as from Ctrl-C
        return [("w10 w11", False) for _ in prompts]  # an answer that ended: the conversation goes on

    monkeypatch.setattr(regenerate, "generate_answers", stopped_on_the_second_turn)
    output = tmp_path / "regen.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate.main(["--target", str(target_folder), "--data", str(multi_turn_file), "--output", str(output),
                         "--turns", "3", "--batch-size", "4", "--num-threads", "1"])
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(written) == len(load_records(multi_turn_file))  # every first turn was answered
    for record in written:
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert record["messages"][1]["content"] == "w10 w11" and not record["truncated"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back


@pytest.fixture(scope="module")
def gpt_neox_folder(tmp_path_factory, word_tokenizer):
    """A non-Llama target: GPT-NeoX (parallel attention / MLP, partial rotary, LayerNorm, its layers
    under gpt_neox.layers and its final norm named final_layer_norm), with the word tokenizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    folder = tmp_path_factory.mktemp("gpt_neox_target")
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        rotary_pct=0.5, max_position_embeddings=512, pad_token_id=0, eos_token_id=EOS_TOKEN_ID, bos_token_id=2,
        initializer_range=0.5,
    )
    GPTNeoXForCausalLM(config).eval().save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def test_trainer_on_a_non_llama_target(gpt_neox_folder, data_file, tmp_path):
    """EAGLE-3 trained for a GPT-NeoX target: the loss falls, the head loads and speculates identically."""
    from transformers import AutoModelForCausalLM

    log = _train(gpt_neox_folder, data_file, tmp_path, "--method", "eagle3", "--num-epochs", "6",
                 "--draft-vocab-size", "96", "--ttt-steps", "2")
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    model = hf_specdec.enable(AutoModelForCausalLM.from_pretrained(gpt_neox_folder).eval())
    head = load_eagle_head(tmp_path, target=model, method="eagle3")
    assert head.head_config.target_hidden_size == 64
    rng = random.Random(5)
    prompts = [[2, 3] + [rng.randrange(10, 60) for _ in range(rng.randint(3, 8))] + [1, 2, 4] for _ in range(3)]
    inputs = left_padded_batch(prompts)
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False)
    out = model.generate(
        **inputs, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
        speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3},
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_draft_tokens"] > 0
