"""MTP drafters shipped as a model of their own that attend to the target's KV cache: Gemma 4's
assistant (`Gemma4AssistantForCausalLM`, e.g. google/gemma-4-e2b-it-assistant), which transformers
drives with its `SinglePositionMultiTokenCandidateGenerator` at batch size 1.

The assistant keeps no KV: each of its layers attends to the keys / values of the target's last
cache-writing layer of the same type (sliding or full: the target config's `kv_sharing_modes`
"store" layers). For a row whose target cache holds positions 0..P-1, with the token the target
emitted last (the pending token) at P, each draft step feeds one input:

    the target's input embedding of the last token (the pending one, then each draft)
    ++ a hidden state (the target's final-norm output at P - 1, then the assistant's own projected output),

always at position P (the assistant adds no keys, so nothing moves), attending to every held key in
full-attention layers and to the last `sliding_window` + 1 of them in sliding ones (what transformers'
flipped bidirectional window masks over the shared states select). transformers also hands it, after a
rejection, the key of the rejected draft at P; here it sees only the accepted context.

Here every drafting row runs in one packed forward per draft step over the target's own paged pools
(`PagedKVCache.describe_reads`): no copy of the context. The target's hidden states come through the
loop's feature capture (`target_feature_layers` = the final norm's output); the last one per row is kept.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from ..cache.paged_attention import ModelMask, use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..profiling import timed_forward
from ..transfer import to_device
from .base import DraftProposal, ProposeRequest
from .draft_model import load_draft_model
from .drafting import DraftSampling, DraftTokenPicker, collect_drafts, stack_draft_probs

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


def is_mtp_assistant(spec) -> bool:
    """Whether `speculative_config.model` is (or is the folder of) an assistant this module drives."""
    if isinstance(spec, PreTrainedModel):
        return spec.config.model_type in ASSISTANT_MODEL_TYPES
    if isinstance(spec, (str, os.PathLike)):  # a folder, or a Hub id in the local cache
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(os.fspath(spec), local_files_only=True).model_type in ASSISTANT_MODEL_TYPES
        except (OSError, ValueError):
            return False
    return False


def shared_kv_sources(target: PreTrainedModel, assistant: PreTrainedModel) -> dict[str, int]:
    """layer type -> the target layer whose keys / values the assistant's layers of that type read;
    ValueError naming what does not fit."""
    text, own = target.config.get_text_config(), assistant.config.get_text_config()
    modes, layer_types = getattr(text, "kv_sharing_modes", None), getattr(text, "layer_types", None)
    if not modes or not layer_types:
        raise ValueError(
            f"speculative_config.model is a {assistant.config.model_type} model, which attends to the target's KV "
            f"cache layers as Gemma 4 and Gemma 3n store them (kv_sharing_modes); model_type={text.model_type!r} has none"
        )
    stores = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    missing = sorted(set(own.layer_types) - set(stores))
    if missing:
        raise ValueError(f"speculative_config.model: the target stores no KV for the assistant's {missing} layers")
    backbone = getattr(assistant.config, "backbone_hidden_size", None)
    if backbone != text.hidden_size:
        raise ValueError(
            f"speculative_config.model: this assistant was built for a target of hidden size {backbone}; "
            f"the target's is {text.hidden_size}"
        )
    if assistant.lm_head.weight.shape[0] != target.get_output_embeddings().weight.shape[0]:
        raise ValueError(
            f"speculative_config.model: the assistant's vocabulary ({assistant.lm_head.weight.shape[0]}) is not the "
            f"target's ({target.get_output_embeddings().weight.shape[0]})"
        )
    return {layer_type: stores[layer_type] for layer_type in set(own.layer_types)}


def load_mtp_assistant(spec, target: PreTrainedModel) -> PreTrainedModel:
    """The assistant `spec` names (a loaded model, a folder or a Hub id; loaded as draft models are)."""
    assistant = load_draft_model(spec, target)
    if assistant.config.model_type not in ASSISTANT_MODEL_TYPES:
        raise ValueError(
            f"speculative_config.model for method='mtp' must be an assistant model ({', '.join(ASSISTANT_MODEL_TYPES)}), "
            f"got model_type={assistant.config.model_type!r}"
        )
    shared_kv_sources(target, assistant)
    return assistant


class MtpAssistantProposer:
    """Drafts with an assistant model over the target's paged KV cache (see the module docstring).

    Args:
        target: the target model (its input embeddings and final hidden states feed the assistant).
        assistant: the assistant (`load_mtp_assistant`).
        target_cache: the loop's `PagedKVCache` of the target, read in place.
        num_speculative_tokens: k, draft steps per row.
        sampling: greedy or sampled drafts (`DraftSampling.from_generate`).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        assistant: PreTrainedModel,
        target_cache: PagedKVCache,
        num_speculative_tokens: int,
        sampling: DraftSampling | None = None,
    ):
        self.target, self.assistant, self.cache = target, assistant.eval(), target_cache
        self.sources = shared_kv_sources(target, assistant)
        self.k = num_speculative_tokens
        self.device = target.device
        # hidden_states index L: the target's final norm output, which transformers hands the assistant
        self.target_feature_layers = (target.config.get_text_config().num_hidden_layers,)
        window = assistant.config.get_text_config().sliding_window
        # masks see the query at the row's last held position (`describe_reads`): every held key, and in
        # sliding layers the last window + 1 of them, which is what transformers' flipped bidirectional
        # window mask selects from the shared states (checked against it in the tests)
        self.masks = {"full_attention": ModelMask(causal_mask_function)}
        if window is not None:
            self.masks["sliding_attention"] = ModelMask(and_masks(causal_mask_function, sliding_window_overlay(window + 1)))
        self.picker = DraftTokenPicker(sampling or DraftSampling(), self.device)
        self._last_hidden: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (its position, the target's state there)

    def propose(self, request: ProposeRequest) -> DraftProposal:
        if request.target_features is None:
            raise RuntimeError("MtpAssistantProposer needs the target's hidden states (ProposeRequest.target_features)")
        rows = [int(r) for r in request.rows]
        drafting = []
        for i, row in enumerate(rows):
            waiting = request.target_features.take(row)
            if waiting.shape[0]:  # the last one is the target's state at the row's next-to-last position
                self._last_hidden[row] = (len(request.token_ids[i]) - 2, waiting[-1])
            held = self.cache.seq_lens.get(row, 0)
            kept = self._last_hidden.get(row)
            # one token pending (the target's last), and the state of the position before it
            if request.max_draft_tokens[i] > 0 and len(request.token_ids[i]) == held + 1 and kept and kept[0] == held - 1:
                drafting.append(i)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        if drafting:
            with torch.no_grad(), use_paged_attention(self.assistant):
                self._draft(request, drafting, drafts, probs)
        per_row_probs = [torch.stack(p) if p else None for p in probs]
        return DraftProposal(
            draft_token_ids=[np.array(d, dtype=np.int64) for d in drafts],
            draft_probs=stack_draft_probs(per_row_probs, self.device),
        )

    def _draft(self, request: ProposeRequest, drafting: list[int], drafts: list, probs: list) -> None:
        rows = [int(request.rows[i]) for i in drafting]
        offsets = request.position_offsets or [0] * len(request.rows)
        positions = np.array([len(request.token_ids[i]) - 1 + int(offsets[i]) for i in drafting], dtype=np.int64)
        tokens = np.array([request.token_ids[i][-1] for i in drafting], dtype=np.int64)
        tokens, positions = to_device([tokens, positions], self.device)
        hidden = torch.stack([self._last_hidden[row][1] for row in rows]).to(self.device, self.target.dtype)
        shared = {kind: (self.cache.layers[i].keys, self.cache.layers[i].values) for kind, i in self.sources.items()}
        max_draft = [min(int(request.max_draft_tokens[i]), self.k) for i in drafting]
        active = list(range(len(drafting)))  # indices into `drafting` of the rows still drafting
        steps = []
        # the rows' held keys do not change while drafting: one description (and its masks) per set of rows
        metadata = self.cache.describe_reads(rows)
        while active:
            logits, hidden = self._forward(tokens, hidden, positions, shared, metadata)
            picked, q = self.picker.pick(logits, [rows[j] for j in active])
            steps.append(([drafting[j] for j in active], picked, q))
            keep = [n for n, j in enumerate(active) if len(steps) < max_draft[j]]
            if len(keep) < len(active):
                (index,) = to_device([np.array(keep, dtype=np.int64)], self.device)
                picked, hidden, positions = picked.index_select(0, index), hidden.index_select(0, index), positions.index_select(0, index)
                active = [active[n] for n in keep]
                metadata = self.cache.describe_reads([rows[j] for j in active]) if active else None
            tokens = picked
        collect_drafts(steps, drafts, probs)

    def _forward(self, tokens, hidden, positions, shared, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for n rows: (logits `[n, vocab]`, the assistant's projected states `[n, target hidden]`).

        The assistant's own forward is not called: it builds its masks from the shared states' shapes
        as one batch row each, not the paged pools; these are its steps with the masks above."""
        assistant = self.assistant
        inputs = torch.cat([self.target.get_input_embeddings()(tokens), hidden], dim=-1)
        with timed_forward(self.device):
            last = assistant.model(
                inputs_embeds=assistant.pre_projection(inputs)[None],
                attention_mask=self.masks,
                position_ids=positions[None],
                shared_kv_states=shared,
                use_cache=False,
                # a tensor: its forward would otherwise cut the packed rows to the last `logits_to_keep`
                logits_to_keep=torch.arange(len(tokens), device=self.device),
                paged_metadata=metadata,
            ).last_hidden_state
            if assistant.config.use_ordered_embeddings:
                logits = assistant.masked_embedding(last, assistant.lm_head.weight)[0]
            else:
                logits = assistant.lm_head(last)[0]
            return logits, assistant.post_projection(last)[0]

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        for row in rows:
            self._last_hidden.pop(int(row), None)
        self.picker.release(rows)
