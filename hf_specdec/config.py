"""`SpeculativeConfig`: the validated description of how to speculate.

Keys follow vLLM's `--speculative-config` (method, model, num_speculative_tokens,
prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, the suffix_* options of its suffix
decoding, rejection_sample_method) plus a few of our own (prompt_lookup_num_tokens, seed,
block_size, num_kv_blocks, early_exit_layer, max_speculative_tokens, cpu_linear_backend,
suffix_first, suffix_cache, tree).
Every invalid value raises `ValueError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", "layer_skip")
METHODS_NEEDING_MODEL = ("eagle", "eagle3", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
AUTO = "auto"
DEFAULT_MAX_AUTO_TOKENS = 8
CPU_LINEAR_BACKENDS = ("auto", "numba", "onednn", "torch")
REJECTION_SAMPLE_METHODS = ("token", "block")
TREE_METHODS = ("ngram", "eagle", "eagle3", "draft_model")
MAX_TREE_NODES = 256
MAX_TREE_TOPK = 16
DEFAULT_TREE_TOPK = 4
AUTO_TREE_MAX_NODES = 64  # "tree": "auto" picks each step's size among 4, 8, ... up to this


@dataclass(frozen=True)
class TreeSpec:
    """The draft tree a drafter builds for each row every step (`speculative_config["tree"]`).

    Dynamic (EAGLE-2): expand the `topk` best children of the best nodes, depth after depth, ranking
    nodes by their cumulative draft log-probability, and keep the `num_nodes` best overall, at most
    `depth` deep. Static: the nodes are `static_paths`, each given as its path of child ranks from
    the root ((0,) the best child of the root, (0, 1) the second-best child of that), the layout the
    EAGLE authors and Medusa publish.
    """

    num_nodes: int
    topk: int
    depth: int
    static_paths: tuple[tuple[int, ...], ...] | None = None
    auto: bool = False  # "auto": the loop picks each step's size up to num_nodes (`loop/auto_tree.py`)

    def for_step(self, max_nodes: int | None) -> TreeSpec:
        """This spec with at most `max_nodes` nodes (the size "auto" picked for the step); None: unchanged."""
        if max_nodes is None or self.static_paths is not None or max_nodes >= self.num_nodes:
            return self
        return dataclasses.replace(self, num_nodes=max_nodes)

    @classmethod
    def parse(cls, value: Any, max_depth: int) -> TreeSpec:
        """From the `tree` key's value: {"num_nodes", "topk", "depth"}, {"static": [[...], ...]} or "auto"."""
        if value == AUTO:
            return cls(num_nodes=AUTO_TREE_MAX_NODES, topk=DEFAULT_TREE_TOPK, depth=max_depth, auto=True)
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config.tree={value!r} is invalid; allowed: None, "
                '{"num_nodes": N, "topk": K, "depth": D}, {"static": [[0], [1], [0, 0], ...]} or "auto"'
            )
        if "static" in value:
            extra = sorted(set(value) - {"static"})
            if extra:
                raise ValueError(f"speculative_config.tree: a static tree takes only 'static', got also {extra}")
            return cls._static(value["static"], max_depth)
        unknown = sorted(set(value) - {"num_nodes", "topk", "depth"})
        if unknown:
            raise ValueError(f"speculative_config.tree has unknown keys {unknown}; allowed: num_nodes, topk, depth, static")
        num_nodes, topk = value.get("num_nodes"), value.get("topk", DEFAULT_TREE_TOPK)
        depth = value.get("depth", max_depth)
        if not _is_int_in(num_nodes, 1, MAX_TREE_NODES):
            raise ValueError(
                f"speculative_config.tree.num_nodes={num_nodes!r} is out of range; allowed: an integer from 1 to {MAX_TREE_NODES}"
            )
        if not _is_int_in(topk, 1, MAX_TREE_TOPK):
            raise ValueError(
                f"speculative_config.tree.topk={topk!r} is out of range; allowed: an integer from 1 to {MAX_TREE_TOPK}"
            )
        if not _is_int_in(depth, 1, max_depth):
            raise ValueError(
                f"speculative_config.tree.depth={depth!r} is out of range; allowed: an integer from 1 to "
                f"num_speculative_tokens ({max_depth})"
            )
        return cls(num_nodes=num_nodes, topk=topk, depth=depth)

    @classmethod
    def _static(cls, paths: Any, max_depth: int) -> TreeSpec:
        valid = isinstance(paths, (list, tuple)) and paths and all(
            isinstance(path, (list, tuple)) and path and all(_is_int_in(rank, 0, MAX_TREE_TOPK - 1) for rank in path)
            for path in paths
        )
        if not valid:
            raise ValueError(
                "speculative_config.tree.static must be a non-empty list of paths, each a non-empty list of child "
                f"ranks from 0 to {MAX_TREE_TOPK - 1} (e.g. [[0], [1], [0, 0]])"
            )
        nodes = [tuple(path) for path in paths]
        if len(set(nodes)) != len(nodes):
            raise ValueError("speculative_config.tree.static lists a path twice; each node must appear once")
        missing = sorted({node[:-1] for node in nodes if len(node) > 1} - set(nodes))
        if missing:
            raise ValueError(
                f"speculative_config.tree.static is not a tree: the paths {[list(m) for m in missing]} are prefixes of "
                "other paths but not listed themselves"
            )
        if len(nodes) > MAX_TREE_NODES:
            raise ValueError(f"speculative_config.tree.static has {len(nodes)} nodes; allowed: at most {MAX_TREE_NODES}")
        depth = max(len(node) for node in nodes)
        if depth > max_depth:
            raise ValueError(
                f"speculative_config.tree.static is {depth} deep; allowed: at most num_speculative_tokens ({max_depth})"
            )
        nodes.sort(key=lambda node: (len(node), node))  # parents first, siblings by rank
        topk = max(node[-1] for node in nodes) + 1
        return cls(num_nodes=len(nodes), topk=topk, depth=depth, static_paths=tuple(nodes))


@dataclass(frozen=True)
class SpeculativeConfig:
    """How `generate()` speculates.

    Args:
        method: one of "ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", "layer_skip".
        model: the drafter (folder or Hub id) for methods that need one.
        num_speculative_tokens: k, draft tokens proposed per row and step (1..32), or "auto": each
            step picks k in 0..max_speculative_tokens from the measured acceptance and step costs
            (`auto_k.py`; 0 decodes without drafting).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first. As in vLLM a
            missing one takes the other's value; for "ngram", when neither is given they are 1 and
            4 (vLLM uses 5 and 5: a wrong draft costs little here, so short n-grams pay). With any
            other method, giving either puts an n-gram lookup first: rows whose context has a match
            take its drafts, the others get the method's drafter (`proposers/ngram_first.py`).
        prompt_lookup_num_tokens: with that n-gram stage, drafts per match (1..32; default
            num_speculative_tokens), so a head can draft k=1 while matches run longer. Not with
            "auto", where both take the step's k.
        disable_by_batch_size: stop drafting while this many rows or more are still generating.
        seed: seeds the per-row random generators of the rejection sampler; None draws the seed
            from torch's global generator, so `torch.manual_seed` makes runs reproducible.
        block_size: tokens per KV-cache block.
        num_kv_blocks: size of the KV block pool; None sizes it from the request.
        early_exit_layer: N for method="layer_skip" (required there, nowhere else): draft with the
            target's first N layers; 1..num_hidden_layers-1, the upper bound checked against the model.
        max_speculative_tokens: the largest k "auto" may pick (1..32, default 8); only with "auto".
        suffix_first: with a method other than "ngram" / "suffix", a suffix lookup drafts first (as the
            n-gram stage of prompt_lookup_*, and before it when both are given): rows whose history
            matches take its drafts (up to the loop's k: num_speculative_tokens, or
            prompt_lookup_num_tokens where longer), the others get the method's drafter.
        suffix_max_tree_depth: ("suffix" / suffix_first) the suffix tries hold every substring of at
            most this many tokens: a matched suffix of m tokens drafts at most this - m (>= 1).
        suffix_max_cached_requests: how many earlier outputs the model's own global suffix cache
            keeps, the oldest evicted first (0: no global cache). A `suffix_cache` passed in keeps
            its own `max_cached_requests` instead.
        suffix_max_spec_factor: a draft is at most this many times the matched suffix's length (a finite
            number > 0).
        suffix_min_token_prob: the draft ends before the token at which the product of the
            continuations' empirical probabilities (count / all continuations of the suffix) falls
            below this (0..1; 0: never).
        suffix_cache: the global cache of earlier outputs to use (a `hf_specdec.drafters.SuffixCache`,
            shareable between models, calls and threads; warm it with `add_outputs`); None: the
            target model's own (kept as its attribute `hf_specdec_suffix_cache`).
        rejection_sample_method: "token" (default: each draft token accepted on its own) or "block"
            (block verification, Sun et al. 2024: whole draft blocks, a higher expected accepted length;
            sampled rows only, greedy rows accept the same either way).
        tree: draft a tree per row instead of a chain (`TreeSpec`; methods ngram, eagle, eagle3,
            draft_model): {"num_nodes": N, "topk": K, "depth": D} (dynamic, EAGLE-2; depth defaults to
            num_speculative_tokens, the deepest a path may go), {"static": [[0], [1], [0, 0], ...]}, or
            "auto" (dynamic, topk 4, each step's size picked from the measured throughput of each size).
        cpu_linear_backend: how the target's and drafter's fp32 CPU linears run while speculating:
            "auto" (default: per input row count, the fastest of torch's BLAS (asked two ways),
            oneDNN and our numba kernel, timed once per machine on the model's own linears and stored:
            `hf-specdec plan-linears` re-times it),
            "numba" (few-row inputs in our numba kernel, more through oneDNN), "onednn" (an error
            where torch has none) or "torch" (torch's default BLAS). No effect on GPU or other dtypes; see
            `cpu_linear.py`.
    """

    method: str = "ngram"
    model: Any = None
    num_speculative_tokens: int | str = 5
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_num_tokens: int | None = None
    disable_by_batch_size: int | None = None
    seed: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    early_exit_layer: int | None = None
    max_speculative_tokens: int | None = None
    cpu_linear_backend: str = "auto"
    suffix_first: bool = False
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 10000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache: Any = None
    rejection_sample_method: str = "token"
    tree: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        self._check_num_speculative_tokens()
        if self.method in METHODS_NEEDING_MODEL and self.model is None:
            raise ValueError(
                f"speculative_config.model is required for method={self.method!r} "
                "(a folder, a Hub id or a loaded model)"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model must be None for method='ngram' (it drafts from the context)")
        self._check_prompt_lookup()
        _check_optional_int("disable_by_batch_size", self.disable_by_batch_size, minimum=1)
        _check_optional_int("seed", self.seed, minimum=0)
        _check_optional_int("block_size", self.block_size, minimum=1)
        _check_optional_int("num_kv_blocks", self.num_kv_blocks, minimum=1)
        self._check_layer_skip()
        if self.cpu_linear_backend not in CPU_LINEAR_BACKENDS:
            raise ValueError(
                f"speculative_config.cpu_linear_backend={self.cpu_linear_backend!r} is unknown; "
                f"allowed: {', '.join(CPU_LINEAR_BACKENDS)}"
            )
        self._check_suffix()
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.rejection_sample_method={self.rejection_sample_method!r} is unknown; "
                f"allowed: {', '.join(REJECTION_SAMPLE_METHODS)}"
            )
        self._check_tree()

    def _check_tree(self) -> None:
        if self.tree is None or isinstance(self.tree, TreeSpec):
            return
        if self.method not in TREE_METHODS:
            raise ValueError(
                f"speculative_config.tree is not supported with method={self.method!r}; allowed with: {', '.join(TREE_METHODS)}"
            )
        if self.auto_k:
            raise ValueError(f"speculative_config.tree needs a fixed num_speculative_tokens (the deepest path), not {AUTO!r}")
        if self.ngram_first or self.suffix_first:
            raise ValueError("speculative_config.tree cannot be combined with an n-gram / suffix stage first (prompt_lookup_*, suffix_first)")
        if self.rejection_sample_method != "token":
            raise ValueError("speculative_config.tree verifies with multi-candidate rejection; allowed rejection_sample_method: 'token'")
        object.__setattr__(self, "tree", TreeSpec.parse(self.tree, self.num_speculative_tokens))

    def _check_suffix(self) -> None:
        if not isinstance(self.suffix_first, bool):
            raise ValueError(f"speculative_config.suffix_first={self.suffix_first!r} is invalid; allowed: true or false")
        if self.suffix_first and self.method in ("ngram", "suffix"):
            raise ValueError(
                f"speculative_config.suffix_first puts suffix drafts before another method's drafter; "
                f"method={self.method!r} has none (allowed with: {', '.join(m for m in METHODS if m not in ('ngram', 'suffix'))})"
            )
        if self.method == "suffix" and self.model is not None:
            raise ValueError("speculative_config.model must be None for method='suffix' (it drafts from token history)")
        for name, minimum in (("suffix_max_tree_depth", 1), ("suffix_max_cached_requests", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"speculative_config.{name}={value!r} is invalid; allowed: an integer >= {minimum}")
        factor, probability = self.suffix_max_spec_factor, self.suffix_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(
                f"speculative_config.suffix_max_spec_factor={factor!r} is invalid; allowed: a finite number > 0 "
                "(a draft may be up to this many times the matched suffix's length)"
            )
        if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0 <= probability <= 1:
            raise ValueError(
                f"speculative_config.suffix_min_token_prob={probability!r} is invalid; allowed: a number from 0 to 1"
            )
        if self.suffix_cache is not None:
            from .drafters.suffix import SuffixCache  # here: the drafters import this module

            if not isinstance(self.suffix_cache, SuffixCache):
                raise ValueError(
                    f"speculative_config.suffix_cache={type(self.suffix_cache).__name__} is invalid; "
                    "allowed: None or a hf_specdec.drafters.SuffixCache"
                )
            if self.method != "suffix" and not self.suffix_first:
                raise ValueError(
                    f"speculative_config.suffix_cache is only used by method='suffix' or suffix_first=True, "
                    f"not method={self.method!r}"
                )

    def _check_num_speculative_tokens(self) -> None:
        k, k_max = self.num_speculative_tokens, self.max_speculative_tokens
        if k == AUTO:
            if k_max is None:
                object.__setattr__(self, "max_speculative_tokens", DEFAULT_MAX_AUTO_TOKENS)
            elif not _is_int_in(k_max, 1, MAX_SPECULATIVE_TOKENS):
                raise ValueError(
                    f"speculative_config.max_speculative_tokens={k_max!r} is out of range; "
                    f"allowed: an integer from 1 to {MAX_SPECULATIVE_TOKENS} (default {DEFAULT_MAX_AUTO_TOKENS})"
                )
            return
        if not _is_int_in(k, 1, MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k!r} is out of range; "
                f"allowed: an integer from 1 to {MAX_SPECULATIVE_TOKENS}, or {AUTO!r}"
            )
        if k_max is not None:
            raise ValueError(
                f"speculative_config.max_speculative_tokens is only used with num_speculative_tokens={AUTO!r}, "
                f"not {k!r}"
            )

    def _check_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _check_optional_int("prompt_lookup_min", lo, minimum=1)
        _check_optional_int("prompt_lookup_max", hi, minimum=1)
        if self.method == "ngram" and lo is None and hi is None:
            lo, hi = 1, 4
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo is not None and lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}; "
                "allowed: 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.prompt_lookup_num_tokens is None:
            return
        if self.method == "ngram" or hi is None:
            raise ValueError(
                "speculative_config.prompt_lookup_num_tokens is only used with an n-gram stage before another "
                "method (give prompt_lookup_min / prompt_lookup_max with it); method='ngram' drafts "
                "num_speculative_tokens"
            )
        if self.auto_k:
            raise ValueError(
                f"speculative_config.prompt_lookup_num_tokens cannot be combined with num_speculative_tokens={AUTO!r} "
                "(both stages then draft the step's k); allowed: None"
            )
        if not _is_int_in(self.prompt_lookup_num_tokens, 1, MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"speculative_config.prompt_lookup_num_tokens={self.prompt_lookup_num_tokens!r} is out of range; "
                f"allowed: an integer from 1 to {MAX_SPECULATIVE_TOKENS}"
            )

    @property
    def ngram_first(self) -> bool:
        """Whether an n-gram lookup drafts first and the method's drafter takes the rows without a match."""
        return self.method != "ngram" and self.prompt_lookup_max is not None

    @property
    def auto_k(self) -> bool:
        """Whether each step picks its own k (num_speculative_tokens="auto")."""
        return self.num_speculative_tokens == AUTO

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens a row gets in one step: k, or max_speculative_tokens with "auto".
        Drafters are built for this many."""
        if self.auto_k:
            return self.max_speculative_tokens
        return max(self.num_speculative_tokens, self.prompt_lookup_num_tokens or 0)

    def _check_layer_skip(self) -> None:
        if self.method != "layer_skip":
            if self.early_exit_layer is not None:
                raise ValueError(
                    f"speculative_config.early_exit_layer is only used by method='layer_skip', not {self.method!r}"
                )
            return
        if self.model is not None:
            raise ValueError("speculative_config.model must be None for method='layer_skip' (the target drafts)")
        if self.early_exit_layer is None:
            raise ValueError(
                "speculative_config.early_exit_layer is required for method='layer_skip'; "
                "allowed: an integer from 1 to the model's num_hidden_layers - 1"
            )
        _check_optional_int("early_exit_layer", self.early_exit_layer, minimum=1)

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | str | None = None, **kwargs: Any) -> SpeculativeConfig:
        """Build from a `SpeculativeConfig`, a dict, a JSON string, or keyword arguments."""
        if isinstance(value, cls):
            return dataclasses.replace(value, **kwargs) if kwargs else value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig, a dict or a JSON string, "
                f"got {type(value).__name__}"
            )
        merged = {**value, **kwargs}
        allowed = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(merged) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {', '.join(allowed)}")
        return cls(**merged)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), (int, float, str, type(None)))}


def _is_int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{name}={value!r} is invalid; allowed: None or an integer >= {minimum}")
