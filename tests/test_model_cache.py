"""The cache of real models: a model asked for by several processes at once on a new machine (the
test workers of `pytest -n 2`, the processes of an `accelerate launch`) is converted once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hf_specdec.models import real_models


def test_a_model_asked_for_at_once_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    conversions = []

    def convert(gguf: Path, folder: Path) -> None:
        conversions.append(gguf.read_text())
        time.sleep(0.3)  # without the lock, every caller would find the folder still empty
        folder.mkdir()
        (folder / "model.safetensors").write_text("weights")
        (folder / "tokenizer.json").write_text("{}")

    def write_gguf(tmp: Path) -> Path:
        (tmp / "model.gguf").write_text("gguf")
        return tmp / "model.gguf"

    monkeypatch.setattr(real_models, "_gguf_to_safetensors", convert)
    folder = tmp_path / "a-model"
    # flock excludes separate open files, so threads stand in for processes here
    with ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: real_models._converted_once(folder, write_gguf), range(4)))
    assert folders == [folder] * 4
    assert conversions == ["gguf"]
    assert real_models._converted_once(folder, write_gguf) == folder and conversions == ["gguf"]
