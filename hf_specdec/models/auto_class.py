"""The transformers auto class that loads a folder or Hub id for generation."""

from __future__ import annotations

import os


def generation_model_class(name: str | os.PathLike, **kwargs) -> type:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for the families transformers lists only as
    image-text-to-text (Llava, Qwen2.5-VL, Mistral 3, ...), whose models generate() runs as they are.
    `kwargs` go to `AutoConfig.from_pretrained` (`local_files_only`, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = AutoConfig.from_pretrained(name, **kwargs).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return AutoModelForCausalLM if causal else AutoModelForImageTextToText
