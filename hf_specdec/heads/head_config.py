"""What shapes an EAGLE / EAGLE-3 head (`EagleHeadConfig`) and the file names of our checkpoint format.

Apart from `eagle_heads.py` (the module and loading) so that `hub.py` can read a head folder's
config without importing the module that publishes through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import LlamaConfig

FORMAT_NAME = "hf_specdec.eagle_head"
FORMAT_VERSION = 1
METHODS = ("eagle", "eagle3")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# LlamaConfig fields a head's decoder layers use; everything else in a foreign config.json is ignored
_DECODER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "pad_token_id",
)
_SAVED_DECODER_KEYS = tuple(k for k in _DECODER_KEYS if k not in ("rope_theta", "rope_scaling"))


def default_eagle3_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's / the EAGLE-3 authors' default: inputs of layers 2, L // 2 and L - 3.

    Tiny targets (L < 5) would get indices outside [0, L]; they are clamped into it.
    """
    return tuple(min(max(i, 0), num_target_layers) for i in (2, num_target_layers // 2, num_target_layers - 3))


@dataclass
class EagleHeadConfig:
    """Everything that shapes a head; `to_json` / `from_json` are our checkpoint's config.json.

    `target_feature_layers` are indices into transformers' `hidden_states` of the target:
    i < L is the input of decoder layer i, L the output of the final norm (what EAGLE reads).
    """

    method: str  # "eagle" or "eagle3"
    decoder: LlamaConfig  # the head's decoder layers (num_hidden_layers = head layers, vocab_size = target's)
    target_hidden_size: int  # width of one target feature
    draft_vocab_size: int | None = None  # EAGLE-3: rows of the head's own lm_head; None = target vocab
    target_feature_layers: tuple[int, ...] | None = None  # EAGLE-3: None = default_eagle3_feature_layers
    num_target_features: int = 1  # how many target hidden states are concatenated (EAGLE-3: 3)
    fc_bias: bool = False
    first_layer_input_norm: bool = True  # False: layer 0 has no input_layernorm (EAGLE-1 authors)
    norm_before_residual: bool = False  # EAGLE-3: residual taken after hidden_norm (speculators option)
    own_embed_tokens: bool = False  # False: borrow the target's input embedding
    own_lm_head: bool = False  # False: borrow the target's lm_head (EAGLE); EAGLE-3 heads carry one

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"EAGLE head method={self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        if self.method == "eagle3" and not self.own_lm_head:
            raise ValueError("an EAGLE-3 head needs its own lm_head (over the draft vocabulary)")
        if self.target_feature_layers is not None:
            self.target_feature_layers = tuple(int(i) for i in self.target_feature_layers)
            if len(self.target_feature_layers) != self.num_target_features:
                raise ValueError(
                    f"target_feature_layers={list(self.target_feature_layers)} names "
                    f"{len(self.target_feature_layers)} target layers, but the head's fc reads "
                    f"{self.num_target_features} features"
                )
        # the decoder layers run through whatever attention the config names: SDPA (causal when
        # no mask is given) outside generate, the paged function inside (use_paged_attention)
        self.decoder._attn_implementation = "sdpa"

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def num_layers(self) -> int:
        return self.decoder.num_hidden_layers

    def to_json(self) -> dict:
        decoder = {k: getattr(self.decoder, k) for k in _SAVED_DECODER_KEYS if getattr(self.decoder, k, None) is not None}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "decoder"}
        if fields["target_feature_layers"] is not None:
            fields["target_feature_layers"] = list(fields["target_feature_layers"])
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **fields, "decoder": decoder}

    @classmethod
    def from_json(cls, data: dict) -> EagleHeadConfig:
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not an {FORMAT_NAME} config (format={data.get('format')!r})")
        if data.get("format_version", 1) > FORMAT_VERSION:
            raise ValueError(
                f"{FORMAT_NAME} format_version {data['format_version']} is newer than this hf_specdec "
                f"understands ({FORMAT_VERSION}); upgrade hf_specdec"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and k != "decoder"}
        return cls(decoder=_decoder_config(data["decoder"]), **kwargs)


def _decoder_config(data: dict) -> LlamaConfig:
    model_type = data.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"EAGLE head decoder architecture model_type={model_type!r} is not supported; supported: llama "
            "(the layout the EAGLE authors, SpecForge and vLLM use for their heads)"
        )
    return LlamaConfig(**{k: data[k] for k in _DECODER_KEYS if k in data})
