"""EAGLE and EAGLE-3 draft heads (seed §12.4.2), their checkpoint formats and loading.

A head drafts from the target's hidden states instead of from tokens alone:

- EAGLE (EAGLE-1/2, arXiv:2401.15077): the input of position i is `fc(concat(embed(t[i+1]), f[i]))`,
  where f[i] is the target's last hidden state (after the final norm: the lm_head input) at
  position i. One or more Llama decoder layers follow (the first without input_layernorm, as the
  authors built it); the output estimates f[i+1], so the *target's* lm_head turns it into a
  guess for t[i+2].
- EAGLE-3 (arXiv:2503.01840): f[i] is the concatenation of the target's hidden states at three
  depths (transformers' `hidden_states[2]`, `[L // 2]`, `[L - 3]`, i.e. the inputs of those
  decoder layers), fused by `fc` (3H -> H). The first decoder layer reads
  `concat(input_layernorm(embed), hidden_norm(feature))` (2H wide q/k/v); a final norm and the
  head's own lm_head score a reduced draft vocabulary, mapped back with `d2t`
  (target_id = draft_id + d2t[draft_id]). From the second draft step on, the head's own output
  (before the final norm) is the feature, not re-fused.

Embedding and lm_head are borrowed from the target whenever the checkpoint does not carry them.
The decoder layers are transformers' own Llama modules, so the head runs through the same paged
KV cache and attention function as the target (`use_paged_attention(head)`).

Checkpoints load from our own format (`EagleHead.save_pretrained`: config.json with
`"format": "hf_specdec.eagle_head"` + model.safetensors), the EAGLE authors' layouts
(SafeAILab/EAGLE: EAGLE-1/2 heads `fc.*`, `layers.N.*`; EAGLE-3 heads `midlayer.*`, `d2t`, `t2d`,
which SpecForge writes too) and the vLLM speculators EAGLE-3 layout (`layers.N.*`, config with
`transformer_layer_config`). Tensors come from safetensors, or from `pytorch_model.bin` through
`torch.load(..., weights_only=True)` only; no remote code ever runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from ..models.feature_capture import decoder_parts
from .head_config import (
    _SAVED_DECODER_KEYS,
    CONFIG_FILE,
    FORMAT_NAME,
    WEIGHTS_FILE,
    EagleHeadConfig,
    _decoder_config,
    default_eagle3_feature_layers,
)
from .hub import DEFAULT_COMMIT_MESSAGE, push_head_folder


class Eagle3FirstDecoderLayer(LlamaDecoderLayer):
    """The EAGLE-3 first layer: transformers' Llama layer with 2H-wide q/k/v and a `hidden_norm`.

    Attention itself is `LlamaAttention.forward` (rotary, cache update, the attention function
    the config names), so the layer works with the paged cache like the target's layers.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int = 0, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        attention = self.self_attn
        width = 2 * config.hidden_size
        bias = config.attention_bias
        attention.q_proj = nn.Linear(width, config.num_attention_heads * attention.head_dim, bias=bias)
        attention.k_proj = nn.Linear(width, config.num_key_value_heads * attention.head_dim, bias=bias)
        attention.v_proj = nn.Linear(width, config.num_key_value_heads * attention.head_dim, bias=bias)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.hidden_norm(hidden_states)
        if self.norm_before_residual:
            residual = hidden_states
        hidden_states = torch.cat([self.input_layernorm(embeds), hidden_states], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + attended
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class EagleHead(nn.Module):
    """An EAGLE or EAGLE-3 draft head.

    `forward` maps (tokens, features) pairs to the head's hidden states (the features of the next
    step); `compute_logits` scores them (target vocabulary for EAGLE, draft vocabulary for
    EAGLE-3: map with `draft_to_target`). Borrowed modules (`bind_target`) are not part of the
    state dict and are never saved.
    """

    def __init__(self, head_config: EagleHeadConfig):
        super().__init__()
        self.head_config = head_config
        config = head_config.decoder
        self.config = config  # what use_paged_attention and PagedKVCache read
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if head_config.own_embed_tokens else None
        if head_config.method == "eagle":
            self.fc = nn.Linear(2 * hidden, hidden, bias=head_config.fc_bias)
            layers = [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
            if not head_config.first_layer_input_norm:
                # the authors feed fc's output straight into attention (cnets1.py: index 0 has no norm)
                layers[0].input_layernorm = nn.Identity()
            self.norm = None
        else:
            fc_in = head_config.num_target_features * head_config.target_hidden_size
            self.fc = nn.Linear(fc_in, hidden, bias=head_config.fc_bias)
            layers = [Eagle3FirstDecoderLayer(config, 0, head_config.norm_before_residual)]
            layers += [LlamaDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)]
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = None
        if head_config.own_lm_head:
            self.lm_head = nn.Linear(hidden, head_config.draft_vocab_size or config.vocab_size, bias=False)
        if head_config.method == "eagle3":
            draft_vocab = head_config.draft_vocab_size or config.vocab_size
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        # target modules used in place of missing ones; a plain dict keeps them out of the state dict
        self._borrowed: dict[str, nn.Module] = {}

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target: nn.Module,
        method: str,
        num_layers: int = 1,
        draft_vocab: Sequence[int] | torch.Tensor | None = None,
        target_feature_layers: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> EagleHead:
        """A randomly initialised head shaped for `target` (what a trainer starts from).

        The decoder layers copy the target's attention / MLP sizes. `draft_vocab` (EAGLE-3): the
        target ids the draft vocabulary covers, in draft-id order; None = the whole vocabulary.
        `seed` makes the initialisation reproducible without touching the global RNG.
        """
        text = target.config.get_text_config()
        # the head's layer copies the target's first one: heterogeneous configs (Gemma 4's head sizes)
        # refuse to give a global value, and some sizes are per-layer lists (Gemma 3n's intermediate_size)
        first = text.per_layer_config[0] if getattr(text, "per_layer_config", None) else text
        sizes = {k: getattr(first, k) for k in _SAVED_DECODER_KEYS if getattr(first, k, None) is not None}
        sizes = {k: v[0] if isinstance(v, (list, tuple)) else v for k, v in sizes.items()}
        rope = sizes.get("rope_parameters")
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
            sizes["rope_parameters"] = rope.get("full_attention") or next(iter(rope.values()))
        decoder = LlamaConfig(**sizes)
        decoder.num_hidden_layers = num_layers
        decoder.attention_bias = bool(getattr(text, "attention_bias", False))
        decoder.mlp_bias = bool(getattr(text, "mlp_bias", False))
        if method == "eagle3":
            feature_layers = (
                tuple(target_feature_layers)
                if target_feature_layers is not None
                else default_eagle3_feature_layers(text.num_hidden_layers)
            )
            draft_ids = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
            head_config = EagleHeadConfig(
                method=method,
                decoder=decoder,
                target_hidden_size=text.hidden_size,
                draft_vocab_size=None if draft_ids is None else len(draft_ids),
                target_feature_layers=feature_layers,
                num_target_features=len(feature_layers),
                own_lm_head=True,
            )
        else:
            draft_ids = None
            # the authors' EAGLE-1/2 choices: fc with bias, no input_layernorm on layer 0
            head_config = EagleHeadConfig(
                method=method,
                decoder=decoder,
                target_hidden_size=text.hidden_size,
                fc_bias=True,
                first_layer_input_norm=False,
            )
        with torch.random.fork_rng(devices=[]):  # a seed here leaves the caller's RNG alone
            if seed is not None:
                torch.manual_seed(seed)
            head = cls(head_config)
        if draft_ids is not None:
            head.set_draft_vocab(draft_ids)
        return head.to(dtype=target.dtype, device=target.device).bind_target(target).eval()

    def set_draft_vocab(self, draft_to_target_ids: torch.Tensor) -> None:
        """Set `d2t` / `t2d` from the target id of every draft id (EAGLE-3)."""
        ids = torch.as_tensor(draft_to_target_ids, dtype=torch.long, device=self.d2t.device)
        if ids.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, the head's lm_head scores {self.d2t.numel()}")
        if ids.min() < 0 or ids.max() >= self.t2d.numel():
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.t2d.numel()}) (the target vocabulary)")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def bind_target(self, target: nn.Module) -> EagleHead:
        """Check the head fits `target` and borrow its embedding / lm_head where the head has none."""
        check_head_fits_target(self, target)
        self._borrowed = {}
        if self.embed_tokens is None:
            self._borrowed["embed_tokens"] = target.get_input_embeddings()
        if self.lm_head is None:
            self._borrowed["lm_head"] = target.get_output_embeddings()
        return self

    # --- what the drafter asks -------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.head_config.method

    def feature_layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The target's `hidden_states` indices whose concatenation is this head's input feature."""
        if self.method == "eagle":
            return (num_target_layers,)  # the final norm's output: the lm_head input
        layers = self.head_config.target_feature_layers
        return tuple(layers) if layers is not None else default_eagle3_feature_layers(num_target_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._borrowed_module("embed_tokens"))(input_ids)

    def forward(
        self,
        input_ids: torch.LongTensor,
        features: torch.Tensor,
        position_ids: torch.LongTensor,
        fuse_features: bool = True,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """Hidden states `[batch, tokens, H]` of the (feature, token) pairs.

        Args:
            input_ids: `[batch, tokens]` the token paired with each feature (the one after it).
            features: `[batch, tokens, F]`: target features (EAGLE: H; EAGLE-3: fused here when
                `fuse_features`), or the head's own previous outputs (`fuse_features=False`).
            position_ids: `[batch, tokens]` the position of each feature.
            cache / attention_kwargs: the paged cache and `paged_metadata` inside generate; None
                for a plain causal forward over whole sequences.
            attention_mask: None (causal), or the boolean `[batch, 1, tokens, keys]` mask a trainer
                uses when it unrolls draft steps over a cache of earlier steps (training-time test).
        """
        embeds = self.embed(input_ids).to(features.dtype)
        if self.method == "eagle":
            hidden_states = self.fc(torch.cat([embeds, features], dim=-1))
        else:
            hidden_states = self.fc(features) if fuse_features else features
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for i, layer in enumerate(self.layers):
            layer_inputs = (embeds, hidden_states) if (i == 0 and self.method == "eagle3") else (hidden_states,)
            hidden_states = layer(
                *layer_inputs,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                position_embeddings=position_embeddings,
                **attention_kwargs,
            )
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """EAGLE: the target's lm_head on the predicted feature; EAGLE-3: own lm_head after the norm."""
        return self.output_head()(self.lm_head_input(hidden_states))

    def lm_head_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What `output_head()` scores: the head's hidden states, after its final norm (EAGLE-3)."""
        return hidden_states if self.norm is None else self.norm(hidden_states)

    def output_head(self) -> nn.Module:
        """The linear layer that scores drafts: the head's own lm_head, or the target's (EAGLE)."""
        return self.lm_head or self._borrowed_module("lm_head")

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity for EAGLE)."""
        if self.method == "eagle":
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def _borrowed_module(self, name: str) -> nn.Module:
        module = self._borrowed.get(name)
        if module is None:
            raise RuntimeError(
                f"this EAGLE head has no {name} of its own: call head.bind_target(target_model) first"
            )
        return module

    # --- our checkpoint format -------------------------------------------------------------------
    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """config.json + model.safetensors (borrowed embedding / lm_head are not written)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(self.head_config.to_json(), indent=2) + "\n")
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "hf_specdec": FORMAT_NAME})

    @classmethod
    def from_pretrained(
        cls, source: str | os.PathLike, target: nn.Module | None = None, method: str | None = None
    ) -> EagleHead:
        """Load any supported layout (see `load_eagle_head`)."""
        return load_eagle_head(source, target=target, method=method)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        private: bool | None = None,
        commit_message: str | None = None,
        revision: str | None = None,
        card_fields: dict[str, Any] | None = None,
    ) -> str:
        """Save the head with a model card into a temporary folder and upload it; returns the commit URL.

        `card_fields` (see `hf_specdec.heads.model_card`) needs at least `base_model`, the target's Hub
        id; the method, layers, draft vocabulary and `repo_id` are filled in from the head.
        """
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder)
            return push_head_folder(
                folder,
                repo_id,
                token=token,
                private=private,
                commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                revision=revision,
                card_fields=card_fields or {},
            )


# --- checking a head against its target ---------------------------------------------------------
def check_head_fits_target(head: EagleHead, target: nn.Module) -> None:
    """Raise ValueError naming what differs when `head` was not built for `target`."""
    text = target.config.get_text_config()
    config = head.head_config
    model_type = getattr(text, "model_type", None)
    try:
        layers, _ = decoder_parts(target)
    except ValueError as error:
        raise ValueError(f"target architecture model_type={model_type!r}: {error}; EAGLE reads features there") from error
    if config.target_hidden_size != text.hidden_size:
        raise ValueError(
            f"EAGLE head does not fit the target: hidden size: the head reads target features of size "
            f"{config.target_hidden_size}, the target's hidden_size is {text.hidden_size}"
        )
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if config.vocab_size != target_vocab:
        raise ValueError(
            f"EAGLE head does not fit the target: vocabulary: the head was built for vocab_size "
            f"{config.vocab_size}, the target's lm_head has {target_vocab} rows"
        )
    borrowed = [n for n, own in (("embedding", config.own_embed_tokens), ("lm_head", config.own_lm_head)) if not own]
    if borrowed and config.hidden_size != text.hidden_size:
        raise ValueError(
            f"EAGLE head does not fit the target: hidden size: the head's hidden_size is {config.hidden_size}, "
            f"the target's {text.hidden_size}, and the head borrows the target's {' and '.join(borrowed)}"
        )
    num_layers = len(layers)
    for index in head.feature_layers_for(num_layers):
        if not 0 <= index <= num_layers:
            raise ValueError(
                f"EAGLE head does not fit the target: target_feature_layers: hidden_states index {index} "
                f"is outside [0, {num_layers}] (the target has {num_layers} decoder layers)"
            )
    if config.method == "eagle3":
        if int((head.d2t + torch.arange(len(head.d2t), device=head.d2t.device)).max()) >= target_vocab:
            raise ValueError(
                f"EAGLE head does not fit the target: vocabulary: d2t maps draft ids to target ids >= {target_vocab}"
            )


# --- loading ------------------------------------------------------------------------------------
def resolve_head_folder(source: str | os.PathLike) -> Path:
    """A local folder as is; anything else is a Hub id, fetched (or found offline in the HF cache)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"EAGLE head {str(source)!r} is a file; give the folder holding config.json and the weights")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors", "pytorch_model*.bin"])
        )
    except Exception as error:  # noqa: BLE001 - every failure to find it means the same to the user
        raise ValueError(
            f"EAGLE head {str(source)!r} is neither a local folder nor a Hub model that could be fetched or "
            f"found in the Hugging Face cache ({type(error).__name__}: {error})"
        ) from error


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: safetensors preferred, `.bin` only via weights_only."""
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in safetensors:
            state.update(load_file(str(file)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"no weights in {str(folder)!r}: expected *.safetensors or pytorch_model.bin")
    state = {}
    for file in bins:
        try:
            loaded = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001
            raise ValueError(
                f"{str(file)!r} does not load with torch.load(weights_only=True) (it is not a plain tensor "
                f"checkpoint; convert it to safetensors): {error}"
            ) from error
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(f"{str(file)!r} is not a state dict of tensors")
        state.update(loaded)
    return state


def detect_layout(config: dict, names: set[str]) -> str:
    """'hf_specdec', 'speculators', 'eagle3' (authors / SpecForge) or 'eagle' (authors' EAGLE-1/2)."""
    if config.get("format") == FORMAT_NAME:
        return "hf_specdec"
    if "speculators_model_type" in config or "transformer_layer_config" in config:
        kind = config.get("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise ValueError(
                f"speculators checkpoint type {kind!r} is not supported; supported: eagle3 "
                "(EAGLE-1 heads load from the authors' layout)"
            )
        return "speculators"
    if any(n.startswith("midlayer.") for n in names) or "draft_vocab_size" in config or "d2t" in names:
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.") for n in names):
        return "eagle"
    raise ValueError(
        "unrecognised EAGLE checkpoint: expected our config.json (format hf_specdec.eagle_head), an EAGLE-1/2 "
        "head (fc.weight + layers.N.*), an EAGLE-3 head (midlayer.* or draft_vocab_size / d2t) or a speculators "
        f"config; got tensors {sorted(names)[:8]}..."
    )


def _convert_authors_eagle(config: dict, state: dict[str, torch.Tensor]) -> tuple[EagleHeadConfig, dict]:
    decoder = _decoder_config(config)
    head_config = EagleHeadConfig(
        method="eagle",
        decoder=decoder,
        target_hidden_size=decoder.hidden_size,
        fc_bias="fc.bias" in state,
        first_layer_input_norm="layers.0.input_layernorm.weight" in state,
        own_embed_tokens="embed_tokens.weight" in state,
        own_lm_head="lm_head.weight" in state,
    )
    return head_config, state


def _eagle3_head_config(
    decoder_dict: dict, top: dict, state: dict[str, torch.Tensor], feature_layers: Sequence[int] | None
) -> EagleHeadConfig:
    decoder = _decoder_config(decoder_dict)
    target_hidden = top.get("target_hidden_size") or decoder.hidden_size
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError("EAGLE-3 checkpoint lacks fc.weight (the fusion of the target's hidden states)")
    if fc.shape[1] % target_hidden:
        raise ValueError(
            f"EAGLE-3 checkpoint: fc.weight has {fc.shape[1]} input features, not a multiple of the target "
            f"hidden size {target_hidden}"
        )
    draft_vocab = top.get("draft_vocab_size")
    if draft_vocab is None and "lm_head.weight" in state:
        draft_vocab = state["lm_head.weight"].shape[0]
    return EagleHeadConfig(
        method="eagle3",
        decoder=decoder,
        target_hidden_size=target_hidden,
        draft_vocab_size=draft_vocab,
        target_feature_layers=None if feature_layers is None else tuple(feature_layers),
        num_target_features=fc.shape[1] // target_hidden,
        fc_bias="fc.bias" in state,
        norm_before_residual=bool(top.get("norm_before_residual", False)),
        own_embed_tokens="embed_tokens.weight" in state,
        own_lm_head=True,
    )


def _convert_authors_eagle3(config: dict, state: dict[str, torch.Tensor]) -> tuple[EagleHeadConfig, dict]:
    # the authors and SpecForge name the single layer `midlayer`; vLLM reads it as layers.0
    state = {("layers.0." + k[len("midlayer.") :]) if k.startswith("midlayer.") else k: v for k, v in state.items()}
    feature_layers = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM: hidden_states indices already
    eagle_config = config.get("eagle_config") or {}
    if feature_layers is None and eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
        # SGLang / SpecForge name the layer whose *output* is taken: hidden_states index = id + 1
        feature_layers = [i + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
    return _eagle3_head_config(config, config, state, feature_layers), state


def _convert_speculators(config: dict, state: dict[str, torch.Tensor]) -> tuple[EagleHeadConfig, dict]:
    decoder = config.get("transformer_layer_config")
    if not isinstance(decoder, dict):
        raise ValueError("speculators EAGLE-3 config lacks transformer_layer_config")
    # the verifier's own norm / lm_head are training-only copies of the target's
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    return _eagle3_head_config(decoder, config, state, config.get("eagle_aux_hidden_state_layer_ids")), state


_CONVERTERS = {
    "eagle": _convert_authors_eagle,
    "eagle3": _convert_authors_eagle3,
    "speculators": _convert_speculators,
}


def head_from_checkpoint(config: dict, state: dict[str, torch.Tensor], method: str | None = None) -> EagleHead:
    """Build a head from a config dict and tensors of any supported layout."""
    layout = detect_layout(config, set(state))
    if layout == "hf_specdec":
        head_config = EagleHeadConfig.from_json(config)
    else:
        head_config, state = _CONVERTERS[layout](config, state)
    if method is not None and method != head_config.method:
        kinds = {"eagle": "an EAGLE (EAGLE-1/2) head", "eagle3": "an EAGLE-3 head"}
        raise ValueError(
            f"speculative_config.method={method!r} but the checkpoint is {kinds[head_config.method]} "
            f"(layout: {layout}); use method={head_config.method!r}"
        )
    head = EagleHead(head_config)
    _load_tensors(head, state, layout)
    return head


def _load_tensors(head: EagleHead, state: dict[str, torch.Tensor], layout: str) -> None:
    expected = head.state_dict()
    optional = {"d2t", "t2d"}  # absent: identity map / every target id drafted
    missing = sorted(set(expected) - set(state) - optional)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"EAGLE checkpoint ({layout} layout) does not match the head its config describes: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for name, tensor in state.items():
        want = expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(
                f"EAGLE checkpoint ({layout} layout): {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(want.shape)}"
            )
    state = dict(state)
    if "t2d" in state:
        state["t2d"] = state["t2d"].to(torch.bool)
    elif "d2t" in state:
        ids = state["d2t"].long() + torch.arange(state["d2t"].numel())
        t2d = torch.zeros_like(expected["t2d"])
        t2d[ids.clamp(max=t2d.numel() - 1)] = True
        state["t2d"] = t2d
    if "d2t" in state:
        state["d2t"] = state["d2t"].to(torch.long)
    head.load_state_dict(state, strict=False)


def load_eagle_head(
    source: str | os.PathLike, target: nn.Module | None = None, method: str | None = None
) -> EagleHead:
    """Load a head from a folder or Hub id, in any supported layout.

    With `target`, the head is checked against it (ValueError naming what differs), moved to its
    device and dtype, and borrows its embedding / lm_head where the checkpoint has none.
    `method` ("eagle" / "eagle3"), when given, must match the checkpoint.
    """
    folder = resolve_head_folder(source)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"EAGLE head {str(source)!r} has no config.json")
    config = json.loads(config_file.read_text())
    head = head_from_checkpoint(config, read_state_dict(folder), method=method)
    if target is not None:
        head = head.to(device=target.device, dtype=target.dtype).bind_target(target)
    return head.eval()
