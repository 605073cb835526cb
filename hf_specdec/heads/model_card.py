"""Model cards (README.md) for published draft heads, from `model_cards/template.md`.

The template is Markdown with `{field}` placeholders filled by `str.format_map`. The YAML front
matter is not templated: huggingface_hub's `ModelCardData` writes it (quoting, lists, omitting
unknown keys), from `base_model`, `method`, `license` and `datasets`, with
`library_name: hf-specdec` and the tags `speculative-decoding` and the method.

Fields (`render_model_card(fields)`):

- required: `repo_id` (the head's Hub id, used in the usage snippet), `base_model` (the target's
  Hub id), `method` ("eagle" or "eagle3"). A missing one is a ValueError naming it.
- optional, "n/a" in the card when absent: see `OPTIONAL_FIELDS`. `license` and `datasets` (a
  list of Hub dataset ids) also go into the front matter, and are left out of it when absent.

Unknown field names are a ValueError too (they are typos: the template would ignore them).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

TEMPLATE_PACKAGE = "hf_specdec.model_cards"  # model_cards/ in the source tree (pyproject package-dir)
TEMPLATE_NAME = "template.md"
CARD_FILE = "README.md"
NOT_KNOWN = "n/a"

METHOD_NAMES = {"eagle": "EAGLE", "eagle3": "EAGLE-3"}
REQUIRED_FIELDS = {
    "repo_id": "the head's Hub id, e.g. 'org/model-eagle3'",
    "base_model": "the Hub id of the target model the head drafts for",
    "method": f"the head's method, one of {', '.join(METHOD_NAMES)}",
}
OPTIONAL_FIELDS = {
    "license": "license id for the front matter, e.g. 'apache-2.0'",
    "datasets": "list of Hub dataset ids the head was trained on",
    "training_data": "the training data in words (defaults to the datasets, comma-separated)",
    "num_records": "number of training records (conversations / documents)",
    "num_steps": "optimizer steps",
    "tokens_seen": "training tokens seen",
    "max_length": "maximum training sequence length in tokens",
    "ttt_steps": "training-time-test unroll steps (EAGLE-3)",
    "num_head_layers": "decoder layers in the head",
    "draft_vocab_size": "tokens in the head's draft vocabulary",
    "target_feature_layers": "which target hidden states the head reads",
    "training_command": "the exact command that trained the head",
    "tau": "measured mean acceptance length",
    "results_table": "Markdown table of measured speedups",
    "hardware": "hardware the results were measured on",
    "benchmark": "prompts / settings of the measurements",
    "limitations": "known issues beyond the standard ones",
}


def read_template() -> str:
    """The installed `model_cards/template.md` (package data, so it exists in any install)."""
    return resources.files(TEMPLATE_PACKAGE).joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


def render_model_card(fields: dict[str, Any]) -> str:
    """The README.md text of a head's model card; see the module docstring for the fields."""
    unknown = sorted(set(fields) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown model card fields {unknown}; allowed: {', '.join([*REQUIRED_FIELDS, *OPTIONAL_FIELDS])}"
        )
    for name, meaning in REQUIRED_FIELDS.items():
        if fields.get(name) in (None, ""):
            raise ValueError(f"model card field {name!r} is required: {meaning}")
    method = fields["method"]
    if method not in METHOD_NAMES:
        raise ValueError(
            f"model card field 'method'={method!r} is invalid; allowed: {', '.join(METHOD_NAMES)}"
        )
    datasets = list(fields.get("datasets") or [])
    if any(not isinstance(name, str) for name in datasets):
        raise ValueError(
            f"model card field 'datasets' must be a list of Hub dataset ids (strings), got {datasets!r}"
        )

    values = {name: NOT_KNOWN for name in OPTIONAL_FIELDS}
    values.update({name: value for name, value in fields.items() if value is not None})
    if "training_data" not in fields and datasets:
        values["training_data"] = ", ".join(datasets)
    card_data = ModelCardData(
        base_model=fields["base_model"],
        library_name="hf-specdec",
        license=fields.get("license"),
        datasets=datasets or None,
        tags=["speculative-decoding", method],
    )
    values.update(card_data=card_data.to_yaml(), method_name=METHOD_NAMES[method])
    try:
        return read_template().format_map(values)
    except KeyError as error:  # the template names a field this module does not know
        raise ValueError(
            f"{TEMPLATE_NAME} uses the field {error.args[0]!r}, which is not a model card field"
        ) from error


def write_model_card(folder: str | os.PathLike, fields: dict[str, Any]) -> Path:
    """Render the card and write it as `folder/README.md`; returns that path."""
    path = Path(folder) / CARD_FILE
    path.write_text(render_model_card(fields), encoding="utf-8")
    return path
