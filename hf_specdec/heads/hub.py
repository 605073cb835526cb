"""Publishing EAGLE heads on the Hugging Face Hub (`huggingface_hub.HfApi`).

Loading needs nothing here: `eagle_heads.resolve_head_folder` takes a Hub id through
`snapshot_download`, which reads the local Hugging Face cache when `HF_HUB_OFFLINE=1`.

A published repo holds exactly our checkpoint format (`config.json`, `model.safetensors`) and a
`README.md` model card (`model_card.py`); other files in a trainer's output folder (logs,
optimizer state) are not uploaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .head_config import CONFIG_FILE, WEIGHTS_FILE, EagleHeadConfig
from .model_card import CARD_FILE, write_model_card

DEFAULT_COMMIT_MESSAGE = "Upload EAGLE head (hf-specdec)"
UPLOADED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE)
# card fields the checkpoint determines; a caller's value that differs means a mix-up
_CHECKED_FACTS = ("repo_id", "method", "num_head_layers", "draft_vocab_size")


def read_head_folder_config(folder: str | os.PathLike) -> EagleHeadConfig:
    """The config of a head folder in our format; ValueError naming what is missing otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"EAGLE head folder {str(folder)!r} does not exist or is not a folder")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"EAGLE head folder {str(folder)!r} lacks {' and '.join(missing)}; a head to publish needs "
            f"{CONFIG_FILE} and {WEIGHTS_FILE} (what EagleHead.save_pretrained writes)"
        )
    try:
        data = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(folder / CONFIG_FILE)!r} is not valid JSON: {error}") from error
    return EagleHeadConfig.from_json(data)


def head_card_fields(config: EagleHeadConfig) -> dict[str, Any]:
    """Model card fields that follow from the checkpoint itself."""
    if config.method == "eagle":
        features = "the target's last hidden state (after its final norm)"
    elif config.target_feature_layers is None:
        features = "target hidden_states[2], [L // 2], [L - 3] (the default for a target of L layers)"
    else:
        features = "target hidden_states " + ", ".join(f"[{i}]" for i in config.target_feature_layers)
    return {
        "method": config.method,
        "num_head_layers": config.num_layers,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "target_feature_layers": features,
    }


def push_head_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    revision: str | None = None,
    card_fields: dict[str, Any] | None = None,
) -> str:
    """Upload a head folder (config.json + model.safetensors, e.g. a trainer's output) to `repo_id`.

    The repo is created if needed (`private` applies then), and the branch `revision` too. With
    `card_fields` (see `model_card.py`; `repo_id` and the head's own facts are filled in) a model
    card is written to `folder/README.md` first; without them an existing README.md is uploaded
    as is, and a folder without one needs them (at least `base_model`). Returns the commit URL.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    config = read_head_folder_config(folder)
    if card_fields is not None or not (folder / CARD_FILE).is_file():
        if not (card_fields or {}).get("base_model"):
            raise ValueError(
                "card_fields['base_model'] is required for the model card: the Hub id of the target model "
                f"the head drafts for (or put a {CARD_FILE} in the head folder)"
            )
        write_model_card(folder, _card_fields(config, repo_id, card_fields))
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message,
        revision=revision,
        allow_patterns=list(UPLOADED_FILES),
    )
    return commit.commit_url


def _card_fields(config: EagleHeadConfig, repo_id: str, card_fields: dict[str, Any]) -> dict[str, Any]:
    facts = {**head_card_fields(config), "repo_id": repo_id}
    for name in _CHECKED_FACTS:
        given = card_fields.get(name)
        if given is not None and str(given) != str(facts[name]):
            raise ValueError(
                f"card_fields[{name!r}]={given!r} contradicts the head being pushed ({name}={facts[name]!r})"
            )
    return {**card_fields, **facts}
