"""EAGLE heads on the Hub without a Hub: loading a Hub id from a local Hugging Face cache in
offline mode (laid out as huggingface_hub lays out downloads), and pushing with HfApi's network
calls replaced by recorders that keep what would have been uploaded."""

from __future__ import annotations

import hashlib
import importlib
import shutil
from pathlib import Path

import pytest
import torch
from conftest import plain_generate, repeated_span_batch
from huggingface_hub import CommitInfo, HfApi, ModelCard, constants, scan_cache_dir
from huggingface_hub.utils import filter_repo_objects

from hf_specdec.heads.eagle_heads import EagleHead
from hf_specdec.heads.hub import push_head_folder

REPO_ID = "org/tiny-eagle3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def eagle3_head(model, seed: int = 0) -> EagleHead:
    """A random EAGLE-3 head over 3/4 of the tiny target's vocabulary."""
    vocab = model.config.vocab_size
    draft_vocab = (
        torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab * 3 // 4].sort().values
    )
    return EagleHead.for_target(model, "eagle3", draft_vocab=draft_vocab, seed=seed)


def assert_same_tensors(loaded: EagleHead, head: EagleHead) -> None:
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> None:
    """The files of `folder` as huggingface_hub's cache holds a download of `repo_id` at `commit`.

    Blobs are named by their Hub etag (sha256 for LFS files such as safetensors, the git blob
    sha1 otherwise), snapshots link to them, refs/main names the commit.
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / etag).write_bytes(data)
        (repo / "snapshots" / commit / file.name).symlink_to(Path("..", "..", "blobs", etag))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_hub_cache(tmp_path):
    """HF_HOME in tmp_path and HF_HUB_OFFLINE=1, read by huggingface_hub as at import time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        patch.delenv("HF_HUB_CACHE", raising=False)
        patch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
        patch.setenv("HF_HUB_OFFLINE", "1")
        importlib.reload(constants)
        try:
            yield Path(constants.HF_HUB_CACHE)
        finally:
            patch.undo()
            importlib.reload(constants)  # the session's own settings again


def generate_with(model, inputs, head_source):
    return model.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config={"method": "eagle3", "model": head_source, "num_speculative_tokens": 3},
        return_dict_in_generate=True,
    )


# --- loading ------------------------------------------------------------------------------------
def test_hub_id_loads_offline_from_the_cache(enabled_llama, tmp_path, offline_hub_cache):
    model = enabled_llama
    head = eagle3_head(model)
    head.save_pretrained(tmp_path / "head")
    add_to_hub_cache(offline_hub_cache, REPO_ID, tmp_path / "head")
    cached = scan_cache_dir(offline_hub_cache)  # huggingface_hub accepts the layout as its own
    assert [(r.repo_id, [rev.commit_hash for rev in r.revisions]) for r in cached.repos] == [
        (REPO_ID, [COMMIT])
    ]
    assert constants.HF_HUB_OFFLINE

    assert_same_tensors(EagleHead.from_pretrained(REPO_ID, target=model), head)
    assert_same_tensors(EagleHead.from_pretrained(tmp_path / "head", target=model), head)

    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    from_hub = generate_with(model, inputs, REPO_ID)
    from_module = generate_with(model, inputs, head)
    assert torch.equal(from_hub.sequences, plain)
    assert from_hub.spec_metrics["num_draft_tokens"] > 0
    # the cached head drafts exactly what the module it was saved from drafts
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert from_hub.spec_metrics[key] == from_module.spec_metrics[key], key


def test_hub_id_missing_from_the_offline_cache(enabled_llama, offline_hub_cache):
    with pytest.raises(ValueError, match="neither a local folder nor a Hub model"):
        EagleHead.from_pretrained("org/not-cached", target=enabled_llama)


# --- pushing ------------------------------------------------------------------------------------
class RecordingHub:
    """Stands in for HfApi's network calls: records them, copies what upload_folder would send."""

    def __init__(self, uploads: Path):
        self.uploads = uploads
        self.calls: list[tuple[str, str, dict]] = []

    def install(self, monkeypatch) -> None:
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.calls.append(("create_repo", repo_id, kwargs))

        def create_branch(api, repo_id, **kwargs):
            hub.calls.append(("create_branch", repo_id, kwargs))

        def upload_folder(api, *, repo_id, folder_path, **kwargs):
            hub.calls.append(("upload_folder", repo_id, kwargs))
            names = [p.name for p in Path(folder_path).iterdir() if p.is_file()]
            for name in filter_repo_objects(names, allow_patterns=kwargs.get("allow_patterns")):
                shutil.copy(Path(folder_path) / name, hub.uploads / name)
            return CommitInfo(
                commit_url=f"https://huggingface.co/{repo_id}/commit/{COMMIT}",
                commit_message=kwargs.get("commit_message") or "",
                commit_description="",
                oid=COMMIT,
            )

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        # anything not replaced must not reach the network (huggingface_hub checks this per request)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def recording_hub(tmp_path, monkeypatch):
    hub = RecordingHub(tmp_path / "uploaded")
    hub.uploads.mkdir()
    hub.install(monkeypatch)
    return hub


def test_push_to_hub_uploads_a_loadable_head_with_a_card(enabled_llama, recording_hub):
    model = enabled_llama
    head = eagle3_head(model, seed=1)
    url = head.push_to_hub(
        REPO_ID,
        private=True,
        card_fields={"base_model": "org/tiny-llama", "license": "apache-2.0", "num_steps": 10},
    )
    assert url == f"https://huggingface.co/{REPO_ID}/commit/{COMMIT}"
    (create, create_args), (upload, upload_args) = [(c[0], c) for c in recording_hub.calls]
    assert create == "create_repo" and create_args[1:] == (REPO_ID, {"private": True, "exist_ok": True})
    assert upload == "upload_folder" and upload_args[1] == REPO_ID
    assert upload_args[2]["commit_message"] == "Upload EAGLE head (hf-specdec)"
    assert upload_args[2]["revision"] is None

    uploaded = recording_hub.uploads
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert_same_tensors(EagleHead.from_pretrained(uploaded, target=model), head)
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.base_model == "org/tiny-llama"
    assert card.data.library_name == "hf-specdec"
    assert card.data.license == "apache-2.0"
    assert card.data.tags == ["speculative-decoding", "eagle3"]
    assert f'"model": "{REPO_ID}"' in card.text
    assert "| draft vocabulary (tokens) | 96 |" in card.text and "| optimizer steps | 10 |" in card.text


def test_push_head_folder_keeps_its_card_and_skips_other_files(enabled_llama, tmp_path, recording_hub):
    folder = tmp_path / "trained"
    eagle3_head(enabled_llama).save_pretrained(folder)
    (folder / "README.md").write_text("---\nbase_model: org/tiny-llama\n---\n# trained here\n")
    (folder / "optimizer.pt").write_bytes(b"not for the Hub")
    push_head_folder(folder, REPO_ID, revision="v1", commit_message="step 1000")
    assert [c[0] for c in recording_hub.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert recording_hub.calls[1][2] == {"branch": "v1", "exist_ok": True}
    assert recording_hub.calls[2][2]["revision"] == "v1"
    assert recording_hub.calls[2][2]["commit_message"] == "step 1000"
    assert sorted(p.name for p in recording_hub.uploads.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert (recording_hub.uploads / "README.md").read_text().endswith("# trained here\n")


def test_push_head_folder_needs_a_head(enabled_llama, tmp_path, recording_hub):
    folder = tmp_path / "no_weights"
    eagle3_head(enabled_llama).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="lacks model.safetensors"):
        push_head_folder(folder, REPO_ID, card_fields={"base_model": "org/tiny-llama"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="lacks config.json and model.safetensors"):
        push_head_folder(tmp_path / "empty", REPO_ID)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not an hf_specdec.eagle_head config"):
        push_head_folder(folder, REPO_ID, card_fields={"base_model": "org/tiny-llama"})
    assert recording_hub.calls == []  # refused before any Hub call


def test_push_needs_the_target_for_the_card(enabled_llama, recording_hub):
    head = eagle3_head(enabled_llama)
    with pytest.raises(ValueError, match=r"card_fields\['base_model'\] is required"):
        head.push_to_hub(REPO_ID)
    with pytest.raises(
        ValueError, match=r"card_fields\['method'\]='eagle' contradicts the head being pushed"
    ):
        head.push_to_hub(REPO_ID, card_fields={"base_model": "org/tiny-llama", "method": "eagle"})
    assert recording_hub.calls == []
