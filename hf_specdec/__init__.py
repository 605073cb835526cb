"""hf-specdec: exact, batched speculative decoding for Hugging Face transformers.

    import hf_specdec
    hf_specdec.enable(model)
    out = model.generate(**inputs, speculative_config={"method": "ngram", "num_speculative_tokens": 5})

or, without patching: `model.generate(**inputs, custom_generate=hf_specdec.generate, speculative_config=...)`;
requests that come and go: `hf_specdec.SpeculativeEngine` (`hf-specdec serve` puts an OpenAI-compatible server on it).
"""

from .cache.paged_cache import CacheExhaustedError, PagedKVCache
from .config import SpeculativeConfig
from .heads.eagle_heads import EagleHead, load_eagle_head
from .loop.decoding import SpeculativeGenerateEncoderDecoderOutput, SpeculativeGenerateOutput, generate
from .loop.engine import RequestOutput, SpeculativeEngine
from .loop.integration import disable, enable
from .loop.metrics import SpecDecodeMetrics
from .models.cpu_linear import fast_cpu_linears

__all__ = [
    "CacheExhaustedError",
    "EagleHead",
    "PagedKVCache",
    "RequestOutput",
    "SpecDecodeMetrics",
    "SpeculativeEngine",
    "SpeculativeConfig",
    "SpeculativeGenerateEncoderDecoderOutput",
    "SpeculativeGenerateOutput",
    "disable",
    "enable",
    "fast_cpu_linears",
    "generate",
    "load_eagle_head",
]
__version__ = "0.1.0"
