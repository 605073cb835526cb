"""hf-specdec: exact, batched speculative decoding for Hugging Face transformers.

    import hf_specdec
    hf_specdec.enable(model)
    out = model.generate(**inputs, speculative_config={"method": "ngram", "num_speculative_tokens": 5})

or, without patching: `model.generate(**inputs, custom_generate=hf_specdec.generate, speculative_config=...)`.
"""

from .cache.paged_cache import CacheExhaustedError, PagedKVCache
from .config import SpeculativeConfig
from .heads.eagle_heads import EagleHead, load_eagle_head
from .loop.decoding import SpeculativeGenerateOutput, generate
from .loop.integration import disable, enable
from .loop.metrics import SpecDecodeMetrics
from .models.cpu_linear import fast_cpu_linears

__all__ = [
    "CacheExhaustedError",
    "EagleHead",
    "PagedKVCache",
    "SpecDecodeMetrics",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "disable",
    "enable",
    "fast_cpu_linears",
    "generate",
    "load_eagle_head",
]
__version__ = "0.1.0"
