"""Target hidden states for feature-level drafters (EAGLE, EAGLE-3), captured during the forwards
the loop runs anyway: no second target pass, no `output_hidden_states` for every layer.

Forward hooks sit only on the modules whose hidden states the drafter reads. Indices follow
transformers' `hidden_states`: index i < L is the input of decoder layer i (a pre-hook on that
layer), index L the decoder's output `last_hidden_state` (a hook on the base model), i.e. the
final norm's output and the lm_head input.

Inside generate, the loop starts a capture before each verify (`begin_forward`); it then keeps, per row, only
the positions that became accepted context (the pending token(s) and the accepted drafts), in a
`PendingFeatures` the drafter reads at its next calls (`ProposeRequest.target_features`). They
wait there until the drafter takes them: a row that does not draft this step (k = 0, an n-gram
match served it) costs the drafter nothing and catches up in one forward later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..transfer import to_device


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers of a causal LM and its decoder (base model), whatever its architecture calls
    them (`model.layers` for Llama-style models, `transformer.h` for GPT-2, `gpt_neox.layers`, the
    language model of an image-text-to-text model...).

    The layers are the decoder's `ModuleList` with one entry per hidden layer. The decoder's own
    output (`last_hidden_state`) is the final hidden state, after the final norm, at every position:
    the lm_head input, whatever the norm is called (LFM2 names it `embedding_norm`). ValueError
    naming what is missing otherwise.
    """
    base, name = _decoder_and_layers_name(model)
    return getattr(base, name), base


def _decoder_and_layers_name(model: nn.Module) -> tuple[nn.Module, str]:
    """The base (decoder) model and the attribute holding its layers: the first of `get_decoder()`,
    the base model and `model.model` with exactly one `ModuleList` child, preferring the one of
    num_hidden_layers entries (`get_decoder()` returns the whole model for some classes, the head for
    others)."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    num_layers = getattr(config, "num_hidden_layers", None)
    candidates = [
        model.get_decoder() if hasattr(model, "get_decoder") else None,
        getattr(model, getattr(model, "base_model_prefix", ""), None),
        getattr(model, "model", None),
    ]
    found = []
    for base in candidates:
        if not isinstance(base, nn.Module):
            continue
        lists = [n for n, child in base.named_children() if isinstance(child, nn.ModuleList)]
        exact = [n for n in lists if len(getattr(base, n)) == num_layers]
        if len(exact) == 1 or len(lists) == 1:
            return base, (exact or lists)[0]
        found.append(f"{type(base).__name__}: {lists or 'none'}")
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: expected its decoder to hold one ModuleList "
        f"of layers (num_hidden_layers={num_layers}), found {'; '.join(found) or 'no decoder'}"
    )


@contextlib.contextmanager
def first_layers_only(model: nn.Module, num_layers: int) -> Iterator[None]:
    """Run only the first `num_layers` decoder layers (then the final norm and the head).

    Decoder forwards loop over their layer list (some over `layers[: config.num_hidden_layers]`,
    which the shorter list cuts too): the list is cut for the duration. The config's count stays:
    transformers' `EarlyExitCandidateGenerator` lowers it, which breaks models that shape per-layer
    inputs by it (Gemma 3n and Gemma 4 embed one input per layer of the whole model). A `layer_types`
    list is cut with the layers: some forwards zip the two (Ergo).
    """
    base, name = _decoder_and_layers_name(model)
    layers = getattr(base, name)
    configs = {id(c): c for c in (model.config.get_text_config(), getattr(base, "config", None)) if c is not None}
    cut: dict[int, list] = {}  # config -> its layer_types, for those cut (a property computing them is left)
    try:
        setattr(base, name, layers[:num_layers])
        for key, config in configs.items():
            layer_types = getattr(config, "layer_types", None)
            if isinstance(layer_types, list):
                try:
                    config.layer_types = layer_types[:num_layers]
                except AttributeError:  # computed from other fields (Mamba 2, Jamba, Bamba): left as it is
                    continue
                cut[key] = layer_types
        yield
    finally:
        setattr(base, name, layers)
        for key, layer_types in cut.items():
            configs[key].layer_types = layer_types


class PendingFeatures:
    """Per row, the target hidden states of accepted positions the drafter has not consumed yet.

    Rows accumulate one `[m, D]` block per verify, in position order; the drafter asks how many
    wait (`count`) and takes a row's whole backlog when it feeds them (`take`): with m waiting
    for a context of n tokens, feature j belongs to position n - 1 - m + j.
    """

    def __init__(self):
        self._rows: dict[int, torch.Tensor] = {}

    def add(self, row: int, features: torch.Tensor) -> None:
        if features.shape[0] == 0:
            return
        waiting = self._rows.get(row)
        self._rows[row] = features if waiting is None else torch.cat([waiting, features])

    def count(self, row: int) -> int:
        waiting = self._rows.get(int(row))
        return 0 if waiting is None else int(waiting.shape[0])

    def take(self, row: int) -> torch.Tensor:
        """The row's waiting features `[m, D]`, removed from the queue (`[0, 0]` when none wait)."""
        return self._rows.pop(int(row), torch.empty(0, 0))

    def drop(self, row: int) -> None:
        self._rows.pop(int(row), None)

    def clear(self) -> None:
        self._rows.clear()


class TargetFeatureCapture:
    """Hooks that record the hidden states at `layers` (transformers `hidden_states` indices).

    Use as a context manager: hooks exist only inside it. `features()` is the capture of the
    forward(s) since `begin_forward` (or since entering), the selected hidden states concatenated on
    the last dim. Inside generate the loop calls `begin_forward` before each verify and `keep` /
    `drop` after it; `pending` is what the drafter reads.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int]):
        decoder_layers, decoder = decoder_parts(model)
        num_layers = len(decoder_layers)
        self.layers = tuple(int(i) for i in layers)
        for index in self.layers:
            if not 0 <= index <= num_layers:
                raise ValueError(f"hidden_states index {index} is outside [0, {num_layers}] for this model")
        self._modules = {i: (decoder if i == num_layers else decoder_layers[i]) for i in set(self.layers)}
        self._num_layers = num_layers
        # Gemma 3n's layers pass [altup_num_inputs, batch, tokens, H] stacks (AltUp): the active stream
        # is the model's hidden state
        self._stream = getattr(model.config.get_text_config(), "altup_active_idx", None)
        # index -> [batch, tokens, H] pieces of the forwards since `begin_forward` (one per row when a
        # hybrid model's cache runs its rows one at a time: together they are the packed layout)
        self._captured: dict[int, list[torch.Tensor]] = {}
        self.pending = PendingFeatures()
        self.held = PendingFeatures()  # prompt chunks' features, not the drafter's until the prompt is in
        self._handles: list = []

    def __enter__(self) -> TargetFeatureCapture:
        for index, module in self._modules.items():
            if index == self._num_layers:
                handle = module.register_forward_hook(self._output_hook(index))
            else:
                handle = module.register_forward_pre_hook(self._input_hook(index), with_kwargs=True)
            self._handles.append(handle)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()
        self.pending.clear()
        self.held.clear()

    def _input_hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.dim() == 4 and self._stream is not None:
                hidden = hidden[self._stream]
            self._captured.setdefault(index, []).append(hidden.detach())

        return hook

    def _output_hook(self, index: int):
        def hook(module, args, output):
            # a decoder returns a ModelOutput (last_hidden_state first), a norm a tensor
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            self._captured.setdefault(index, []).append(hidden.detach())

        return hook

    # --- the forward(s) since begin_forward ------------------------------------------------------
    def begin_forward(self) -> None:
        """Forget what earlier forwards captured (a drafter running the target's own layers): the
        forward(s) that follow are the ones `features` / `keep` read."""
        self._captured.clear()

    def pack(self, slots: np.ndarray, columns: np.ndarray) -> None:
        """The forward since `begin_forward` laid its tokens out `[rows, width]` (a batch on the model's own cache):
        its captures laid out packed, token i from row `slots[i]`, column `columns[i]`."""
        for index in self._captured:
            hidden = self._hidden(index)
            rows, cols = to_device([slots, columns], hidden.device)
            self._captured[index] = [hidden[rows, cols][None]]

    def _hidden(self, index: int) -> torch.Tensor:
        pieces = self._captured.get(index)
        if not pieces:
            raise RuntimeError(f"no forward has run through the hooked modules yet (hidden_states {index})")
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def features(self) -> torch.Tensor:
        """`[batch, tokens, len(layers) * H]`: the hidden states captured since `begin_forward`, in `layers` order."""
        return torch.cat([self._hidden(i) for i in self.layers], dim=-1)

    # --- per row, between verify and the next draft ----------------------------------------------
    def keep(self, row: int, start: int, count: int, batch_index: int = 0) -> None:
        """Row `row`'s tokens at positions [start, start + count) of the captured forward became context:
        packed positions of a verify, or (`batch_index`) columns of a batched prefill."""
        self.pending.add(
            row, torch.cat([self._hidden(i)[batch_index, start : start + count] for i in self.layers], dim=-1)
        )

    def keep_at(self, row: int, positions: np.ndarray) -> None:
        """Row `row`'s tokens at these packed positions of the captured verify became context, in
        this order (a draft tree's pending tokens and accepted path), after any held for the row."""
        self.pending.add(row, self.held.take(row))
        self.pending.add(row, self._at(positions))

    def hold_at(self, row: int, positions: np.ndarray) -> None:
        """A prompt chunk of row `row` at these packed positions: held until the row's next `keep_at`."""
        self.held.add(row, self._at(positions))

    def _at(self, positions: np.ndarray) -> torch.Tensor:
        (index,) = to_device([np.asarray(positions, dtype=np.int64)], self._hidden(self.layers[0]).device)
        return torch.cat([self._hidden(i)[0, index] for i in self.layers], dim=-1)

    def drop(self, row: int) -> None:
        self.pending.drop(row)
        self.held.drop(row)


def capture_for_proposer(model: nn.Module, proposer: object) -> contextlib.AbstractContextManager:
    """A `TargetFeatureCapture` for drafters that declare `target_feature_layers`, else a no-op (None)."""
    layers = getattr(proposer, "target_feature_layers", None)
    if not layers:
        return contextlib.nullcontext(None)
    return TargetFeatureCapture(model, layers)


def target_features(
    model: nn.Module, input_ids: torch.Tensor, layers: Sequence[int], **forward_kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain target forward: (`[batch, tokens, len(layers) * H]` features, logits), e.g. to train a head.

    The same hooks as inside generate, so a head trained on these sees exactly what it gets there.
    """
    with TargetFeatureCapture(model, layers) as capture:
        logits = model(input_ids=input_ids, **forward_kwargs).logits
        return capture.features(), logits
