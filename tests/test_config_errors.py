"""SpeculativeConfig validation, and generate() inputs speculative decoding refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import left_padded_batch, ngram_config, repeated_span_batch
from transformers import RwkvConfig, RwkvForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig

INVALID = [
    # (keyword arguments, field the message must name, another fragment of the message)
    ({"method": "medusa"}, "method", "ngram"),
    ({"method": None}, "method", "allowed"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", "1 to 32"),
    ({"num_speculative_tokens": 33}, "num_speculative_tokens", "1 to 32"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens", "1 to 32"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens", "integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens", "integer"),
    ({"num_speculative_tokens": "5"}, "num_speculative_tokens", "integer"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min", "prompt_lookup_max"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min", ">= 1"),
    ({"prompt_lookup_min": 0, "prompt_lookup_max": 3}, "prompt_lookup_min", ">= 1"),
    ({"prompt_lookup_min": 1.5, "prompt_lookup_max": 3}, "prompt_lookup_min", "integer"),
    ({"prompt_lookup_min": True, "prompt_lookup_max": 3}, "prompt_lookup_min", "integer"),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": -2}, "prompt_lookup_max", ">= 1"),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": "4"}, "prompt_lookup_max", "integer"),
    ({"prompt_lookup_max": 5, "prompt_lookup_min": 6}, "prompt_lookup_min", "prompt_lookup_max"),
    ({"tree": {"num_nodes": 0}}, "tree.num_nodes", "1 to 256"),
    ({"tree": {"num_nodes": 257}}, "tree.num_nodes", "1 to 256"),
    ({"tree": {"num_nodes": 8, "topk": 17}}, "tree.topk", "1 to 16"),
    ({"tree": {"num_nodes": 8, "depth": 6}}, "tree.depth", "num_speculative_tokens"),
    ({"tree": {"num_nodes": 8, "width": 2}}, "tree", "unknown keys"),
    ({"tree": {"static": [[0], [0, 1, 0]]}}, "tree.static", "not a tree"),
    ({"tree": {"static": [[0], [0]]}}, "tree.static", "twice"),
    ({"tree": {"static": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]}},
     "tree.static", "deep"),
    ({"tree": {"static": [[-1]]}}, "tree.static", "ranks"),
    ({"tree": 8}, "tree", "allowed"),
    ({"method": "suffix", "tree": {"num_nodes": 8}}, "tree", "ngram, eagle, eagle3, draft_model"),
    ({"num_speculative_tokens": "auto", "tree": {"num_nodes": 8}}, "tree", "fixed num_speculative_tokens"),
    ({"rejection_sample_method": "block", "tree": {"num_nodes": 8}}, "tree", "rejection_sample_method"),
    ({"method": "eagle"}, "model", "eagle"),
    ({"method": "eagle3"}, "model", "eagle3"),
    ({"method": "draft_model"}, "model", "draft_model"),
    ({"method": "ngram", "model": "some/drafter"}, "model", "ngram"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size", ">= 1"),
    ({"disable_by_batch_size": 1.5}, "disable_by_batch_size", "integer"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"seed": "7"}, "seed", "integer"),
    ({"block_size": 0}, "block_size", ">= 1"),
    ({"block_size": False}, "block_size", "integer"),
    ({"num_kv_blocks": 0}, "num_kv_blocks", ">= 1"),
]


@pytest.mark.parametrize(
    "kwargs,field,fragment", INVALID, ids=[f"{c[1]}={list(c[0].values())}" for c in INVALID]
)
def test_invalid_config_names_the_field(kwargs, field, fragment):
    for build in (
        lambda: SpeculativeConfig(**kwargs),
        lambda: SpeculativeConfig.from_any(kwargs),
        lambda: SpeculativeConfig.from_any(**kwargs),
    ):
        with pytest.raises(ValueError) as info:
            build()
        message = str(info.value)
        assert f"speculative_config.{field}" in message, message
        assert fragment in message, message


@pytest.mark.parametrize("value", [0, -3, True, "4"])
def test_prompt_lookup_max_alone_invalid_names_prompt_lookup_max(value):
    """Only prompt_lookup_max is given (and bad): the message must name the field the user set."""
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_max="):
        SpeculativeConfig(prompt_lookup_max=value)


@pytest.mark.parametrize(
    "value,fragment",
    [
        ({"method": "ngram", "k": 3}, "unknown keys ['k']"),
        ({"num_speculative_tokens": 3, "lookahead": 2, "draft": "x"}, "unknown keys ['draft', 'lookahead']"),
        ('{"method": "ngram", "num_spec_tokens": 3}', "unknown keys ['num_spec_tokens']"),
    ],
)
def test_unknown_keys(value, fragment):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_any(value)
    assert fragment in str(info.value)
    assert "num_speculative_tokens" in str(info.value)  # lists what is allowed


def test_unknown_keyword_argument():
    with pytest.raises(ValueError, match=r"unknown keys \['speculative_tokens'\]"):
        SpeculativeConfig.from_any(speculative_tokens=3)


@pytest.mark.parametrize("text", ['{"method": "ngram",', "ngram", "{'method': 'ngram'}", ""])
def test_invalid_json(text):
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        SpeculativeConfig.from_any(text)


@pytest.mark.parametrize("value", [["ngram", 5], ("ngram",), 5, 2.0, b'{"method": "ngram"}'])
def test_wrong_type(value):
    with pytest.raises(
        ValueError, match=r"speculative_config must be a SpeculativeConfig, a dict or a JSON string"
    ):
        SpeculativeConfig.from_any(value)


def test_json_string_that_is_not_an_object():
    with pytest.raises(ValueError, match="got list"):
        SpeculativeConfig.from_any("[1, 2]")


def test_valid_forms_are_equal():
    expected = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
    )
    as_dict = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert SpeculativeConfig.from_any(as_dict) == expected
    assert SpeculativeConfig.from_any(json.dumps(as_dict)) == expected
    assert SpeculativeConfig.from_any(expected) is expected
    assert SpeculativeConfig.from_any(**as_dict) == expected
    assert (
        SpeculativeConfig.from_any(
            {"method": "ngram"}, num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
        )
        == expected
    )
    # keyword arguments override the dict / the config
    assert (
        SpeculativeConfig.from_any({**as_dict, "num_speculative_tokens": 9}, num_speculative_tokens=3)
        == expected
    )
    replaced = SpeculativeConfig.from_any(expected, num_speculative_tokens=7)
    assert replaced.num_speculative_tokens == 7 and expected.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_any(expected, num_speculative_tokens=0)
    assert SpeculativeConfig.from_any(None) == SpeculativeConfig()
    assert SpeculativeConfig.from_any() == SpeculativeConfig()
    assert expected.to_dict()["num_speculative_tokens"] == 3


def test_defaults_and_lookup_fill_in():
    default = SpeculativeConfig()
    assert default.method == "ngram" and default.num_speculative_tokens == 5
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (1, 4)
    only_min = SpeculativeConfig(prompt_lookup_min=3)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    only_max = SpeculativeConfig(prompt_lookup_max=2)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (2, 2)
    for k in (1, 32):
        assert SpeculativeConfig(num_speculative_tokens=k).num_speculative_tokens == k
    assert SpeculativeConfig(method="eagle", model="org/eagle-head").model == "org/eagle-head"
    assert SpeculativeConfig(method="mtp").model is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.num_speculative_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "value", [{"method": "ngram", "num_speculative_tokens": 0}, '{"method": "nope"}', [1]]
)
def test_generate_validates_the_config(enabled_llama, value):
    with pytest.raises(ValueError, match="speculative_config"):
        enabled_llama.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=value)


# --- generate() inputs -------------------------------------------------------------------------


def test_beam_search_rejected(enabled_llama):
    with pytest.raises(ValueError, match="num_beams=2"):
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=4,
            num_beams=2,
            do_sample=False,
            speculative_config=ngram_config(),
        )


def test_right_padding_rejected(enabled_llama):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    left = left_padded_batch(prompts)
    right_ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    right_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        enabled_llama.generate(
            input_ids=right_ids,
            attention_mask=right_mask,
            max_new_tokens=4,
            speculative_config=ngram_config(),
        )
    # a hole in the middle is not left padding either
    with pytest.raises(ValueError, match="left padding"):
        enabled_llama.generate(
            input_ids=left["input_ids"],
            attention_mask=torch.tensor([[1, 1, 0, 1, 1], [0, 0, 1, 1, 1]]),
            max_new_tokens=4,
            speculative_config=ngram_config(),
        )
    # the same prompts left-padded are fine
    enabled_llama.generate(**left, max_new_tokens=4, speculative_config=ngram_config())


def test_all_padding_row_rejected(enabled_llama):
    inputs = {
        "input_ids": torch.tensor([[0, 0, 0], [4, 5, 6]]),
        "attention_mask": torch.tensor([[0, 0, 0], [1, 1, 1]]),
    }
    with pytest.raises(ValueError, match="at least one token"):
        enabled_llama.generate(**inputs, max_new_tokens=4, speculative_config=ngram_config())


def test_unsupported_model_type():
    """A model we cannot run exactly (RWKV keeps a cache class of its own, with no rollback) is refused
    naming its model type and why; plain generate() still works on it."""
    torch.manual_seed(0)
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32)).eval()
    hf_specdec.enable(rwkv)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 5, 6]])}
    with pytest.raises(ValueError, match="model_type='rwkv' is not supported: it keeps its own cache class"):
        rwkv.generate(**inputs, max_new_tokens=4, speculative_config=ngram_config())
    assert rwkv.generate(**inputs, max_new_tokens=4, do_sample=False).shape == (1, 9)


def test_eagle_head_not_found(enabled_llama, tmp_path, monkeypatch):
    """An EAGLE head that is neither a folder nor in the (offline) Hub cache: ValueError naming it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="some/eagle-head"):
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=4,
            speculative_config={"method": "eagle", "model": "some/eagle-head", "num_speculative_tokens": 3},
        )


def test_inputs_embeds_rejected(enabled_llama):
    inputs = repeated_span_batch(1)
    embeds = enabled_llama.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(ValueError, match="inputs_embeds"):
        enabled_llama.generate(
            inputs_embeds=embeds,
            attention_mask=inputs["attention_mask"],
            max_new_tokens=4,
            speculative_config=ngram_config(),
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dola_layers": "low"}, "dola_layers='low' asks for DoLa decoding"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6 asks for contrastive search"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions=True: .* not attentions"),
        ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states=True: .* hidden states"),
    ],
)
def test_options_the_loop_would_ignore_are_refused(enabled_llama, options, message):
    """Other decoding strategies and per-step outputs the loop does not produce: refused, not ignored."""
    with pytest.raises(ValueError, match=message):
        enabled_llama.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=ngram_config(), **options)


@pytest.mark.parametrize("bad", ["longer", "float", "3-D"])
def test_position_ids_of_the_wrong_shape_or_type_are_refused(enabled_llama, bad):
    inputs = repeated_span_batch(1)
    width = inputs["input_ids"].shape[1]
    positions = {"longer": torch.arange(width + 2)[None], "float": torch.arange(width)[None] * 1.0,
                 "3-D": torch.arange(width)[None, None]}[bad]  # fmt: skip
    with pytest.raises(ValueError, match=rf"position_ids must be integers of shape \[1, {width}\]"):
        enabled_llama.generate(**inputs, position_ids=positions, max_new_tokens=4, speculative_config=ngram_config())


def test_token_healing_refused_with_what_to_do(enabled_llama):
    with pytest.raises(ValueError, match=r"token_healing is not supported .* model.heal_tokens\(input_ids, tokenizer\)"):
        enabled_llama.generate(**repeated_span_batch(1), max_new_tokens=4, token_healing=True, speculative_config=ngram_config())


def test_transformers_assisted_generation_not_combined(enabled_llama):
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=4,
            prompt_lookup_num_tokens=3,
            speculative_config=ngram_config(),
        )
