"""The notebooks in examples/: stored without outputs, and each runs top to bottom on SmolLM2 (slow).

The slow tests execute a notebook with nbclient in a fresh kernel whose working folder is the
test's tmp_path (what a notebook writes lands there), then check what it printed and wrote. The
notebooks assert token identity with plain generate() themselves; a failing cell fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = ("quickstart.ipynb", "train_a_head.ipynb", "benchmark_your_prompts.ipynb")
KERNEL_NAME = "hf-specdec-tests"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_notebooks_are_stored_without_outputs():
    stored = sorted(EXAMPLES.glob("*.ipynb"))
    assert set(NOTEBOOKS) <= {path.name for path in stored}
    for path in stored:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        for number, cell in enumerate(notebook.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (
                    f"{path.name} cell {number} has outputs: strip them before committing"
                )


@pytest.fixture(scope="module")
def kernel_folder(tmp_path_factory) -> Path:
    """A Jupyter data folder with a kernel spec for this very interpreter.

    A user-level `python3` spec may point at another environment's Python (one without
    hf_specdec); a spec of our own, first on JUPYTER_PATH, cannot.
    """
    from ipykernel.kernelspec import write_kernel_spec

    folder = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(folder / "kernels" / KERNEL_NAME, overrides={"display_name": KERNEL_NAME})
    return folder


def run_notebook(name: str, workdir: Path, kernel_folder: Path, monkeypatch) -> nbformat.NotebookNode:
    """Execute examples/<name> in `workdir`; returns the executed notebook."""
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(kernel_folder))
    # the kernel inherits the environment: one torch thread, as in the rest of the suite
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    return notebook


def printed(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream"
    )


@pytest.mark.slow
def test_quickstart_notebook(tmp_path, kernel_folder, monkeypatch):
    text = printed(run_notebook("quickstart.ipynb", tmp_path, kernel_folder, monkeypatch))
    assert "token-identical to plain generate(): True" in text
    assert "tau (mean acceptance length)" in text and "accepted per position" in text
    assert "tokens/s" in text


@pytest.mark.slow
def test_train_a_head_notebook(tmp_path, kernel_folder, monkeypatch):
    text = printed(run_notebook("train_a_head.ipynb", tmp_path, kernel_folder, monkeypatch))
    head = tmp_path / "smollm2-eagle3-tiny"
    for name in ("config.json", "model.safetensors", "README.md", "trainer_state.json", "train_log.jsonl"):
        assert (head / name).is_file(), name
    state = json.loads((head / "trainer_state.json").read_text())
    assert state["method"] == "eagle3" and state["steps"] == 3 and state["draft_vocab_size"] == 4096
    assert "token-identical to plain generate(): True" in text


@pytest.mark.slow
def test_benchmark_your_prompts_notebook(tmp_path, kernel_folder, monkeypatch):
    notebook = run_notebook("benchmark_your_prompts.ipynb", tmp_path, kernel_folder, monkeypatch)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["num_prompts"] == 3
    assert list(results["arms"]) == ["plain", "transformers", "ours", "ours_k1", "ours_k2"]
    assert results["arms"]["plain"]["identical_fraction"] is None  # nothing to compare with
    assert all(arm["identical_fraction"] == 1.0 for name, arm in results["arms"].items() if name != "plain")
    assert results["sweep"]["k"] == [1, 2, 4]
    assert (tmp_path / "speedup.png").read_bytes()[:8] == PNG_MAGIC
    shown = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "display_data" and "image/png" in output.data
    ]
    assert len(shown) == 1
    assert "every speculative arm reproduced plain generate()" in printed(notebook)
