"""The arms of a benchmark: what each passes to `model.generate()`.

- "plain": transformers' greedy `generate()`;
- "plain_fast_linears" (`plain_fast_linears=True`): the same inside `fast_cpu_linears(model)` with
  the fp32 CPU linear backend ours uses (`cpu_linear.py`): ours against it is the part of the
  speedup that speculation alone brings;
- "transformers": transformers' own speculation for the method, where it has one (batch size 1
  only: its assisted generation refuses larger batches): prompt lookup for ngram, an assistant
  model for draft_model, `assistant_early_exit` for layer_skip, `use_mtp` for mtp;
- "ours": `speculative_config` at the requested k (or "auto");
- "ours_k{k}": ours at each k of the sweep (the speedup-vs-k plot);
- "ours_{backend}": ours at the requested k with another fp32 CPU linear backend, one per backend
  asked for: an A/B of the GEMM routes, interleaved like every other arm;
- "ours_{method}": another of our drafters at the same k, one per method asked for (e.g. suffix
  against ngram on the same prompts), with that method's defaults;
- "ours_tree{N}": ours drafting a tree (`speculative_config["tree"]`) instead of a chain, one per
  tree asked for (`tree_arm_names`), the rest of ours' config unchanged: tree sizes against the
  chain, interleaved like every other arm. (Ours itself drafts a tree when `extra_config` has one.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel

from ..config import DEFAULT_TREE_TOPK, SpeculativeConfig
from ..drafters.draft_model import load_draft_model
from ..models.cpu_linear import resolve_backend

TOKEN_METHODS = ("ngram", "suffix")  # drafters that need no model: what compare_methods may name


@dataclass
class BenchSettings:
    """What to compare.

    Args:
        method: our drafter (`speculative_config.method`).
        k: num_speculative_tokens of the "ours" arm, an int or "auto".
        batch_size: prompts per generate() call.
        max_new_tokens: per generate() call.
        sweep_ks: ks of the sweep arms ("ours" stands in for its own k).
        draft: `speculative_config.model` (draft model / EAGLE head: folder, Hub id or loaded).
        early_exit_layer: layer_skip's N.
        extra_config: more speculative_config keys, for every arm of ours (prompt_lookup_min, ...).
        plain_fast_linears: add the "plain_fast_linears" arm.
        cpu_linear_backends: more arms of ours, one per `cpu_linear_backend` named ("ours_<backend>").
        compare_methods: more arms of ours, one per drafter method named ("ours_<method>"); methods
            that read tokens only (ngram, suffix): the others would need their own draft / settings.
        trees: more arms of ours, one per draft tree (a `speculative_config["tree"]` value: {"num_nodes",
            "topk", "depth"} or {"static": [...]}), named by `tree_arm_names`. A tree's
            num_speculative_tokens is its depth where the tree gives one (a dynamic tree's "depth",
            a static tree's deepest path), else `k`.
        verify_repeats: timed repeats of each arm's verify forward against a 1-token forward
            (`verify_cost.py`; 0: not timed).
        profile: break ours' decode steps down by part (`profiling.py`), next to the closed form's
            prediction from the measured acceptance and draft cost (`profile_summary`).
        temperature: None for greedy (every arm checked token for token against plain); a float
            samples every arm at that temperature (seeded per batch; outputs then differ from plain's
            draw for draw, their distribution does not, so rows are not compared).
        top_p, top_k: with `temperature`, every arm's top-p / top-k (None: the model's generation config).
    """

    method: str = "ngram"
    k: int | str = 5
    batch_size: int = 1
    max_new_tokens: int = 256
    sweep_ks: tuple[int, ...] = ()
    draft: Any = None
    early_exit_layer: int | None = None
    extra_config: dict = field(default_factory=dict)
    plain_fast_linears: bool = False
    cpu_linear_backends: tuple[str, ...] = ()
    compare_methods: tuple[str, ...] = ()
    trees: tuple[dict, ...] = ()
    verify_repeats: int = 5
    profile: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def speculative_config(
        self, k: int | str, cpu_linear_backend: str | None = None, method: str | None = None, tree: dict | None = None
    ) -> SpeculativeConfig:
        """Our config at `k`, with `cpu_linear_backend` where given (validated: a bad setting fails
        before any run); `method`: another token-reading drafter with its defaults (a compare arm);
        `tree`: drafting that tree (a tree arm: num_speculative_tokens from the tree's depth, see `trees`)."""
        if method is not None and method != self.method:
            if method not in TOKEN_METHODS:
                raise ValueError(f"--compare-methods {method!r} is not allowed; allowed: {', '.join(TOKEN_METHODS)}")
            config = {"method": method, "num_speculative_tokens": k}
            if cpu_linear_backend is not None or "cpu_linear_backend" in self.extra_config:
                config["cpu_linear_backend"] = cpu_linear_backend or self.extra_config["cpu_linear_backend"]
            return SpeculativeConfig.from_any(config)
        config = {"method": self.method, "num_speculative_tokens": k, **self.extra_config}
        if cpu_linear_backend is not None:
            config["cpu_linear_backend"] = cpu_linear_backend
        if self.draft is not None:
            config["model"] = self.draft
        if self.early_exit_layer is not None:
            config["early_exit_layer"] = self.early_exit_layer
        if tree is not None:
            config["tree"] = tree
            config["num_speculative_tokens"] = tree_depth(tree) or k
        return SpeculativeConfig.from_any(config)

    def to_dict(self) -> dict:
        """JSON-friendly: a loaded draft is named by its class."""
        draft = self.draft if self.draft is None or isinstance(self.draft, str) else type(self.draft).__name__
        return {
            **self.__dict__,
            "draft": draft,
            "sweep_ks": list(self.sweep_ks),
            "cpu_linear_backends": list(self.cpu_linear_backends),
            "compare_methods": list(self.compare_methods),
            "trees": list(self.trees),
        }


@dataclass
class Arm:
    """One way of generating: a name, the generate() keyword arguments, our k (None: not ours), and
    the `fast_cpu_linears(model, backend=...)` generate() runs inside (None: none)."""

    name: str
    generate_kwargs: dict
    k: int | str | None = None
    cpu_linear_backend: str | None = None


def build_arms(settings: BenchSettings, model: PreTrainedModel) -> list[Arm]:
    """plain, plain_fast_linears (if asked), transformers' own (batch size 1, where it exists), ours,
    the sweep's other ks, ours with each other CPU linear backend asked for, then each other method."""
    ours = settings.speculative_config(settings.k)
    arms = [Arm("plain", {})]
    if settings.plain_fast_linears:
        backend = resolve_backend(ours.cpu_linear_backend, [model])
        arms.append(Arm("plain_fast_linears", {}, cpu_linear_backend=None if backend == "torch" else backend))
    own = transformers_option(ours, model) if settings.batch_size == 1 else None
    if own is not None:
        arms.append(Arm("transformers", own))
    arms.append(Arm("ours", _ours_kwargs(ours), settings.k))
    for k in settings.sweep_ks:
        if k != settings.k:
            arms.append(Arm(f"ours_k{k}", _ours_kwargs(settings.speculative_config(k)), k))
    for backend in settings.cpu_linear_backends:
        if backend != ours.cpu_linear_backend:
            config = settings.speculative_config(settings.k, cpu_linear_backend=backend)
            arms.append(Arm(f"ours_{backend}", _ours_kwargs(config), settings.k))
    for method in settings.compare_methods:
        if method != settings.method:
            arms.append(Arm(f"ours_{method}", _ours_kwargs(settings.speculative_config(settings.k, method=method)), settings.k))
    for name, tree in zip(tree_arm_names(settings.trees), settings.trees):
        config = settings.speculative_config(settings.k, tree=tree)
        arms.append(Arm(name, _ours_kwargs(config), config.num_speculative_tokens))
    return arms


def tree_depth(tree: dict) -> int | None:
    """The depth a tree spec fixes: a dynamic tree's "depth", a static tree's deepest path (None:
    neither, or not a valid spec, which `SpeculativeConfig` then reports)."""
    if not isinstance(tree, dict):
        return None
    if "static" in tree:
        paths = tree["static"]
        try:
            return max(len(path) for path in paths) or None
        except (TypeError, ValueError):
            return None
    depth = tree.get("depth")
    return depth if isinstance(depth, int) and not isinstance(depth, bool) else None


def tree_arm_names(trees: tuple[dict, ...] | list[dict]) -> list[str]:
    """An arm name per tree: "ours_tree{num_nodes}" for a dynamic tree, with "_t{topk}" / "_d{depth}"
    where the trees compared differ in those, "ours_static{nodes}" for a static one, and "_{i}"
    after a name taken twice."""

    def key(tree: dict, name: str, default):
        return tree.get(name, default) if isinstance(tree, dict) else None

    dynamic = [tree for tree in trees if isinstance(tree, dict) and "static" not in tree]
    vary_topk = len({repr(key(tree, "topk", DEFAULT_TREE_TOPK)) for tree in dynamic}) > 1
    vary_depth = len({repr(key(tree, "depth", None)) for tree in dynamic}) > 1
    names = []
    for tree in trees:
        if isinstance(tree, dict) and "static" in tree:
            static = tree["static"]
            name = f"ours_static{len(static) if isinstance(static, (list, tuple)) else ''}"
        else:
            name = f"ours_tree{key(tree, 'num_nodes', '')}"
            if vary_topk:
                name += f"_t{key(tree, 'topk', DEFAULT_TREE_TOPK)}"
            if vary_depth:
                name += f"_d{key(tree, 'depth', 'k')}"
        names.append(name if name not in names else f"{name}_{len(names)}")
    return names


def sweep_arm_names(settings: BenchSettings) -> dict[int, str]:
    """k -> the arm measuring it."""
    return {k: "ours" if k == settings.k else f"ours_k{k}" for k in settings.sweep_ks}


def transformers_option(config: SpeculativeConfig, model: PreTrainedModel) -> dict | None:
    """transformers' own generate() arguments for `config.method`, None where it has none (EAGLE).

    A fixed k is passed as a constant number of candidates; with "auto", transformers' own
    adaptive schedule (+2 after a fully accepted step, -1 otherwise) starts from our maximum. (Both
    are set on the assistant's generation config for each call: `runner._generate`.)
    """
    schedule = "heuristic_transient" if config.auto_k else "constant"
    # the model drafter's own k (with an n-gram stage in front, max_draft_tokens may be the lookup's)
    model_k = config.max_speculative_tokens if config.auto_k else config.num_speculative_tokens
    candidates = {"num_assistant_tokens": model_k, "num_assistant_tokens_schedule": schedule}
    if config.method == "ngram":
        return {
            "prompt_lookup_num_tokens": config.max_draft_tokens,
            "max_matching_ngram_size": config.prompt_lookup_max,
        }
    if config.method == "draft_model":
        return {"assistant_model": load_draft_model(config.model, model), **candidates}
    if config.method == "layer_skip":
        return {"assistant_early_exit": config.early_exit_layer, **candidates}
    if config.method == "mtp":
        from ..drafters.mtp_assistant import is_mtp_assistant

        if is_mtp_assistant(config.model):  # Gemma 4's assistant: transformers takes it as assistant_model
            return {"assistant_model": load_draft_model(config.model, model), **candidates}
        return {"use_mtp": True}
    return None


def _ours_kwargs(config: SpeculativeConfig) -> dict:
    return {"speculative_config": config, "return_dict_in_generate": True}
