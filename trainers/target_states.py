"""The frozen target's hidden states for a batch: computed online, or read from an offline cache.

Online, the target runs (no grad) in the training process on every batch, through the same
hooks (`hf_specdec.models.feature_capture`) that feed the drafter inside generate, so the head trains
on exactly the features it will read. Offline, one pass writes them to safetensors shards and
training reads them back: worth it when the same data is trained on for several epochs or
several runs (each saves a target forward per token), at 2 * (F + H) bytes per token in bf16.

Both keep the final norm's output (H per token) rather than logits (a whole vocabulary per
token): the target's lm_head turns it into logits only at the positions that carry a label.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from hf_specdec.models.feature_capture import TargetFeatureCapture, decoder_parts

from .data import Batch, TokenizedData, collate
from .objectives import TargetBatch

FINGERPRINT = "fingerprint.json"


def capture_layers(target: nn.Module, feature_layers: Sequence[int]) -> tuple[int, ...]:
    """Hidden-state indices to capture: the head's feature layers plus the final norm's output (L)."""
    layers, _ = decoder_parts(target)  # raises ValueError when the target's hidden states can't be reached
    return (*feature_layers, len(layers))


@torch.no_grad()
def run_target(
    target: nn.Module, input_ids: torch.Tensor, feature_layers: Sequence[int], autocast_dtype: torch.dtype | None = None
) -> TargetBatch:
    """One plain forward of the frozen target over right-padded rows (causal: pads are never seen).

    `autocast_dtype` (bf16 / fp16) runs its matmuls in that dtype, weights and residual stream
    staying in theirs: on a 2-core Xeon with AMX, bf16 took the forward of 8 x 512 tokens from
    3.8 s to 1.2 s. None: the target's own dtype throughout.
    """
    layers = capture_layers(target, feature_layers)
    autocast = torch.autocast(target.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with TargetFeatureCapture(target, layers) as capture, autocast:
        # logits_to_keep=1: the full-vocabulary logits of every position are not needed
        target(input_ids=input_ids.to(target.device), logits_to_keep=1, use_cache=False)
        captured = capture.features()
    width = captured.shape[-1] // len(layers)
    return TargetBatch(features=captured[..., : -width], final_hidden=captured[..., -width:])


class OfflineTargetStates:
    """Hidden states of every record, in safetensors shards under `folder` (written once, then read).

    Each shard `shard_N.safetensors` has a `shard_N.json` listing its records, so processes can
    write their shares side by side. `fingerprint.json` records what the cache was built from
    (target, feature layers, a hash of the records' tokens); a cache built from anything else is
    refused rather than silently reused.
    """

    def __init__(self, folder: str | Path, fingerprint: dict):
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        saved = self.folder / FINGERPRINT
        if saved.is_file() and json.loads(saved.read_text()) != fingerprint:
            raise ValueError(
                f"--hidden-states-cache {str(self.folder)!r} was built for {saved.read_text()}, not for this run "
                f"({json.dumps(fingerprint)}); give another folder or delete it"
            )
        self._shard_of: dict[int, str] = {}
        self.reload()

    def reload(self) -> None:
        """Rescan the shard lists (after other processes have written theirs)."""
        for listing in sorted(self.folder.glob("shard_*.json")):
            shard = listing.with_suffix(".safetensors").name
            self._shard_of.update({int(i): shard for i in json.loads(listing.read_text())})

    def missing(self, record_ids: Sequence[int]) -> list[int]:
        return [i for i in record_ids if i not in self._shard_of]

    def build(
        self, target: nn.Module, data: TokenizedData, record_ids: Sequence[int], feature_layers: Sequence[int],
        batch_size: int, shard_name: str, progress=None, autocast_dtype: torch.dtype | None = None,
        num_forwards: int = 0,
    ) -> None:
        """Compute and write the states of `record_ids` into the shard `shard_name` (no suffix).

        `num_forwards`: run the target at least this many times. A sharded target's forward is a
        collective, so a process with fewer batches than another runs one-token forwards it drops.
        """
        from safetensors.torch import save_file

        tensors = {}
        ordered = sorted(record_ids, key=lambda i: -len(data.input_ids[i]))  # little padding per batch
        starts = range(0, len(ordered), batch_size)
        for _ in range(len(starts), num_forwards):
            run_target(target, torch.zeros(1, 1, dtype=torch.long), feature_layers, autocast_dtype)
        for begin in starts:
            batch = collate(data, ordered[begin : begin + batch_size])
            states = run_target(target, batch.input_ids, feature_layers, autocast_dtype)
            for row, (record, length) in enumerate(zip(batch.record_ids.tolist(), batch.lengths.tolist())):
                tensors[f"{record}.features"] = states.features[row, :length].to(torch.bfloat16).contiguous()
                tensors[f"{record}.final_hidden"] = states.final_hidden[row, :length].to(torch.bfloat16).contiguous()
            if progress is not None:
                progress.update(len(batch.record_ids))
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.folder / FINGERPRINT, json.dumps(self.fingerprint))
        save_file(tensors, str(self.folder / f"{shard_name}.safetensors"))
        # the listing last: a shard without one is an interrupted write and gets rebuilt
        _write_atomically(self.folder / f"{shard_name}.json", json.dumps(sorted(int(i) for i in record_ids)))
        self.reload()

    def load(self, batch: Batch, dtype: torch.dtype) -> TargetBatch:
        """The cached states of a batch, right-padded like `batch.input_ids`."""
        from safetensors import safe_open

        rows, width = batch.input_ids.shape
        features = final_hidden = None
        handles = {}
        for row, (record, length) in enumerate(zip(batch.record_ids.tolist(), batch.lengths.tolist())):
            shard = self._shard_of.get(record)
            if shard is None:
                raise ValueError(f"record {record} is not in the hidden-states cache {str(self.folder)!r}")
            if shard not in handles:
                handles[shard] = safe_open(str(self.folder / shard), framework="pt")
            f = handles[shard].get_tensor(f"{record}.features")
            h = handles[shard].get_tensor(f"{record}.final_hidden")
            if features is None:
                features = torch.zeros(rows, width, f.shape[-1], dtype=dtype)
                final_hidden = torch.zeros(rows, width, h.shape[-1], dtype=dtype)
            # [:length]: a filler row (`length` 0) takes none of its record's states
            features[row, :length] = f[:length].to(dtype)
            final_hidden[row, :length] = h[:length].to(dtype)
        return TargetBatch(features=features, final_hidden=final_hidden)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)
