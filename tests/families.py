"""Tiny random causal LMs for every model family transformers knows, for family-matrix identity tests.

`causal_lm_families()` lists every model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`
(so a new transformers release adds rows by itself) and `build_tiny_model(model_type)` builds the
mapping's class for it with tiny sizes (fp32, eval mode, CPU), so that a parametrised test can
compare speculative generate() with plain `model.generate()` on each family. Special ids: pad 0,
eos 1, bos 2 (on the config and on `model.generation_config`); prompts may use ids 3..127.

Sizes come from a generic shrink (`_SIZES`, applied to whatever fields a config has, through its
attribute_map and recursively into sub-configs) plus a per-family override table (`_OVERRIDES`)
for what the generic shrink gets wrong. Per-layer lists (`layer_types`, `mlp_layer_types`, ...)
are cut down to a few layers that keep one layer of every kind the full-size model has (sliding
and full attention, linear attention / mamba / conv, dense and MoE MLPs...). Local attention is
made to bite: sliding windows and attention chunks of 8, soft-caps of 5 / 10, DSA top-k of 16.
`_INIT_SCALE` / `_UNTIE` are per-family tunings that keep greedy output from degenerating (one
token repeated, near-tied top-2 logits) on random 20-40 token prompts.

`FAMILY_NOTES`: the families whose tiny model cannot be built, or whose *plain* transformers
generate() fails on a text-only left-padded batch, and why. `LEFT_PADDING_NOTES`: families that
do plain-generate, but where a left-padded row differs from the same prompt run alone.
`describe(model)` summarises which attention features a tiny model exercises.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1
BOS_TOKEN_ID = 2
FIRST_FREE_TOKEN_ID = 3  # prompts may use 3..VOCAB_SIZE-1
SLIDING_WINDOW = 8  # shorter than the test prompts, so the window really cuts

# Generic tiny sizes, by config field name. A name is applied when the config class has a field of
# that name or an attribute_map alias for it (gpt2 `n_embd` is reached through `hidden_size`).
_SIZES: dict[str, Any] = {
    # core dims (before the layer / head names: the first name that resolves to a field wins)
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    # encoder-decoder families reach their causal LM through the decoder_* names
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "d_inner": 128,
    "dff": 128,
    "dim_ff": 128,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "first_dense_intermediate_size": 128,
    "mlp_only_intermediate_size": 128,
    "max_target_positions": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "max_seq_len": 256,
    "context_length": 256,
    # MoE: 4 experts, 2 per token, small experts, one dense first layer
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "moe_topk": 2,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "moe_layer_start_index": 1,
    # MLA: all five differ, so a swapped dimension cannot go unnoticed
    "kv_lora_rank": 24,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 20,
    # partial rotary (codegen / gptj): less than head_dim
    "rotary_dim": 8,
    # sparse (DSA-style) indexers: top-k below the sequence length so the selection bites; 16 heads,
    # as with 2 a quarter of the keys score exactly 0 (ReLU'd on both heads) and top-k ties among them
    # are broken by layout, which even transformers' cached and uncached forwards then do differently
    "index_head_dim": 16,
    "index_n_heads": 16,
    "index_topk": 16,
    # local attention of every flavour
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_size": SLIDING_WINDOW,
    "attention_window_size": SLIDING_WINDOW,
    "attention_chunk_size": SLIDING_WINDOW,
    "use_sliding_window": True,
    "max_window_layers": 1,
    # soft-capping: small values so the tanh actually changes the logits
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 10.0,
    "logits_soft_cap": 10.0,
    # Cohere's logit_scale (0.0625) squeezes a random model's logits into near-ties
    "logit_scale": 1.0,
    # linear attention / SSM / conv layers
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_d_head": 16,
    "mamba_chunk_size": 16,
    "mamba_d_ssm": 128,
    "ssm_state_size": 16,
    "state_size": 16,
    "chunk_size": 16,
    "n_mamba_heads": 4,
    "time_step_rank": 8,
    # separate sizes of sliding-window layers (inkling) and of grouped low-rank output projections
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "o_lora_rank": 16,
    "laurel_rank": 8,
    # per-layer-input embeddings (gemma3n / gemma4) are vocab-sized
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "hidden_size_per_layer_input": 16,
    "unpadded_vocab_size": VOCAB_SIZE,
    # vision / audio towers of composite models: small, they are only built, never run
    "depth": 2,
    "out_hidden_size": 64,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
    "vision_output_dim": 64,
    "mlp_dim": 128,
}

# Weight-init scale names (set to the family's `_INIT_SCALE`, default `DEFAULT_INIT_SCALE`).
_INIT_NAMES = ("initializer_range", "init_std", "initializer_factor")
DEFAULT_INIT_SCALE = 0.2

# Applied only when the family's default is set (not None / 0 / False): these switch features on.
_ONLY_IF_SET = {
    "q_lora_rank",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "logits_soft_cap",
    "logit_scale",
    "shared_expert_intermediate_size",
    "shared_experts_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "first_k_dense_replace",
    "num_dense_layers",
    "moe_layer_start_index",
    "num_experts",
    "n_group",
    "topk_group",
    "attention_chunk_size",
    "hidden_size_per_layer_input",
    "index_topk",
}

# Layer counts: every one of these a config has is set to the tiny layer count.
_LAYER_COUNT_NAMES = (
    "num_hidden_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_layers",
)
_MIN_LAYERS = 2

# Per-layer lists of layer *indices* (not one entry per layer): remapped onto the kept layers.
_INDEX_LIST_NAMES = {
    "mlp_only_layers",
    "moe_layers",
    "full_attn_idxs",
    "hybrid_layer_ids",
    "index_layers",
    "attn_layer_indices",
    "local_layer_ids",
    "ple_layer_ids",
    "mtp_local_layer_ids",
}

# Per-layer kind lists (what a layer is): the tiny model keeps one layer of every kind.
_KIND_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "attention_layers", "block_types")

# Per-family fixes on top of the generic shrink, by model_type. Keys are config field names (or
# attribute_map aliases); a dict value for a sub-config key is applied to that sub-config; a list for
# a per-layer field (layer_types...) sets the layer count.
_ASSISTANT = {"backbone_hidden_size": 64, "num_centroids": 16, "centroid_intermediate_top_k": 4}
_OVERRIDES: dict[str, dict[str, Any]] = {
    # --- configs the generic shrink cannot satisfy on its own
    # DbrxAttention reads attn_config.rope_theta, which only checkpoints' configs carry; clip_qkv None
    # breaks its clamp
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"moe_top_k": 2},
    },
    # Dots1 always builds shared experts (n_shared_experts None would multiply by None)
    "dots1": {"n_shared_experts": 1, "first_k_dense_replace": 1},
    # the default rope_parameters have no per-layer-type entries; checkpoints use NoPE global layers
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
    },
    # gpt_neo expands attention_types into attention_layers and checks them against num_layers
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": SLIDING_WINDOW},
    # hidden_size * expand must equal num_heads * head_dim
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2},
    # qk_dim (hidden_size * qk_dim_factor) must be a multiple of 64, or the chunkwise kernel mis-shapes
    # its state
    "xlstm": {"num_heads": 4, "qk_dim_factor": 1.0},
    # ZAYA supports top-1 routing only
    "zaya": {"num_experts_per_tok": 1, "layer_types": ["hybrid_sliding", "hybrid"]},
    # two attention sub-layers per num_layers; head_dim is the rope part of the MLA query
    "longcat_flash": {"num_layers": 1, "head_dim": 8, "zero_expert_num": 2},
    # MPT's config defaults to use_cache=False
    "mpt": {"use_cache": True},
    # the causal-LM variant (CLM checkpoints); its generate() appends config.mask_token_id every step
    "xlm": {"causal": True, "mask_token_id": BOS_TOKEN_ID},
    # the decoder (causal) variant; the axial position shape must multiply to max_position_embeddings;
    # a fixed hash_seed makes the LSH bucketing deterministic
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [16, 16],
        "axial_pos_embds_dim": [32, 32],
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "hash_seed": 0,
    },
    # byte-level model with an entropy patcher: the hashed n-gram tables are huge by default
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_hash_byte_group_size": [3, 4],
        "encoder_config": {"hidden_size_global": 64},
        "decoder_config": {"hidden_size_global": 64},
    },
    # HCA pools 128 positions by default: 16 so the pooled blocks fill within a test sequence
    "deepseek_v4": {
        "o_groups": 2,
        "hc_mult": 2,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    },
    # extra (glyph shape / pronunciation) embedding tables are large by default
    "roc_bert": {
        "shape_vocab_size": 32,
        "shape_embed_dim": 16,
        "pronunciation_vocab_size": 32,
        "pronunciation_embed_dim": 16,
    },
    # composite models: keep the never-run towers small
    "phi4_multimodal": {
        "audio_config": {
            "nemo_conv_channels": 32,
            "depthwise_separable_out_channel": 32,
            "ext_pw_out_channel": 32,
            "num_blocks": 2,
        }
    },
    "got_ocr2": {"vision_config": {"image_size": 256, "output_channels": 64}},
    # one codebook, so input_ids of shape (batch, seq) are what the decoder expects
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
    # --- per-layer head sizes (heterogeneous configs)
    # Gemma 4: full-attention layers get their own (larger) head_dim through per_layer_config
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # Mistral Large 4: layer 1 reuses layer 0's latents and top-k indices; layer 3 has no RoPE (its
    # "reuse_but_indexer" layers: `test_architectures.py`)
    "mistral_large4": {"text_config": {"kv_source_layers": [0, 0, 2, 3], "indexer_types": ["full", "shared", "full", "full"]}},
    # Gemma 4 as its small checkpoints (E2B / E4B) ship it: the last layers reuse the KV of the last
    # sliding and full layers before them (the text row above stays without sharing, as the large ones)
    "gemma4": {
        "text_config": {
            "global_head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "num_kv_shared_layers": 2,
        }
    },
    "gemma4_unified": {"text_config": {"global_head_dim": 32}},
    # drafter heads: per-layer inputs off (their configs require it), every layer reads the target's KV
    "gemma4_assistant": {
        **_ASSISTANT,
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "global_head_dim": 32,
        },
    },
    "gemma4_unified_assistant": {**_ASSISTANT, "text_config": {"global_head_dim": 32}},
    # sliding layers get their own MLA sizes (swa_* become per_layer_config); DSA layers:
    # head_dim = nope + rope
    "dots3_note_text": {
        "head_dim": 20,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "swa_q_lora_rank": 28,
        "swa_kv_lora_rank": 36,
        "swa_head_dim": 24,
        "swa_qk_nope_head_dim": 14,
        "swa_qk_rope_head_dim": 10,
        "swa_v_head_dim": 18,
    },
    # --- cross-layer KV sharing
    # 4 layers: 2 cache producers (sliding, full) and 2 layers reading their KV
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    # the second indexed layer reads the first one's KV (index_layers / kv_source_layers are
    # re-derived for the 4 layers)
    "kolibri1_1": {
        "layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        "index_layers": None,
        "kv_source_layers": None,
        "mlp_only_layers": None,
        "index_num_heads": 2,
        "index_num_local_tokens": 8,
        "index_pool_size": 256,
    },
    # --- hybrids whose layer kinds come from periods / index lists, or whose default lacks a kind
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},  # default: no attention layer at all
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # default: all mamba
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},  # default: all attention
    # layer_types is required (checkpoints give it): conv and attention layers, dense and MoE MLPs
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 2},
    # mamba / dense, mamba / MoE, attention / dense
    "jamba": {
        "num_hidden_layers": 3,
        "attn_layer_period": 3,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    # block_types cycle recurrent, recurrent, attention; the recurrent blocks' init ignores initializer_range
    "recurrent_gemma": {"num_hidden_layers": 3, "w_init_variance_scale": 4.0},
    # the shared transformer is tied across hybrid layers: it needs two of them
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # indexed (QSA) layers need the indexer sizes
    "qwen4_exp_text": {
        "layer_types": ["linear_attention", "linear_attention", "indexed_attention"],
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 16,
    },
    # 1 input, 2 recurrent (looped), 1 output layer
    "dory": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "n_input_layers": 1,
        "n_output_layers": 1,
        "n_recurrent_layers": None,
    },
}
# image-text-to-text families (text prompts): the text model as its text family's, the towers consistent
_OVERRIDES.update({
    "cohere_compass": {"text_config": _OVERRIDES["cohere_compass_text"]},
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0}},  # its DSA layers are NoPE
    "inkling2": {"vision_config": {"text_hidden_size": 64}},
    "inkling2_loop": {"vision_config": {"text_hidden_size": 64}},
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},  # layers of the tiny tower
    "nemotron_h_omni": {"vision_config": {"video_temporal_patch_size": 2}},
    "ernie4_5_vl_moe": {"text_config": {"moe_intermediate_size": [32, 32]}},  # text and vision experts
    # deepstack / spatial projector layout only checkpoints carry: vision layers -> the 2 tiny LLM layers
    "granite4_vision": {
        "deepstack_layer_map": [[-2, 0], [-1, 1]],
        "spatial_target_layers": [0, 1, 0, 1],
        "downsample_rate": "1/2",
        "vision_config": {"image_size": 32, "patch_size": 8},
    },
    # the rotary module needs M-RoPE sections (checkpoints: 4 axes, position / width / height / image index)
    "hunyuan_vl": {
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2, 2]}
        }
    },
    # mlp_layer_types is required (checkpoints give it); the SAM neck's conv channels lead into the
    # vision encoder's hidden size, its global-attention layers are indices of the tiny tower
    "deepseek_ocr2": {
        "text_config": {"mlp_layer_types": ["dense", "sparse"]},
        "vision_config": {
            "sam_config": {
                "image_size": 64,
                "window_size": 2,
                "global_attn_indexes": [1],
                "output_channels": 32,
                "downsample_channels": [32, 64],
            }
        },
    },
    # visual / audio code ranges (4 codes each) and their placeholders at the top of the tiny vocabulary;
    # tiny tokenizers (GroupNorm needs multiples of 32 channels, WavTokenizer codebook_dim == hidden_size)
    "apertus1p5": {
        "image_token_id": 124,
        "audio_token_id": 125,
        "image_token_offset": 116,
        "audio_token_offset": 120,
        "vision_config": {
            "codebook_size": 4,
            "embed_dim": 32,  # (16 draws text weights whose greedy output repeats the pad id)
            "latent_channels": 16,
            "base_channels": 32,
            "channel_multiplier": [1, 1],
            "num_res_blocks": 1,
            "attn_resolutions": [16],
            "resolution": 32,
        },
        "audio_config": {
            "codebook_size": 4,
            "codebook_dim": 64,
            "num_filters": 8,
            "upsampling_ratios": [2, 2],
            "decoder_hidden_size": 64,
            "decoder_intermediate_size": 128,
            "decoder_num_layers": 1,
        },
    },
    # the BPE <-> VQ-codebook map only checkpoints carry: 4 image tokens (masked out of the logits) and
    # <image> at the top of the tiny vocabulary; a tiny VQ-VAE (GroupNorm needs multiples of 32 channels)
    "chameleon": {
        "vocabulary_map": {"<image>": 127, **{f"IMGIMG{chr(ord('A') + i)}Z": 123 + i for i in range(4)}},
        "vq_config": {
            "embed_dim": 16,
            "num_embeddings": 4,
            "latent_channels": 16,
            "resolution": 32,
            "base_channels": 32,
            "channel_multiplier": [1, 1],
            "num_res_blocks": 1,
        },
    },
})
# M-RoPE families whose modeling code defaults the sections (to [16, 24, 24], ...) when the config
# names none: sections adding up to half the tiny rotary dims (GLM-4.5V rotates half the head)
for _family, _sections in {
    "qwen2_vl": [2, 3, 3], "qwen2_5_vl": [2, 3, 3], "paddleocr_vl": [2, 3, 3], "glm4v": [2, 3, 3], "glm46v": [2, 3, 3],
    "glm_ocr": [2, 3, 3], "glmga": [2, 3, 3], "glm4v_moe": [1, 1, 2], "ernie4_5_vl_moe": [3, 3, 2],
}.items():  # fmt: skip
    _text = _OVERRIDES.setdefault(_family, {}).setdefault("text_config", {})
    _text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _sections}
# composite families whose causal LM class takes the text config: same fixes as the text family
_OVERRIDES["qwen4_exp"] = _OVERRIDES["qwen4_exp_text"]
_OVERRIDES["dots3_note"] = _OVERRIDES["dots3_note_text"]

# Weight-init scale per family where the default gives degenerate greedy output (one token repeated,
# or near-ties between the top two logits).
# fmt: off
_INIT_SCALE: dict[str, float] = {
    "apertus": 1.0, "apertus1p5_text": 1.0, "axk2": 0.4, "bailing_hybrid": 0.7, "bamba": 1.0, "bart": 1.0,
    "bert": 0.02, "bert-generation": 0.7, "big_bird": 0.1, "bigbird_pegasus": 0.1, "biogpt": 0.4,
    "blenderbot": 0.7, "blenderbot-small": 0.4, "camembert": 0.05, "codegen": 0.4, "cpmant": 0.7, "ctrl": 0.1,
    "data2vec-text": 0.05, "deepseek_v2": 0.7, "deepseek_v32": 0.1, "deepseek_v4": 0.4, "doge": 0.4,
    "dots3_note": 0.1, "dots3_note_text": 0.1, "electra": 0.05, "emu3": 0.4, "ergo": 0.1, "ernie": 0.02,
    "ernie4_5": 0.4, "ernie4_5_moe": 0.4, "exaone_moe": 0.4, "falcon_mamba": 0.7, "flex_olmo": 0.7,
    "gemma": 0.4, "gemma2": 0.4, "gemma3n_text": 0.1, "gemma4": 0.4, "gemma4_text": 0.4,
    "gemma4_unified": 0.4, "gemma4_unified_text": 0.4, "git": 0.1, "glm4": 0.4, "glm4_moe": 0.4,
    "glm4_moe_lite": 0.7, "glm_moe_dsa": 0.4, "got_ocr2": 0.4, "gpt-sw3": 0.4, "gpt2": 0.4, "gpt_neo": 0.1,
    "gpt_neox": 1.0, "gpt_neox_japanese": 0.7, "gptj": 0.7, "granitemoe_swa": 1.0, "granitemoehybrid": 0.4,
    "hunyuan_v1_moe": 0.05, "hunyuan_vl": 0.4, "hy_v4": 0.4, "inkling2_loop_text": 0.4, "inkling2_text": 0.4,
    "inkling_text": 1.0, "jais2": 0.4, "jetmoe": 0.4, "kimi_linear": 0.1, "kolibri1": 0.1, "kolibri1_1": 0.4,
    "laguna": 0.7, "lfm2": 0.1, "llama4": 0.05, "llama4_text": 0.05, "longcat_flash": 0.7, "mamba": 0.4,
    "marian": 0.7, "mbart": 0.7, "megatron-bert": 1.0, "mellum": 0.4, "minicpm3": 0.7, "minimax_m2": 0.4,
    "minimax_m3_vl_text": 1.0, "ministral3": 0.1, "mixtral": 0.1, "mllama": 1.0,
    "moss_transcribe_diarize": 0.4, "mvp": 1.0, "nanochat": 0.07, "nemotron_h": 0.4, "olmo2": 0.4,
    "olmo_hybrid": 0.1, "olmoe": 0.1, "openai-gpt": 0.7, "pegasus": 1.0, "persimmon": 1.0, "phi": 0.4,
    "phi4_multimodal": 0.4, "phimoe": 0.7, "plbart": 0.7, "prophetnet": 0.1, "qwen3_5": 0.1,
    "qwen3_5_text": 0.1, "qwen3_moe": 0.4, "qwen3_next": 0.05, "reformer": 0.1, "rembert": 0.1,
    "roberta": 0.05, "roberta-prelayernorm": 0.4, "roc_bert": 0.1, "roformer": 1.0, "sarvam_mla": 0.7,
    "solar_open": 0.4, "starcoder2": 0.7, "trocr": 1.0, "whisper": 0.4, "xlm-roberta": 0.05,
    "xlm-roberta-xl": 0.7, "xlnet": 0.7, "xmod": 0.05, "youtu": 0.4, "zamba": 0.4, "zaya": 0.7,
}
# fmt: on

# With tied embeddings a random model's greedy output collapses onto the highest-norm embedding row
# (one token repeated): these families get untied input / output embeddings.
# fmt: off
_UNTIE = {
    "biogpt", "bloom", "camembert", "cohere", "ctrl", "gemma2", "gemma3", "gemma3_text", "gemma3n_text",
    "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "lfm2", "openai-gpt", "plbart",
    "recurrent_gemma", "roformer", "t5gemma2", "vaultgemma", "xglm", "xlm-roberta", "xlm-roberta-xl",
}
# fmt: on

# Generation-config entries that add logits processors (cleared on every tiny model).
_PROCESSOR_SETTINGS = (
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
)

# Per-family fixes after the model is built.
_POST_BUILD: dict[str, Callable[[PreTrainedModel], None]] = {
    # X-MOD routes through per-language adapters and refuses to run without a language
    "xmod": lambda model: model.set_default_language("en_XX"),
    # MusicGen's own generate() starts every codebook from decoder_start_token_id
    "musicgen": lambda model: setattr(model.generation_config, "decoder_start_token_id", BOS_TOKEN_ID),
    "musicgen_melody": lambda model: setattr(model.generation_config, "decoder_start_token_id", BOS_TOKEN_ID),
}

# Families whose tiny model cannot be built, or whose plain transformers generate() fails on a
# text-only left-padded batch: the reason. Every other family builds and plain-generates.
FAMILY_NOTES: dict[str, str] = {
    "blt": (
        "plain generate() fails in transformers 5.25: DynamicCache(config=...) reads num_hidden_layers "
        "from config.get_text_config(decoder=True), which for BLT is the composite BltConfig itself -> "
        "AttributeError 'BltConfig' object has no attribute 'num_hidden_layers' (any size; the tiny model "
        "builds and runs forward)"
    ),
    "gemma3n": (
        "cannot be built here: Gemma3nForConditionalGeneration's vision tower is a TimmWrapperModel and "
        "needs the timm library (not installed); the text decoder is covered by the gemma3n_text row"
    ),
    "gemma4_assistant": (
        "drafter (assistant) head for Gemma 4: every layer reuses the *target* model's shared KV states, "
        "its own cache layers are DummyLayer; plain generate() fails in transformers 5.25: AttributeError "
        "'DummyLayer' object has no attribute 'get_seq_length'"
    ),
    "gemma4_unified_assistant": (
        "drafter (assistant) head for Gemma 4 unified: every layer reuses the *target* model's shared KV "
        "states; plain generate() fails in transformers 5.25: AttributeError 'DummyLayer' object has no "
        "attribute 'get_seq_length'"
    ),
    "musicgen": (
        "audio-codebook decoder with its own generate() (MusicgenForCausalLM.generate, not "
        "GenerationMixin's): it fails in transformers 5.25 with TypeError repeat_interleave(None) in "
        "_expand_inputs_for_generation (generation_config.num_return_sequences is None); input_ids are "
        "(batch * num_codebooks, seq)"
    ),
    "musicgen_melody": (
        "audio-codebook decoder with its own generate() (MusicgenMelodyForCausalLM.generate): it prepends "
        "decoder_start_token_id to every row, applies the codebook delay pattern and returns (batch, "
        "num_codebooks, seq); it ignores left padding (padded rows differ from the same prompt alone)"
    ),
    # image-text-to-text families (text prompts)
    **dict.fromkeys(
        ["blip", "blip-2", "instructblip", "instructblipvideo", "idefics"],
        "plain generate() needs pixel_values: the model does not generate from text alone",
    ),
    **dict.fromkeys(["fast_vlm", "perception_lm"], "cannot be built here: its vision tower needs timm (not installed)"),
    **dict.fromkeys(
        ["pix2struct", "pp_formulanet", "udop", "vision-encoder-decoder"],
        "encoder-decoder: plain generate() fails on text input_ids alone (the encoder wants images / boxes)",
    ),
    **dict.fromkeys(
        ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"],
        "plain generate() fails in transformers 5.25: the thinker's M-RoPE index reads config.vision_start_token_id, "
        "which its config class does not define",
    ),
    **dict.fromkeys(["pi0", "pi05"], "robot action models: no generation_config, they do not generate text"),
    "diffusion_gemma": (
        "not autoregressive: DiffusionGemmaForBlockDiffusion generates by block diffusion with a generate() of its "
        "own (no GenerationMixin), which takes no custom_generate; hf_specdec.enable() refuses it (the tiny config "
        "does not build either: a projection size is None in the default config)"
    ),
    "xlm": (
        "left-padded rows are not supported by plain generate(): XLM's prepare_inputs_for_generation drops "
        "attention_mask and appends mask_token_id, and XLMModel rebuilds the mask from the count of "
        "non-pad tokens assuming right padding, so every left-padded row generates pad id 0 (unpadded rows "
        "work; no KV cache: the whole sequence is re-run every step)"
    ),
}

# Families that build and plain-generate, but where a left-padded row does not generate what the same
# prompt generates alone (so padded and unpadded runs are not comparable; speculative vs plain on the
# *same* batch may still be).
_POSITIONS_FROM_CACHE = (
    "positions count from the cache length / sequence index, not from attention_mask, so a left-padded row "
    "is shifted by its pad count"
)
_TOPK_INDEXER = (
    "sparse-attention indexer: while a query sees fewer than index_topk keys its top-k also picks masked "
    "(left-padding) positions, which are then attended (with index_topk >= the sequence length padded rows "
    "match the unpadded prompt, up to fp32 near-ties)"
)
# families whose plain generate() mistreats left padding past index_topk tokens: generate() refuses such
# batches there (`padded_batch_problem`), and the family matrix checks that, then runs prompts of one length
TOPK_INDEXER_FAMILIES = (
    "axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4"
)
# fmt: off
LEFT_PADDING_NOTES: dict[str, str] = {
    **dict.fromkeys(
        [
            "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
            "plbart", "trocr", "whisper", "git", "prophetnet",
        ],
        _POSITIONS_FROM_CACHE,
    ),
    **dict.fromkeys(TOPK_INDEXER_FAMILIES, _TOPK_INDEXER),
    "deepseek_v4": "compressed attention (CSA / HCA) pools blocks of key positions, left padding included",
    "reformer": "axial position embeddings and chunked local / LSH attention take no account of left padding",
    "xlnet": "relative positions over the whole (padded) sequence; left padding shifts them",
    "rwkv": "recurrent model without attention_mask: pad tokens run through the recurrence",
    "xlstm": "recurrent model without attention_mask: pad tokens run through the recurrence",
}
# fmt: on


def causal_lm_families() -> list[str]:
    """Every model type transformers maps to a causal LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_to_text_families() -> list[str]:
    """Every model type transformers maps to an image-text-to-text class but not to a causal LM one
    (Llava, Qwen2.5-VL, ...: `serve` loads them with AutoModelForImageTextToText), sorted."""
    return sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def encoder_decoder_families() -> list[str]:
    """Every model type transformers maps to a sequence-to-sequence or speech-to-text class whose config is an
    encoder-decoder one (BART, T5, Whisper...; audio LMs in those mappings are decoder-only), sorted."""
    return sorted(
        model_type
        for model_type in {**MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, **MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}
        if model_type in CONFIG_MAPPING and getattr(_make(CONFIG_MAPPING[model_type], {}), "is_encoder_decoder", False)
    )


def encoder_decoder_class(model_type: str) -> type[PreTrainedModel]:
    """The sequence-to-sequence (or else speech-to-text) class transformers maps `model_type` to."""
    name = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


# families that pair any encoder with any decoder: (encoder, decoder) model types of their tiny models
_COMPOSED_ENCODER_DECODERS = {"encoder-decoder": ("bert", "bert"), "speech-encoder-decoder": ("wav2vec2", "bert")}


def tiny_config_of(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """The tiny sizes on `model_type`'s own config class (encoders such as ViT too), `overrides` on top."""
    return _tiny_config(CONFIG_MAPPING[model_type], overrides, DEFAULT_INIT_SCALE)


def tiny_encoder_decoder_config(model_type: str, init_scale: float | None = None) -> PreTrainedConfig:
    """The tiny config `build_tiny_encoder_decoder` uses for `model_type`."""
    scale = _INIT_SCALE.get(model_type, DEFAULT_INIT_SCALE) if init_scale is None else init_scale
    if model_type in _COMPOSED_ENCODER_DECODERS:  # as from_encoder_decoder_pretrained builds them (decoder cross-attends)
        encoder, decoder = (_tiny_config(CONFIG_MAPPING[name], {}, scale) for name in _COMPOSED_ENCODER_DECODERS[model_type])
        return CONFIG_MAPPING[model_type].from_encoder_decoder_configs(encoder, decoder)
    # untied: a tiny random decoder whose output embedding is its input one mostly repeats its last token
    config = _tiny_config(CONFIG_MAPPING[model_type], dict(_OVERRIDES.get(model_type, {})), scale)
    config.tie_word_embeddings = False
    return config


def build_tiny_encoder_decoder(model_type: str, seed: int = 0, config: PreTrainedConfig | None = None) -> PreTrainedModel:
    """`build_tiny_model` for an encoder-decoder family (`encoder_decoder_families`): its tiny config (or `config`),
    fp32, eval mode, the same special ids (decoder start: bos), family processors off."""
    config = config or tiny_encoder_decoder_config(model_type)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = encoder_decoder_class(model_type)(config).to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID
    gen.decoder_start_token_id = BOS_TOKEN_ID
    for name in _PROCESSOR_SETTINGS:
        if getattr(gen, name, None) is not None:
            setattr(gen, name, None)
    return model


def model_class(model_type: str) -> type[PreTrainedModel]:
    """The class transformers' auto mapping picks for `model_type`: its causal LM, else its
    image-text-to-text model."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


def config_class(model_type: str) -> type[PreTrainedConfig]:
    """The config class to build for `model_type`: the family's own, or the text / decoder sub-config
    the causal LM class takes when the family config is composite (llama4, qwen3_5, musicgen...)."""
    family_cls = CONFIG_MAPPING[model_type]
    model_cfg_cls = getattr(model_class(model_type), "config_class", None)
    if model_cfg_cls is not None and model_cfg_cls is not family_cls:
        if model_cfg_cls in family_cls.sub_configs.values():
            return model_cfg_cls
    return family_cls


def _field_names(cls: type[PreTrainedConfig]) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls().to_dict())


def _resolve(cls: type[PreTrainedConfig], fields: set[str], name: str) -> str | None:
    """The field `name` lands on in `cls` (itself or its attribute_map target), or None."""
    if name in fields:
        return name
    target = cls.attribute_map.get(name)
    if target is not None and target in fields:
        return target
    return None


def _get(config: PreTrainedConfig, name: str) -> Any:
    """`config.name`, also on heterogeneous (per-layer) configs where plain getattr refuses."""
    raw = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if raw is not None:
        return raw(name, None)
    return getattr(config, name, None)


def _make(cls: type[PreTrainedConfig], kwargs: dict[str, Any]) -> PreTrainedConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kwargs)


def _layer_plan(
    config: PreTrainedConfig, fields: set[str]
) -> tuple[int, dict[str, list], dict[str, list], set[int]]:
    """Layer count, per-layer lists, layer-index lists and heterogeneous layers of a full-size config."""
    n = _get(config, "num_hidden_layers")
    per_layer: dict[str, list] = {}
    index_lists: dict[str, list] = {}
    if not isinstance(n, int) or n < 1:
        return 0, per_layer, index_lists, set()
    for name in sorted(fields):
        value = _get(config, name)
        if not isinstance(value, (list, tuple)) or name == "architectures":
            continue
        if name in _INDEX_LIST_NAMES:
            index_lists[name] = list(value)
        elif len(value) == n and n > 1:
            per_layer[name] = list(value)
    spec = config.__dict__.get("_heterogeneity_spec")
    special = set(spec.per_layer_overrides) if spec is not None else set()
    return n, per_layer, index_lists, special


def _select_layers(n_full: int, kinds: list[tuple], n_target: int | None) -> list[int]:
    """A few layers of the full-size model that cover every layer kind, in model order; with
    `n_target`, exactly that many (padding with the next layers, or cutting the last kinds)."""
    keep: list[int] = []
    seen: set[tuple] = set()
    for i, kind in enumerate(kinds):
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    want = n_target if n_target is not None else max(_MIN_LAYERS, len(keep))
    extra = [i for i in range(max(n_full, want)) if i not in keep]
    return sorted((keep + extra)[:want]) if len(keep) < want else sorted(keep[:want])


def _layer_kwargs(
    cls: type[PreTrainedConfig], fields: set[str], full: PreTrainedConfig, n_target: int | None
) -> dict[str, Any]:
    """Layer count and per-layer lists for the tiny config, cut down from the full-size `full`."""
    n_full, per_layer, index_lists, special = _layer_plan(full, fields)

    def kind(i: int) -> tuple:
        # categorical per-layer entries (layer / mlp types, flags) and index-list memberships
        sig: list[Any] = [i in special]
        for name in sorted(per_layer):
            value = per_layer[name][i]
            if isinstance(value, (str, bool)) or value is None or value in (0, 1):
                sig.append(value)
        sig.extend(i in index_lists[name] for name in sorted(index_lists))
        return tuple(sig)

    keep = _select_layers(n_full, [kind(i) for i in range(n_full)], n_target)
    n = len(keep)
    out: dict[str, Any] = {}
    for name in _LAYER_COUNT_NAMES:
        target = _resolve(cls, fields, name)
        if target is not None and target not in out:
            out[target] = n
    for name, values in per_layer.items():
        picked = [values[i] if i < n_full else values[-1] for i in keep]
        if name in _SIZES and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in picked):
            picked = [_SIZES[name]] * n  # per-layer sizes (gemma3n's intermediate_size list)
        out[name] = picked
    for name, indices in index_lists.items():
        out[name] = [j for j, i in enumerate(keep) if i in set(indices)]
    return out


def _tiny_config(
    cls: type[PreTrainedConfig], overrides: dict[str, Any], init_scale: float
) -> PreTrainedConfig:
    """`cls` with the generic tiny sizes, sub-configs shrunk too, then `overrides` on top."""
    fields = _field_names(cls)
    plain_overrides = {
        k: v for k, v in overrides.items() if not (isinstance(v, dict) and k in cls.sub_configs)
    }
    try:
        default = _make(cls, {})
    except Exception:  # some defaults only validate with the family's overrides (assistant configs)
        default = _make(cls, {k: v for k, v in overrides.items() if not isinstance(v, list)})
    kwargs: dict[str, Any] = {}
    # sub-configs (vision towers, nested attention / ffn configs) first, recursively
    for key in cls.sub_configs:
        sub = _get(default, key)
        if isinstance(sub, PreTrainedConfig):
            kwargs[key] = _tiny_config(type(sub), overrides.get(key, {}), init_scale)
    for name, value in _SIZES.items():
        target = _resolve(cls, fields, name)
        if target is None or target in kwargs:
            continue
        if name in _ONLY_IF_SET and not _get(default, target):
            continue
        kwargs[target] = value
    for name in _INIT_NAMES:
        if name in fields:
            kwargs[name] = init_scale
    if "kv_lora_rank" in fields:
        # MLA: head_dim comes from the rope / nope split (forcing 16 would break it), and the latent
        # KV is expanded to every query head (no GQA)
        kwargs.pop("head_dim", None)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", _SIZES["num_attention_heads"])
    for name, value in (
        ("pad_token_id", PAD_TOKEN_ID),
        ("eos_token_id", EOS_TOKEN_ID),
        ("bos_token_id", BOS_TOKEN_ID),
    ):
        target = _resolve(cls, fields, name)
        if target is not None:
            kwargs[target] = value
    kwargs.update(_tiny_mrope_sections(default, kwargs))
    resolved = {(_resolve(cls, fields, k) or k): v for k, v in plain_overrides.items()}
    kwargs.update({k: v for k, v in resolved.items() if not isinstance(v, list)})

    # The layer pattern of the full-size model *with* the tiny settings (sliding_window,
    # max_window_layers...), since several families derive layer_types from them.
    count_fields = {_resolve(cls, fields, name) for name in _LAYER_COUNT_NAMES} - {None}
    full = default
    if _get(default, "num_hidden_layers") is not None:
        try:
            full = _make(cls, {k: v for k, v in kwargs.items() if k not in count_fields})
        except Exception:
            full = default
    n_target = next((resolved[t] for t in count_fields if t in resolved), None)
    if n_target is None:
        per_layer = _layer_plan(full, fields)[1]
        lengths = [
            len(v)
            for k, v in resolved.items()
            if isinstance(v, list) and (k in per_layer or k in _KIND_LISTS)
        ]
        n_target = max(lengths) if lengths else None
    kwargs.update(_layer_kwargs(cls, fields, full, n_target))
    kwargs.update(resolved)  # the family's own fixes win
    return _make(cls, kwargs)


def _tiny_mrope_sections(default: PreTrainedConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """M-RoPE (Qwen2-VL, GLM-4V, ...): the temporal / height / width sections must add up to half the
    rotary dims, so they shrink with the head, in the full-size model's proportions."""
    rope = _get(default, "rope_parameters")
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not sections:
        return {}
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", _get(default, "partial_rotary_factor") or 1.0)
    half = int(kwargs.get("qk_rope_head_dim") or head_dim * partial) // 2  # MLA rotates its rope part only
    tiny = [max(1, round(section * half / sum(sections))) for section in sections]
    tiny[-1] = half - sum(tiny[:-1])
    return {"rope_parameters": {**rope, "mrope_section": tiny}}


def tiny_config(model_type: str, init_scale: float | None = None) -> PreTrainedConfig:
    """The tiny config `build_tiny_model` uses for `model_type`."""
    if init_scale is None:
        init_scale = _INIT_SCALE.get(model_type, DEFAULT_INIT_SCALE)
    cls = config_class(model_type)
    overrides = dict(_OVERRIDES.get(model_type, {}))
    if model_type in _UNTIE:
        overrides["tie_word_embeddings"] = False
        if "text_config" in cls.sub_configs:
            overrides["text_config"] = {**overrides.get("text_config", {}), "tie_word_embeddings": False}
    if _is_an_encoder_used_as_decoder(model_type):
        overrides["is_decoder"] = True  # how such a causal LM is meant to run (transformers warns otherwise)
    return _tiny_config(cls, overrides, init_scale)


def _is_an_encoder_used_as_decoder(model_type: str) -> bool:
    """BERT-style families: their causal-LM class runs bidirectionally unless the config says `is_decoder`."""
    try:
        source = inspect.getsource(model_class(model_type).__init__)
    except (TypeError, OSError, ValueError):
        return False
    return "is_decoder" in source


def build_tiny_model(
    model_type: str, seed: int = 0, init_scale: float | None = None, config: PreTrainedConfig | None = None
) -> PreTrainedModel:
    """A tiny randomly initialised fp32 CPU model (eval mode) of the causal LM class transformers maps
    `model_type` to. Special ids: pad 0, eos 1, bos 2; prompts may use ids 3..127. `init_scale` replaces
    the family's tuned weight-init scale (initializer_range / init_std / initializer_factor); `config`:
    the family's `tiny_config`, changed by the caller."""
    config = config or tiny_config(model_type, init_scale)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(model_type)(config)
    model = model.to(torch.float32).eval()
    if model_type in _POST_BUILD:
        _POST_BUILD[model_type](model)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID
    # Logits processors some families' configs switch on (BART's forced_eos_token_id, Whisper's
    # begin_suppress_tokens...) name ids of the real vocabularies: off, so greedy is a plain argmax.
    for name in _PROCESSOR_SETTINGS:
        if getattr(gen, name, None) is not None:
            setattr(gen, name, None)
    return model


def layer_kinds(config: PreTrainedConfig) -> dict[str, list]:
    """The per-layer kind lists a (text) config has: layer_types, layers_block_type, mlp_layer_types..."""
    out = {}
    for name in _KIND_LISTS:
        try:
            value = _get(config, name)
        except Exception:  # properties of half-built configs
            continue
        if isinstance(value, (list, tuple)):
            out[name] = [str(v) for v in value]
    return out


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """Which attention features a tiny model's config exercises (for a readable family matrix)."""
    config = model.config
    text = config.get_text_config(decoder=True)
    out: dict[str, Any] = {"model_type": config.model_type, "class": type(model).__name__}
    out["layers"] = _get(text, "num_hidden_layers")
    out.update(layer_kinds(text))
    layer_types = out.get("layer_types")
    window = _get(text, "sliding_window") or _get(text, "window_size")
    if window:
        out["sliding_window"] = window
        local = layer_types or out.get("attention_layers")
        out["sliding_layers"] = (
            [i for i, t in enumerate(local) if "sliding" in t or t == "local"] if local else "all"
        )
    if _get(text, "attention_chunk_size"):
        out["attention_chunk_size"] = _get(text, "attention_chunk_size")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "logits_soft_cap"):
        if _get(text, name):
            out[name] = _get(text, name)
    sinks = sorted({n.split(".")[-1] for n, _ in model.named_parameters() if "sink" in n.split(".")[-1]})
    if sinks:
        out["attention_sinks"] = sinks
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if _get(text, name):
            out["moe_experts"] = _get(text, name)
            out["moe_top_k"] = _get(text, "num_experts_per_tok")
            break
    if _get(text, "kv_lora_rank"):
        out["mla"] = {
            n: _get(text, n)
            for n in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        }
    spec = text.__dict__.get("_heterogeneity_spec")
    if spec is not None and spec.per_layer_overrides:
        out["per_layer_config"] = {i: dict(v) for i, v in spec.per_layer_overrides.items()}
    kinds = {k for name in ("layer_types", "layers_block_type") for k in out.get(name, [])}
    if kinds - {"full_attention", "sliding_attention", "chunked_attention"}:
        out["hybrid_layer_kinds"] = sorted(kinds)
    out["attn_implementation"] = config._attn_implementation
    out["parameters"] = sum(p.numel() for p in model.parameters())
    return out
