"""The transformers auto class that loads a folder or Hub id for generation."""

from __future__ import annotations

import os


def generation_model_class(name: str | os.PathLike, **kwargs) -> type:
    """AutoModelForCausalLM; AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq for the encoder-decoder models
    transformers maps so (T5, BART, Marian, Whisper, ...); or AutoModelForImageTextToText for the families
    transformers lists only as image-text-to-text (Llava, Qwen2.5-VL, Mistral 3, ...), whose models generate()
    runs as they are. `kwargs` go to `AutoConfig.from_pretrained` (`local_files_only`, ...)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    config = AutoConfig.from_pretrained(name, **kwargs)
    if getattr(config, "is_encoder_decoder", False):  # (BART's config is also in the causal-LM mapping: its decoder)
        if config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return AutoModelForSeq2SeqLM
        if config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            return AutoModelForSpeechSeq2Seq
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText
