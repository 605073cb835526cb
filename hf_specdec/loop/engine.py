"""`SpeculativeEngine`: requests join and leave a running batch; every step is `speculative_step`.

    engine = SpeculativeEngine(model, {"method": "ngram", "num_speculative_tokens": 4}, max_batch_size=16)
    request_id = engine.add_request(prompt_ids, {"max_new_tokens": 128, "do_sample": True, "temperature": 0.7}, seed=1)
    while engine.has_unfinished():
        for output in engine.step():
            print(output.request_id, output.new_token_ids, output.finish_reason)

Each request owns a row of the batch (a slot). It joins at a step boundary: its whole prompt is
just its pending tokens, so its prefill rides in the next verify forward next to the other rows'
drafts, as the first step of `generate()` treats every prompt (with `prefill_chunk_size`, a long
prompt rides along a chunk per step: `step.prompt_chunks`). A prompt with images (`model_inputs`), or any on a model whose prompt attends both ways, is
prefilled at admission by the model's own forward instead, as `generate()` prefills one
(`cache/prefill.py`), and its last token rides in the next step. An encoder-decoder model's request brings
its source instead (`model_inputs`): the model's encoder reads it at admission, and the decoder's cache and the
drafters get its output (`encoder_decoder.hand_over_sources`). Requests joining in one step whose prompts and
inputs have one shape share that forward (a batch, as `generate()` runs one; `_batchable_groups`). Rows that finish or are aborted free
their KV blocks and drafter state at once, and the slot takes the next waiting request.

Admission reserves the KV blocks a request can ever hold (prompt + max_new_tokens, plus a tree's
slots): a request waits until the pool has them, and a running row can never find the pool empty,
so nothing is preempted or recomputed. Each request brings its own generation config: logits
processors and stopping criteria are transformers' own (`_get_logits_processor`,
`_get_stopping_criteria`, what plain `generate()` builds), its own seed and max tokens.

Drafters that run a model (draft model, layer skip, MTP) sample a sampled request's drafts from
its own warped draft distribution q (its temperature, top-k / top-p / min-p; its seed), as in
`generate()`, and the rejection sampler tests them against the request's processed target
distribution; greedy requests draft the argmax. n-gram, suffix and EAGLE drafts are deterministic
(a one-hot q), which is exact for any temperature too. `generate()` runs the same engine on its
fixed batch (`for_batch`), with the batch's processors.

While rows run, the model's attention is switched to the paged cache and its CPU linears take the
measured routes (as inside `generate()`); both are restored whenever the engine is idle. Not
thread-safe: drive one engine from one thread (the server's background loop does).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
)
from transformers.generation import stopping_criteria as hf_stopping

from ..cache.architectures import check_architecture
from ..cache.own_attention import (
    OwnAttentionCache,
    encoder_input_name,
    encoder_token_embeddings,
    runs_one_row_per_forward,
)
from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..cache.prefill import (
    both_ways_prompt_problem,
    check_model_prefill,
    model_positions,
    prefill_with_model,
    prompt_attends_both_ways,
)
from ..config import SpeculativeConfig
from ..drafters import build_proposer
from ..drafters.drafting import DraftSampling, set_row_sampling
from ..models.cpu_linear import fast_cpu_linears, resolve_backend
from ..models.feature_capture import TargetFeatureCapture, capture_for_proposer
from ..sampling.grammar import SpeculativeGrammar, is_xgrammar_processor, with_speculative_grammars
from ..sampling.logits_processing import (
    RowLogitsProcessors,
    RowStopCheckers,
    StopChecker,
    check_supported_processors,
)
from ..sampling.prefix_constraint import with_speculative_prefix_constraints
from .auto_k import controller_for
from .auto_tree import AutoTreeController
from .encoder_decoder import check_encoder_decoder_config, hand_over_sources, source_limit
from .metrics import SpecDecodeMetrics
from .step import DecodeState, SamplingState, drafter_networks, release_rows, speculative_step

logger = logging.getLogger(__name__)

# with speculative_config=None the engine decodes plainly through the same step: drafting is off at
# every batch size (the step then drafts nothing: one token per row and step)
NO_DRAFTS = {"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": 1}
# max_model_len when not given: the model's own limit, at most this (it sizes the token buffer)
DEFAULT_MAX_MODEL_LEN = 4096
# num_kv_blocks when not given: room for every row to hold this many tokens (longer requests wait
# for blocks that shorter ones leave free); ~1.5 GB of fp32 K/V for SmolLM2-135M at 16 rows
DEFAULT_TOKENS_PER_ROW = 2048
# requests joining together share their prefill's (or encoder's) forward up to this many positions in all: on 2 CPU
# cores (BART-base's encoder, 8 sources of one length) the batch is 2.2x faster than one by one at 32 tokens
# each, 1.1x at 200, even at 1000; 8 Whisper-base sources of 30 s (3000 frames each) were 10% slower batched
BATCHED_PREFILL_LENGTH = 2048
# the most alternatives a request may ask log-probabilities of, per token (OpenAI's chat limit)
MAX_TOP_LOGPROBS = 20
# inputs the engine itself gives the model, so a request's `model_inputs` may not
ENGINE_INPUTS = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position", "past_key_values", "cache",
    "use_cache", "logits_to_keep",
})  # fmt: skip
# generate()'s assisted-generation options: they would run transformers' own speculation instead
ASSISTED_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
# decoding strategies other than greedy search and sampling (transformers moved both to custom_generate repositories)
OTHER_STRATEGIES = {"dola_layers": "DoLa decoding", "penalty_alpha": "contrastive search"}
# per-step outputs plain generate() returns beside the tokens, which the loop does not produce
UNRETURNED_OUTPUTS = ("output_attentions", "output_hidden_states")


def unsupported_option(config: GenerationConfig, returns_outputs: bool) -> str:
    """A generation option speculative decoding would otherwise ignore, and why; '' when none.
    `returns_outputs`: per-step outputs are returned (generate()'s `return_dict_in_generate`, the engine)."""
    for option, strategy in OTHER_STRATEGIES.items():
        if getattr(config, option, None):
            return f"{option}={getattr(config, option)!r} asks for {strategy}, which speculative decoding does not run"
    asked = [option for option in UNRETURNED_OUTPUTS if returns_outputs and getattr(config, option, False)]
    if asked:
        return f"{asked[0]}=True: speculative decoding returns tokens, scores and logits, not attentions or hidden states"
    return ""


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the target's distribution (its raw logits, before the
    request's temperature, top-k / top-p or penalties, as vLLM reports by default), and the
    `top` most likely tokens' at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]  # emitted in this step
    token_ids: list[int]  # every token emitted so far (the prompt excluded)
    prompt_len: int
    finished: bool
    finish_reason: str | None = None  # "stop" (eos, stop string), "length" (max_new_tokens), "error"
    error: str | None = None  # with finish_reason "error": what went wrong
    logprobs: list[TokenLogprob] | None = None  # of `new_token_ids`, for a request that asked for them


@dataclass
class _Request:
    request_id: str
    prompt: np.ndarray
    max_length: int  # prompt + max_new_tokens
    processors: LogitsProcessorList
    stop_checker: StopChecker
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None  # None: greedy
    num_blocks: int  # KV blocks reserved at admission
    num_top_logprobs: int | None = None  # None: no log-probabilities; else the alternatives per token
    draft_sampling: DraftSampling | None = None  # a sampled request's drafts (None: greedy drafts)
    model_inputs: dict[str, torch.Tensor] | None = None  # images and the like, for the model's own prefill
    position_ids: torch.Tensor | None = None  # the prompt's, as plain generate() gives them (with model_inputs)
    output: list[int] = field(default_factory=list)


class SpeculativeEngine:
    """Continuous batching around `speculative_step`: `add_request`, `step`, `abort` (see the module doc).

    `speculative_config`: as for `generate()` (dict, JSON string, `SpeculativeConfig`); None decodes
    without drafting. `max_batch_size`: rows decoded together (more requests wait). `max_model_len`:
    the longest a request may get, prompt included (default: the model's limit, at most 4096).
    `num_kv_blocks`: the target's KV pool, in blocks of `speculative_config.block_size` tokens
    (default: 2048 tokens per row). `tokenizer`: needed for requests with `stop_strings`.
    `prefill_chunk_size`: at most this many prompt tokens per step (chunked prefill: a long prompt
    joins over several steps instead of stalling every running request for one long step); None:
    each prompt in one step.

    Public attributes: `model`, `config` (the `SpeculativeConfig`), `max_batch_size`, `max_model_len`,
    `tokenizer`, `metrics` (`SpecDecodeMetrics`, summed over every step).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        *,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        tokenizer=None,
        prefill_chunk_size: int | None = None,
    ):
        config = SpeculativeConfig.from_any(NO_DRAFTS if speculative_config is None else speculative_config)
        for name, value in (
            ("max_batch_size", max_batch_size), ("max_model_len", max_model_len), ("num_kv_blocks", num_kv_blocks),
            ("prefill_chunk_size", prefill_chunk_size),
        ):  # fmt: skip
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"SpeculativeEngine: {name} must be a positive integer, got {value!r}")
        if config.rejection_sample_method == "block":
            raise ValueError(
                "SpeculativeEngine: speculative_config.rejection_sample_method='block' is not supported by the engine "
                "(its requests mix greedy and sampled rows); allowed: 'token'"
            )
        check_architecture(model)
        if model.config.is_encoder_decoder:  # each request brings its source (`add_request`'s model_inputs)
            check_encoder_decoder_config(model, config)
        if runs_one_row_per_forward(model) and max_batch_size > 1:
            warnings.warn(
                f"this {type(model).__name__} runs on its own attention and cache, one forward per row: with several "
                "requests at once the engine is likely slower than plain batched decoding (docs/architectures.md)",
                stacklevel=2,
            )
        limit = model_max_length(model)
        max_model_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > limit:
            raise ValueError(f"SpeculativeEngine: max_model_len={max_model_len} exceeds the model's limit ({limit} positions)")
        self.max_batch_size, self.max_model_len, self.tokenizer = max_batch_size, max_model_len, tokenizer
        self.prefill_chunk_size = prefill_chunk_size
        self._tree_slots = 0 if config.tree is None else config.tree.num_nodes
        row_blocks = -(-(min(max_model_len, DEFAULT_TOKENS_PER_ROW) + 1 + self._tree_slots) // config.block_size)
        num_blocks = num_kv_blocks or max_batch_size * row_blocks
        # drafters with a KV pool of their own hold up to k tokens per row beyond the target's
        draft_blocks = num_blocks + max_batch_size * -(-(config.max_draft_tokens + 2) // config.block_size)
        pad = model.generation_config.pad_token_id
        state = DecodeState(
            token_buffer=torch.full((max_batch_size, max_model_len), 0 if pad is None else int(pad), dtype=torch.long),
            pad_lens=np.zeros(max_batch_size, dtype=np.int64),
            seq_lens=np.zeros(max_batch_size, dtype=np.int64),
            num_cached=np.zeros(max_batch_size, dtype=np.int64),
            finished=np.ones(max_batch_size, dtype=bool),  # a free slot is a finished row
            max_lengths=np.zeros(max_batch_size, dtype=np.int64),
            pad_token_id=0 if pad is None else int(pad),
            position_offsets=np.zeros(max_batch_size, dtype=np.int64),
        )
        sampling = SamplingState(
            is_greedy=torch.ones(max_batch_size, dtype=torch.bool, device=model.device), generators=[None] * max_batch_size
        )
        self._row_processors, self._row_stops = RowLogitsProcessors(), RowStopCheckers()
        self._setup(
            model, config, state, sampling, num_blocks, self._row_stops, LogitsProcessorList(),
            dataclasses.replace(config, num_kv_blocks=draft_blocks), GenerationConfig(do_sample=False),
        )  # fmt: skip

    @classmethod
    def for_batch(
        cls,
        model: PreTrainedModel,
        config: SpeculativeConfig,
        state: DecodeState,
        sampling: SamplingState,
        logits_processor: LogitsProcessorList,
        stop_checker: StopChecker,
        generation_config: GenerationConfig,
        num_blocks: int,
    ) -> SpeculativeEngine:
        """`generate()`'s engine: its rows (`state`) all run from the start and share transformers' processors
        and stopping criteria for the batch; drafters sample as `generation_config` says."""
        engine = cls.__new__(cls)
        engine.max_batch_size, engine.max_model_len, engine.tokenizer = len(state.finished), state.token_buffer.shape[1], None
        engine.prefill_chunk_size = None
        engine._row_processors = engine._row_stops = None
        engine._setup(model, config, state, sampling, num_blocks, stop_checker, logits_processor, config, generation_config)
        return engine

    def _setup(
        self, model, config, state, sampling, num_blocks, stop_checker, logits_processor, drafter_config,
        draft_generation_config,
    ) -> None:  # fmt: skip
        self.model, self.config, self.state, self.sampling = model, config, state, sampling
        self.stop_checker, self.logits_processor = stop_checker, logits_processor
        self.cache = PagedKVCache.for_model(
            model, num_blocks=num_blocks, block_size=config.block_size, max_rollback=config.max_draft_tokens
        )
        if config.tree is not None:
            _check_tree_request(self.cache)
        self.proposer = build_proposer(drafter_config, model, draft_generation_config, logits_processor, target_cache=self.cache)
        self.metrics = SpecDecodeMetrics()
        self.k_controller = controller_for(model, config, draft_generation_config.do_sample) if config.auto_k else None
        self.tree_controller = (
            AutoTreeController(config.tree.num_nodes) if config.tree is not None and config.tree.auto else None
        )
        # verify forwards carry k+1 tokens per row: see cpu_linear.py for why they skip torch's BLAS
        networks = [model, *drafter_networks(self.proposer)]
        backend = resolve_backend(config.cpu_linear_backend, networks)
        self._fast_linears = None if backend == "torch" else (lambda: fast_cpu_linears(*networks, backend=backend))
        self._held: contextlib.ExitStack | None = None  # what is switched on while rows run
        self._decoding: contextlib.ExitStack | None = None  # paged attention and CPU linears, while rows decode
        self.features: TargetFeatureCapture | None = None
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # by row
        self._reserved_blocks = 0
        self._shared_stop_checkers: dict[frozenset[int], StopChecker] = {}

    # --- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        generation_config: GenerationConfig | dict | None = None,
        *,
        seed: int | None = None,
        request_id: str | None = None,
        logprobs: int | None = None,
        grammar: object | None = None,
        logits_processor: Sequence[LogitsProcessor] | None = None,
        model_inputs: dict[str, torch.Tensor] | None = None,
    ) -> str:
        """Queue a request; it joins the batch at a step boundary. Returns its id.

        `generation_config`: a transformers `GenerationConfig`, or a dict of its fields over the
        model's own (`max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`, `min_p`,
        `repetition_penalty`, `eos_token_id`, `stop_strings`, ...). `seed`: the sampled request's
        own generator (None: a random seed). `logprobs`: each output token's log-probability and
        those of the `logprobs` most likely tokens (0 to `MAX_TOP_LOGPROBS`; `TokenLogprob`).
        `grammar`: an xgrammar `CompiledGrammar` (JSON schema, regex, EBNF) the output must follow,
        masked at every position exactly as plain `generate()` masks it with xgrammar's processor
        (`sampling/grammar.py`). `logits_processor`: the request's own transformers processors, as
        `generate(logits_processor=...)` takes them (`sampling.penalties.OutputTokenPenalties`, xgrammar's
        processor, ...); a processor reading `input_ids` sees the prompt from column 0. `model_inputs`:
        the prompt's other inputs for an image-text-to-text model, as its processor returns them
        (`pixel_values`, `token_type_ids`, ...): the model's own forward prefills such a prompt, whole
        (`prefill_chunk_size` does not split it; with it set, one such prompt joins per step). For an
        encoder-decoder model (T5, BART, Marian, Whisper, ...) `prompt_ids` is the decoder's prompt (at least its
        start token, `model.generation_config.decoder_start_token_id`, as plain `generate()` begins) and
        `model_inputs` the source, a batch of one as the model's tokenizer or feature extractor returns it
        (`input_ids` / `input_features` and its `attention_mask`): the model's encoder reads it at admission.
        ValueError naming the field for bad input.
        """
        if self._row_processors is None:
            raise RuntimeError("this engine runs generate()'s fixed batch; it takes no requests")
        prompt = _prompt_array(prompt_ids, self.model.config.get_text_config().vocab_size)
        config = self._request_config(generation_config)
        if config.max_new_tokens is not None:
            max_length = len(prompt) + config.max_new_tokens
        elif config.max_length > len(prompt):
            max_length = config.max_length
        else:
            raise ValueError(
                f"generation_config: max_length={config.max_length} leaves no room after the prompt ({len(prompt)} "
                "tokens); set max_new_tokens"
            )
        if max_length > self.max_model_len:
            raise ValueError(
                f"prompt_ids ({len(prompt)} tokens) + max_new_tokens ({max_length - len(prompt)}) = {max_length} exceeds "
                f"max_model_len={self.max_model_len}"
            )
        num_blocks = self.cache.blocks_for(max_length + 1 + self._tree_slots)
        if num_blocks > self.cache.allocator.num_blocks:
            raise ValueError(
                f"the request may hold {max_length} tokens ({num_blocks} KV blocks) and the engine's pool has "
                f"{self.cache.allocator.num_blocks} blocks: lower max_new_tokens or raise num_kv_blocks"
            )
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or any(r.request_id == request_id for r in self._requests()):
            raise ValueError(f"request_id={request_id!r} must be a string not already in use")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if logprobs is not None and (
            not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} or None, got {logprobs!r}")
        encoder_input_ids = torch.from_numpy(prompt)[None]  # what encoder-reading processors read (a source)
        if self.model.config.is_encoder_decoder:
            model_inputs, position_ids = self._check_source(model_inputs), None
            encoder_input_ids = model_inputs[encoder_input_name(self.model)]
        else:
            model_inputs, position_ids = self._check_model_inputs(model_inputs, prompt)
            if model_inputs is None and prompt_attends_both_ways(self.model):
                model_inputs = {}  # no other inputs, but the model's own forward prefills every prompt (`cache/prefill.py`)
            problem = both_ways_prompt_problem(self.model, len(prompt))
            if problem:
                raise ValueError(f"prompt_ids: {problem}")
        constraint = self._request_processors(logits_processor, prompt_width=len(prompt))
        if grammar is not None:
            constraint.append(SpeculativeGrammar([self._check_grammar(grammar)], prompt_width=len(prompt)))
        generator = None
        if config.do_sample:
            seed = seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        config.max_length = max_length  # what plain generate() derives from max_new_tokens
        # the grammar goes where generate() puts a user's processor: before the sampling warpers
        processors = self.model._get_logits_processor(
            generation_config=config, input_ids_seq_length=len(prompt), encoder_input_ids=encoder_input_ids,
            logits_processor=constraint, device=self.model.device, model_kwargs={},
        )  # fmt: skip
        check_supported_processors(processors)
        draft_sampling = None if generator is None else DraftSampling.sampled(processors, seed)
        criteria = self.model._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=self.tokenizer)
        eos = config._eos_token_tensor
        eos_token_ids = frozenset() if eos is None else frozenset(int(t) for t in eos.flatten().tolist())
        self._waiting.append(
            _Request(
                request_id, prompt, max_length, processors, self._stop_checker_for(criteria, eos_token_ids),
                eos_token_ids, generator, num_blocks, logprobs, draft_sampling, model_inputs, position_ids,
            )
        )  # fmt: skip
        return request_id

    def _request_processors(self, given: Sequence[LogitsProcessor] | None, prompt_width: int) -> LogitsProcessorList:
        """A request's own processors, xgrammar's and `PrefixConstrainedLogitsProcessor` replaced by their
        speculative stand-ins."""
        if given is None:
            return LogitsProcessorList()
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not all(callable(p) for p in given):
            raise ValueError(
                f"logits_processor must be a list of transformers LogitsProcessor objects, got {type(given).__name__}"
            )
        for processor in given:
            if is_xgrammar_processor(processor):
                for compiled in processor.compiled_grammars:
                    self._check_grammar(compiled)
        return with_speculative_prefix_constraints(with_speculative_grammars(LogitsProcessorList(given), 1, prompt_width))

    def _check_model_inputs(
        self, given: dict[str, torch.Tensor] | None, prompt: np.ndarray
    ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
        """(the inputs on the model's device, the prompt's positions), both None without inputs."""
        if not given:
            return None, None
        if not isinstance(given, dict) or not all(
            isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in given.items()
        ):
            raise ValueError("model_inputs must be a dict of input names to tensors (what the model's processor returns)")
        handled = sorted(set(given) & ENGINE_INPUTS)
        if handled:
            raise ValueError(f"model_inputs: {handled} are the engine's own; allowed: the prompt's other inputs "
                             "(pixel_values, token_type_ids, ...)")  # fmt: skip
        check_model_prefill(self.model, given)
        given = {name: value.to(self.model.device) for name, value in given.items()}
        prompt_ids = torch.from_numpy(prompt)[None].to(self.model.device)
        try:  # a prompt the loop cannot continue (one ending with an M-RoPE image) is refused here, not at admission
            position_ids, _ = model_positions(self.model, prompt_ids, torch.ones_like(prompt_ids), given)
        except (IndexError, RuntimeError) as error:  # the index arithmetic on inputs that do not fit the prompt
            raise ValueError(f"model_inputs do not fit the prompt: {error}") from None
        return given, position_ids

    def _check_source(self, given: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """An encoder-decoder request's source (the encoder's inputs), on the model's device."""
        name, model = encoder_input_name(self.model), type(self.model).__name__
        if not isinstance(given, dict) or name not in given or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in given.items()
        ):
            raise ValueError(
                f"model_inputs: {model} is an encoder-decoder model; a request needs its source as "
                f"model_inputs={{'{name}': a batch of one source, 'attention_mask': its mask (optional)}}"
            )
        for key, value in given.items():
            if not value.ndim or value.shape[0] != 1:
                raise ValueError(f"model_inputs['{key}'] must be a batch of one source (first dimension 1), got shape {tuple(value.shape)}")
        source = given[name]
        if name == "input_ids":
            embeddings = encoder_token_embeddings(self.model.get_encoder())
            vocab_size = getattr(embeddings, "num_embeddings", None) or self.model.config.get_text_config().vocab_size
            if source.is_floating_point() or source.ndim != 2 or not source.numel() or source.min() < 0 or source.max() >= vocab_size:
                raise ValueError(f"model_inputs['input_ids'] must be a [1, length] tensor of token ids in [0, {vocab_size})")
            limit = source_limit(self.model)
            if limit is not None and source.shape[1] > limit:
                raise ValueError(f"model_inputs['input_ids']: the source has {source.shape[1]} tokens, the encoder takes {limit} at most")
        return {key: value.to(self.model.device) for key, value in given.items()}

    def _check_grammar(self, grammar: object) -> object:
        if type(grammar).__name__ != "CompiledGrammar" or not type(grammar).__module__.startswith("xgrammar"):
            raise ValueError(f"grammar must be an xgrammar CompiledGrammar, got {type(grammar).__name__}")
        vocab_size = self.model.config.get_text_config().vocab_size
        if grammar.tokenizer_info.vocab_size != vocab_size:
            raise ValueError(
                f"grammar: its tokenizer info has vocab_size {grammar.tokenizer_info.vocab_size}, the model's logits "
                f"{vocab_size}; build it with xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size={vocab_size})"
            )
        return grammar

    def _request_config(self, given: GenerationConfig | dict | None) -> GenerationConfig:
        if not (given is None or isinstance(given, (GenerationConfig, dict))):
            raise ValueError(f"generation_config must be a GenerationConfig, a dict or None, got {type(given).__name__}")
        # what plain generate() does: the given values over the model's generation config over the defaults
        config, unknown = self.model._prepare_generation_config(
            given if isinstance(given, GenerationConfig) else None, **(given if isinstance(given, dict) else {})
        )
        if unknown:
            raise ValueError(f"generation_config: unknown fields {sorted(unknown)} (see transformers' GenerationConfig)")
        config.validate()
        if config.num_beams != 1:
            raise ValueError(f"generation_config.num_beams={config.num_beams} is not supported; allowed: 1")
        if config.num_return_sequences != 1:
            raise ValueError(f"generation_config.num_return_sequences={config.num_return_sequences}; allowed: 1")
        for option in ASSISTED_OPTIONS:
            if getattr(config, option, None):
                raise ValueError(f"generation_config.{option} is transformers' own assisted generation; not with the engine")
        problem = unsupported_option(config, returns_outputs=True)
        if problem:
            raise ValueError(f"generation_config.{problem}; remove it")
        self.model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=self.model.device)
        return config

    def _stop_checker_for(self, criteria: StoppingCriteriaList, eos_token_ids: frozenset[int]) -> StopChecker:
        """The request's stop checker; requests that stop only on the same eos ids share one (checked in one
        call). The max length is each row's own (`DecodeState.max_lengths`)."""
        kept = StoppingCriteriaList(c for c in criteria if not isinstance(c, hf_stopping.MaxLengthCriteria))
        checker = StopChecker(kept)
        if checker.other:  # stop strings and the like: the request's own
            return checker
        return self._shared_stop_checkers.setdefault(eos_token_ids, checker)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row and blocks are free at once); False if unknown."""
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return True
        row = next((row for row, request in self._running.items() if request.request_id == request_id), None)
        if row is None:
            return False
        release_rows(self.state, self.cache, self.proposer, self.features, [row])
        self._free_slot(row)
        if not self._running:
            self._release_model()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or not self.state.finished.all()

    @property
    def num_running(self) -> int:
        return int((~self.state.finished).sum())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_kv_blocks_used(self) -> int:
        """The target's KV blocks holding tokens now (0 once every request has finished or been aborted)."""
        return self.cache.num_blocks_used

    def _requests(self):
        yield from self._waiting
        yield from self._running.values()

    # --- steps ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, run one speculative step; an output per request that emitted or finished.

        If the step raises, every running request ends with finish_reason "error" (the waiting ones stay).
        """
        failed = self._admit()
        if not self._running:
            self._release_model()
            return failed
        started = time.perf_counter()
        try:
            # the emitted tokens' logits are gathered only for a step where some request reads them
            emitted = self.decode_step(keep_logits=any(r.num_top_logprobs is not None for r in self._running.values()))
        except Exception as error:  # one step's failure ends its requests, not the engine
            logger.exception("speculative step failed; ending the %d running request(s)", len(self._running))
            return failed + self._fail_running(error)
        self.metrics.total_seconds += time.perf_counter() - started
        outputs = failed
        for row, tokens, raw_logits, _ in emitted:
            request = self._running[row]
            new = tokens.tolist()
            request.output.extend(new)
            finished = bool(self.state.finished[row])
            outputs.append(RequestOutput(
                request.request_id, new, list(request.output), len(request.prompt), finished,
                self._finish_reason(request, row) if finished else None,
                logprobs=None if request.num_top_logprobs is None else token_logprobs(
                    raw_logits, new, request.num_top_logprobs
                ),
            ))  # fmt: skip
            if finished:  # the step freed its cache row and drafter state
                self._free_slot(row)
        if not self._running:
            self._release_model()
        return outputs

    def decode_step(self, keep_logits: bool = False) -> list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """One `speculative_step` over the running rows: per row, (row, emitted tokens, raw, processed logits)."""
        self._hold_model()
        if self._row_processors is None:
            processors = self.logits_processor
        elif self._row_processors.any_for(self.state.active_rows()):
            processors = LogitsProcessorList([self._row_processors])
        else:
            processors = LogitsProcessorList()
        with torch.no_grad():
            return speculative_step(
                self.model, self.state, self.proposer, self.cache, self.config, processors, self.stop_checker,
                self.sampling, self.metrics, self.features, k_controller=self.k_controller,
                tree_controller=self.tree_controller, keep_logits=keep_logits, prefill_chunk=self.prefill_chunk_size,
                ends_together=self._row_processors is None,  # generate()'s fixed batch, not requests coming and going
            )  # fmt: skip

    def _admit(self) -> list[RequestOutput]:
        """Start waiting requests, first come first served, while a row and their blocks are free. Returns
        the outputs of requests that failed to start (their model's own prefill or encoder raised)."""
        joining, encoded = [], 0  # joining: (row, request) to prefill; encoded: source tokens for the encoder
        free_rows = [row for row in range(self.max_batch_size) if row not in self._running]
        while self._waiting and free_rows:
            request = self._waiting[0]
            if self._reserved_blocks + request.num_blocks > self.cache.allocator.num_blocks:
                break  # it waits for blocks that running requests will free
            if self.prefill_chunk_size is not None and request.model_inputs is not None:
                if self.model.config.is_encoder_decoder:  # sources of prefill_chunk_size tokens a step (one at least)
                    source_len = self._prefill_length(request)
                    if encoded and encoded + source_len > self.prefill_chunk_size:
                        break
                    encoded += source_len
                elif joining:
                    break  # with chunked prefill, one image prefill per step: the running rows wait for one at most
            self._waiting.popleft()
            row = free_rows.pop(0)
            state, length = self.state, len(request.prompt)
            state.token_buffer[row].fill_(state.pad_token_id)
            state.token_buffer[row, :length] = torch.from_numpy(request.prompt)
            state.pad_lens[row], state.seq_lens[row], state.num_cached[row], state.position_offsets[row] = 0, length, 0, 0
            state.max_lengths[row], state.finished[row] = request.max_length, False
            self.sampling.is_greedy[row] = request.generator is None
            self.sampling.generators[row] = request.generator
            if request.draft_sampling is not None:  # released with the row
                set_row_sampling(self.proposer, row, request.draft_sampling)
            self._row_processors.by_row[row] = request.processors
            self._row_stops.by_row[row] = request.stop_checker
            self._running[row] = request
            self._reserved_blocks += request.num_blocks
            if request.model_inputs is not None:
                joining.append((row, request))
        groups = _batchable_groups(joining, [self._prefill_length(request) for _, request in joining])
        return [failure for group in groups for failure in self._prefill_joining(group)]

    def _prefill_length(self, request: _Request) -> int:
        """Positions the request's own prefill runs over: its source's (tokens, frames) for an encoder-decoder model."""
        if self.model.config.is_encoder_decoder:
            return int(request.model_inputs[encoder_input_name(self.model)].shape[-1])
        return len(request.prompt)

    def _prefill_joining(self, group: list[tuple[int, _Request]]) -> list[RequestOutput]:
        """One forward of the model's own prefill (or its encoder) for requests that joined together with
        inputs of one shape, as plain generate() runs a batch. If it raises, each runs alone, so a request
        whose inputs fail fails alone (with finish_reason "error"), the engine and the others go on."""
        try:
            self._prefill_rows(group)
            return []
        except Exception as error:  # the requests' own inputs
            if len(group) == 1:
                logger.exception("the model's own prefill or encoder of request %s failed", group[0][1].request_id)
                return [self._fail_row(group[0][0], error)]
        for row, request in group:  # whatever the batch left in the rows' cache and drafters, before each runs alone
            release_rows(self.state, self.cache, self.proposer, self.features, [row])
            self.state.finished[row] = False
            if request.draft_sampling is not None:  # (the release dropped it)
                set_row_sampling(self.proposer, row, request.draft_sampling)
        return [failure for one in group for failure in self._prefill_joining([one])]

    def _prefill_rows(self, group: list[tuple[int, _Request]]) -> None:
        """The model's own forward prefills the rows' prompts but their last tokens (`cache/prefill.py`), or
        an encoder-decoder model's encoder reads their sources as plain generate() does before decoding, on the
        model's own attention and linears; the outputs go to the paged cache and the drafters."""
        self._pause_decoding()
        rows, requests = [row for row, _ in group], [request for _, request in group]
        inputs = {name: torch.cat([r.model_inputs[name] for r in requests]) for name in requests[0].model_inputs}
        with torch.no_grad():
            if self.model.config.is_encoder_decoder:
                name, config = encoder_input_name(self.model), self.model.generation_config
                source = inputs.pop(name)
                prepared = self.model._maybe_prepare_encoder_kwargs_for_generation(source, dict(inputs), name, config)
                hand_over_sources(self, rows, prepared["encoder_outputs"], inputs.get("attention_mask"), source, config)
            else:
                prompts = torch.from_numpy(np.stack([r.prompt for r in requests])).to(self.model.device)
                given = [r.position_ids for r in requests]
                position_ids = None if given[0] is None else torch.cat(given, dim=-2)  # [..., batch, width]
                prefilled = prefill_with_model(
                    self.model, prompts, torch.ones_like(prompts), position_ids, inputs, self.cache,
                    self.hold_capture(), rows=rows,
                )  # fmt: skip
                self.state.num_cached[rows], self.state.position_offsets[rows] = prefilled.num_cached, prefilled.position_offsets
        if self.k_controller is not None:  # the next steps carry the drafter's catch-up: not decode steps
            self.k_controller.begin_call()

    def _finish_reason(self, request: _Request, row: int) -> str:
        tokens = self.state.tokens(row)
        if int(tokens[-1]) in request.eos_token_ids or len(tokens) < request.max_length:
            return "stop"  # eos, or a stop string before the length limit
        ended_by_stop_string = any(
            bool(criterion(torch.from_numpy(tokens)[None], None).any()) for criterion in request.stop_checker.other
        )
        return "stop" if ended_by_stop_string else "length"

    def _free_slot(self, row: int) -> None:
        request = self._running.pop(row)
        self._reserved_blocks -= request.num_blocks
        self._row_processors.by_row.pop(row, None)
        self._row_stops.by_row.pop(row, None)
        self.sampling.generators[row] = None

    def _fail_running(self, error: Exception) -> list[RequestOutput]:
        outputs = [self._fail_row(row, error) for row in list(self._running)]
        self._release_model()
        return outputs

    def _fail_row(self, row: int, error: Exception) -> RequestOutput:
        """End the row's request with finish_reason "error"; its row and blocks are free."""
        request = self._running[row]
        with contextlib.suppress(Exception):  # the failure may have left the drafter half-updated
            release_rows(self.state, self.cache, self.proposer, self.features, [row])
        # whatever release_rows could not finish: the row must end and its blocks return to the pool
        self.state.finished[row] = True
        self.cache.free_row(row)
        self._free_slot(row)
        return RequestOutput(
            request.request_id, [], list(request.output), len(request.prompt), True, "error",
            f"{type(error).__name__}: {error}",
        )

    # --- the model, switched while rows run -------------------------------------------------------------
    def hold_capture(self) -> TargetFeatureCapture | None:
        """Hooks capturing the target's hidden states for drafters that read them (None for others)."""
        if self._held is None:
            self._held = contextlib.ExitStack()
            self.features = self._held.enter_context(capture_for_proposer(self.model, self.proposer))
        return self.features

    def _hold_model(self) -> None:
        """Paged attention and the CPU linears' routes on, kept on across steps (switching them costs
        ~1% of a step) until the engine is idle."""
        self.hold_capture()
        if self._decoding is None:  # closed before `_held` (entered after it), never held by it: it may pause
            self._decoding = contextlib.ExitStack()
            self._decoding.enter_context(use_paged_attention(self.model))
            if self._fast_linears is not None:
                self._decoding.enter_context(self._fast_linears())

    def _pause_decoding(self) -> None:
        """The model's own attention and linears back until the next step (the features' hooks stay)."""
        if self._decoding is not None:
            self._decoding.close()
            self._decoding = None

    def _release_model(self) -> None:
        self._pause_decoding()
        if self._held is not None:
            self._held.close()
        self._held, self.features = None, None

    def close(self) -> None:
        """Abort every request and give the model back as it was."""
        for request in list(self._requests()):
            self.abort(request.request_id)
        self._release_model()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the logits of its position (a row each), and the `num_top`
    most likely tokens' (log-softmax in float32 over the whole vocabulary)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprob(token, value, list(zip(ids, values)))
        for token, value, ids, values in zip(token_ids, chosen, top_ids.tolist(), top_values.tolist())
    ]


def model_max_length(model: PreTrainedModel) -> int:
    """The most positions the model (an encoder-decoder model's decoder) takes: its config's
    max_position_embeddings or max_target_positions (Whisper); 2**20 when it has neither."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "max_target_positions", None) or 2**20)


def _prompt_array(prompt_ids, vocab_size: int) -> np.ndarray:
    prompt = np.asarray(prompt_ids.cpu() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)
    if prompt.ndim != 1 or len(prompt) == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {prompt.shape} ({prompt.dtype})")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(f"prompt_ids must be token ids in [0, {vocab_size}), got {int(prompt.min())}..{int(prompt.max())}")
    return prompt.astype(np.int64)


def _check_tree_request(cache: PagedKVCache) -> None:
    if isinstance(cache, OwnAttentionCache):
        raise ValueError(
            "speculative_config.tree is not supported on models with their own attention (those the paged attention "
            "cannot run, as BLOOM or GPT-Neo: they build their own causal mask, which a tree's mask would replace)"
        )
    if cache.recurrent is not None:
        raise ValueError(
            "speculative_config.tree is not supported on models with recurrent layers: their state follows one "
            "path, a tree has many"
        )
    if any(kind in ("sliding", "chunked") for kind, _ in cache.layer_kinds or ()):
        raise ValueError(
            "speculative_config.tree is not supported on models with sliding-window or chunked attention layers yet "
            "(a window over a tree's slots is not defined)"
        )


def _batchable_groups(joining: list[tuple[int, _Request]], lengths: list[int]) -> list[list[tuple[int, _Request]]]:
    """Requests joining in one step, grouped (in arrival order) where one batch runs their prefill or encoder:
    prompts of one length and inputs of one shape, each input a batch of one (first dimension 1), so the batch
    needs no padding (a padded row can read other values than the row alone) and stacking them is how a
    processor batches them; at most `BATCHED_PREFILL_LENGTH` positions (`lengths`, per request) a batch. Others
    (an input of several images or patches in one tensor, a longer prompt) run alone."""
    groups: dict[object, list[list[tuple[int, _Request]]]] = {}
    for index, ((row, request), length) in enumerate(zip(joining, lengths)):
        inputs = request.model_inputs
        key: object = index  # alone
        if all(value.ndim and value.shape[0] == 1 for value in inputs.values()):
            positions = request.position_ids
            key = (
                len(request.prompt), None if positions is None else tuple(positions.shape),
                tuple(sorted((name, tuple(value.shape), value.dtype) for name, value in inputs.items())),
            )  # fmt: skip
        batches = groups.setdefault(key, [[]])
        if batches[-1] and (len(batches[-1]) + 1) * length > BATCHED_PREFILL_LENGTH:
            batches.append([])
        batches[-1].append((row, request))
    return [batch for batches in groups.values() for batch in batches]
