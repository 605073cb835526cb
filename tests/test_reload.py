"""Drafters named by a folder are cached per target, and read again when the folder changes.

The notebook case of issue 38: generate with a head (or draft model, or the target's MTP layers),
write the same folder again (retrained weights, or a broken config), generate again. The second
call must draft with what is on disk now, or fail on it, never silently reuse the first module;
while the folder is unchanged it is loaded once.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama, plain_generate, repeated_span_batch
from safetensors.torch import load_file, save_file
from test_draft_model import perturbed_copy
from test_eagle import random_head

import hf_specdec
from hf_specdec.drafters import DraftModelProposer, draft_model, eagle, on_disk
from hf_specdec.drafters.eagle import EagleProposer

MAX_NEW_TOKENS = 16


class DraftRecorder:
    """Every (context, drafts) a proposer class returns, per generate call."""

    def __init__(self, monkeypatch, proposer_class):
        self.calls: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
        propose = proposer_class.propose

        def recording_propose(proposer, request):
            proposal = propose(proposer, request)
            for tokens, drafted in zip(request.token_ids, proposal.draft_token_ids):
                self.calls[-1].append(
                    (tuple(np.asarray(tokens).tolist()), tuple(np.asarray(drafted).tolist()))
                )
            return proposal

        monkeypatch.setattr(proposer_class, "propose", recording_propose)

    def generate(self, model, inputs, speculative_config: dict) -> list:
        """Run one generate (checking it against plain greedy); return the drafts it made."""
        self.calls.append([])
        out = model.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, speculative_config=speculative_config
        )
        assert torch.equal(
            out, plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        )
        drafts = self.calls[-1]
        assert any(drafted for _, drafted in drafts), "nothing drafted: the test observes nothing"
        return drafts


class LoadCounter:
    """Counts calls of `module.name` (the loader a drafter module calls)."""

    def __init__(self, monkeypatch, module, name: str):
        self.count = 0
        load = getattr(module, name)

        def counting(*args, **kwargs):
            self.count += 1
            return load(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


def rewrite(write) -> None:
    """Rewrite files after the file system's timestamp tick has certainly passed (as any real
    retraining does): mtime / ctime then differ even when the sizes are the same."""
    time.sleep(0.05)
    write()


def head_config(folder, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k}


def draft_config(folder, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k}


# --- EAGLE heads ------------------------------------------------------------------------------
@pytest.fixture
def head_folder(tmp_path):
    model = hf_specdec.enable(build_tiny_llama())
    random_head(model, "eagle3", seed=0).save_pretrained(tmp_path / "head")
    return model, tmp_path / "head"


def test_unchanged_head_folder_is_loaded_once(head_folder, monkeypatch):
    model, folder = head_folder
    loads = LoadCounter(monkeypatch, eagle, "load_eagle_head")
    recorder = DraftRecorder(monkeypatch, EagleProposer)
    inputs = repeated_span_batch(2)
    first = recorder.generate(model, inputs, head_config(folder))
    head = eagle._LOADED[model][("eagle3", str(folder))]
    second = recorder.generate(model, inputs, head_config(folder))
    assert loads.count == 1
    assert eagle._LOADED[model][("eagle3", str(folder))] is head
    assert second == first


def test_rewritten_head_weights_are_read_again(head_folder, monkeypatch):
    """Same shapes, other weights (a head trained further): the next generate drafts with them."""
    model, folder = head_folder
    recorder = DraftRecorder(monkeypatch, EagleProposer)
    inputs = repeated_span_batch(2)
    before = recorder.generate(model, inputs, head_config(folder))
    old_head = eagle._LOADED[model][("eagle3", str(folder))]

    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    changed = {  # the floating tensors moved; the draft vocabulary's index tensors kept
        name: value + 0.5 * torch.randn(value.shape, generator=generator)
        if value.is_floating_point()
        else value
        for name, value in weights.items()
    }
    rewrite(lambda: save_file(changed, str(folder / "model.safetensors")))

    after = recorder.generate(model, inputs, head_config(folder))
    new_head = eagle._LOADED[model][("eagle3", str(folder))]
    assert new_head is not old_head
    torch.testing.assert_close(new_head.fc.weight, changed["fc.weight"], rtol=0, atol=0)
    # the drafts are those of a fresh load of the new files, not the old head's
    fresh = hf_specdec.load_eagle_head(folder, target=model, method="eagle3")
    expected = recorder.generate(model, inputs, {**head_config(folder), "model": fresh})
    assert after == expected
    assert after != before


def test_rewritten_head_config_is_checked_again(head_folder):
    """A config.json rewritten with a wrong hidden size fails the next generate with the loader's
    error, instead of the old head drafting; restored, the folder loads again."""
    model, folder = head_folder
    inputs = repeated_span_batch(1)
    model.generate(**inputs, max_new_tokens=4, do_sample=False, speculative_config=head_config(folder))
    original = (folder / "config.json").read_text()
    config = json.loads(original)
    config["decoder"]["hidden_size"] = 32  # the target's (and the weights') is 64
    rewrite(lambda: (folder / "config.json").write_text(json.dumps(config)))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 192\), the config implies \(32, 192\)"):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, speculative_config=head_config(folder))
    assert ("eagle3", str(folder)) not in eagle._LOADED[model]  # the stale head is not kept
    rewrite(lambda: (folder / "config.json").write_text(original))
    model.generate(**inputs, max_new_tokens=4, do_sample=False, speculative_config=head_config(folder))


def test_hub_snapshot_is_keyed_on_its_files(tmp_path, monkeypatch):
    """A Hub id resolves to its snapshot folder in the local cache: unchanged, no reload; a new
    revision (refs/main moved) is a different folder, read again."""
    from huggingface_hub import constants

    model = hf_specdec.enable(build_tiny_llama())
    repo = tmp_path / "hub" / "models--org--tiny-head"
    first, second = "0" * 40, "1" * 40
    random_head(model, "eagle3", seed=0).save_pretrained(repo / "snapshots" / first)
    random_head(model, "eagle3", seed=1).save_pretrained(repo / "snapshots" / second)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loads = LoadCounter(monkeypatch, eagle, "load_eagle_head")
    assert on_disk.local_folder("org/tiny-head") == repo / "snapshots" / first
    recorder = DraftRecorder(monkeypatch, EagleProposer)
    inputs = repeated_span_batch(2)
    before = recorder.generate(model, inputs, head_config("org/tiny-head"))
    assert recorder.generate(model, inputs, head_config("org/tiny-head")) == before
    assert loads.count == 1
    rewrite(lambda: (repo / "refs" / "main").write_text(second))
    after = recorder.generate(model, inputs, head_config("org/tiny-head"))
    assert loads.count == 2
    assert after == recorder.generate(model, inputs, head_config(repo / "snapshots" / second))
    assert after != before


# --- draft models -----------------------------------------------------------------------------
@pytest.fixture
def draft_folder(tmp_path):
    model = hf_specdec.enable(build_tiny_llama())
    perturbed_copy(model, seed=1).save_pretrained(tmp_path / "draft")
    return model, tmp_path / "draft"


def test_unchanged_draft_folder_is_loaded_once(draft_folder, monkeypatch):
    model, folder = draft_folder
    loads = LoadCounter(monkeypatch, draft_model, "generation_model_class")
    recorder = DraftRecorder(monkeypatch, DraftModelProposer)
    inputs = repeated_span_batch(2)
    first = recorder.generate(model, inputs, draft_config(folder))
    draft = draft_model._LOADED[model][str(folder)]
    second = recorder.generate(model, inputs, draft_config(folder))
    assert loads.count == 1
    assert draft_model._LOADED[model][str(folder)] is draft
    assert second == first


def test_rewritten_draft_weights_are_read_again(draft_folder, monkeypatch):
    """The draft saved again with other weights (same shapes): the next generate drafts with them."""
    model, folder = draft_folder
    recorder = DraftRecorder(monkeypatch, DraftModelProposer)
    inputs = repeated_span_batch(2)
    before = recorder.generate(model, inputs, draft_config(folder))
    old_draft = draft_model._LOADED[model][str(folder)]
    retrained = perturbed_copy(model, seed=2, noise=0.5)
    rewrite(lambda: retrained.save_pretrained(folder))

    after = recorder.generate(model, inputs, draft_config(folder))
    new_draft = draft_model._LOADED[model][str(folder)]
    assert new_draft is not old_draft
    for name, value in retrained.state_dict().items():
        torch.testing.assert_close(new_draft.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert after == recorder.generate(model, inputs, {**draft_config(folder), "model": retrained})
    assert after != before


def test_rewritten_draft_config_is_checked_again(draft_folder):
    model, folder = draft_folder
    inputs = repeated_span_batch(1)
    model.generate(**inputs, max_new_tokens=4, do_sample=False, speculative_config=draft_config(folder))
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 32  # the weights are 64 wide
    rewrite(lambda: (folder / "config.json").write_text(json.dumps(config)))
    # transformers' own loader refuses the mismatched weights (a RuntimeError, not ours to reword)
    with pytest.raises(RuntimeError, match="mismatched"):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, speculative_config=draft_config(folder))
    assert str(folder) not in draft_model._LOADED[model]


# --- MTP layers from the target's checkpoint --------------------------------------------------
def test_mtp_layers_read_again_when_the_checkpoint_changes(tmp_path, monkeypatch):
    from test_mtp import NUM_LAYERS, build_pair, deepseek_config, save_with_mtp_weights
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    from hf_specdec.drafters import mtp as mtp_drafter
    from hf_specdec.drafters.mtp import MtpProposer

    folder = tmp_path / "deepseek"
    built_target, built_mtp = build_pair(deepseek_config(), seed=0)
    _, other_mtp = build_pair(deepseek_config(), seed=1)  # the same shapes, other weights
    save_with_mtp_weights(built_target, built_mtp, str(folder))
    with monkeypatch.context() as patch:
        patch.setattr(
            DeepseekV3PreTrainedModel,
            "_keys_to_ignore_on_load_unexpected",
            [rf"model\.layers\.{NUM_LAYERS}.*"],
        )
        target = hf_specdec.enable(DeepseekV3ForCausalLM.from_pretrained(str(folder)).eval())
    loads = LoadCounter(monkeypatch, MtpModel, "from_pretrained")
    recorder = DraftRecorder(monkeypatch, MtpProposer)
    inputs = repeated_span_batch(2)
    config = {"method": "mtp", "num_speculative_tokens": 2}

    before = recorder.generate(target, inputs, config)
    loaded = mtp_drafter._LOADED[target]
    assert recorder.generate(target, inputs, config) == before
    assert loads.count == 1 and mtp_drafter._LOADED[target] is loaded

    # the MTP layer retrained and saved into the same checkpoint, the target object kept
    rewrite(lambda: save_with_mtp_weights(built_target, other_mtp, str(folder)))
    after = recorder.generate(target, inputs, config)
    assert loads.count == 2 and mtp_drafter._LOADED[target] is not loaded
    fresh = MtpModel.from_pretrained(target)
    assert after == recorder.generate(target, inputs, {**config, "model": fresh})
    assert after != before
