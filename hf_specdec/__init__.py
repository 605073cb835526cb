"""hf-specdec: exact, batched speculative decoding for Hugging Face transformers.

    import hf_specdec
    hf_specdec.enable(model)
    out = model.generate(**inputs, speculative_config={"method": "ngram", "num_speculative_tokens": 5})

or, without patching: `model.generate(**inputs, custom_generate=hf_specdec.generate, speculative_config=...)`.
"""

from .config import SpeculativeConfig
from .decoding import SpeculativeGenerateOutput, generate
from .integration import disable, enable
from .metrics import SpecDecodeMetrics
from .paged_cache import CacheExhaustedError, PagedKVCache

__all__ = [
    "CacheExhaustedError",
    "PagedKVCache",
    "SpecDecodeMetrics",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "disable",
    "enable",
    "generate",
]
__version__ = "0.1.0"
