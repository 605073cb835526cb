"""Simulated greedy acceptance of EAGLE heads on SmolLM2-135M-Instruct's own answers.

    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 [more heads ...]
    python benchmarks/head_acceptance.py runs/x/checkpoints/step_60 --architecture runs/x/init-head
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --steps 6 --tree-widths 4,2,2,1,1,1 \
        --tree-nodes 16 --tree-nodes 64
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --by-target-confidence 0,0.5,0.9,1
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --steps 6 \
        --sets mt-bench:20:80,humaneval:20:164 --tree-nodes 16 --tree-nodes 64 --save-trees trees.json
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --steps 6 \
        --sets mt-bench:0:20,humaneval:0:20 --tree-nodes 16 --tree-nodes 64 --score-trees trees.json

The target answers MT-bench and HumanEval first turns greedily (once; cached under `results/`),
then each head is scored on those answers the way the trainer's held-out evaluation scores it
(`DraftTrainingObjective`, `--steps` unrolled draft steps): at each answer position, does the
head's j-th draft equal the target's greedy token, given that drafts 0..j-1 did? With greedy
decoding that is exactly what speculative generate() accepts, so `tau` (1 + mean accepted of a
k = --steps chain) predicts the benchmark's tau without a timing run: a cheap way to compare
checkpoints. Speed still comes from `hf-specdec bench`. `--tree-widths` / `--tree-nodes` also score
draft trees (a ceiling for tree drafting, which generate() does not do: see `simulated_acceptance`);
`--by-target-confidence` splits the first drafts' acceptance by how sure the target was there.

`--sets name:start:end` takes questions start..end-1 (from the same cached answers as the first
`end`), so a static tree can be fitted on some questions and scored on others: `--save-trees FILE`
writes the best static tree of each `--tree-nodes N`, fitted on all the sets' answers together, as
the rank paths `speculative_config["tree"]["static"]` takes ({"<N>": [[0], [1], [0, 0], ...]} plus a
`fitted` header); `--score-trees FILE` scores the trees in such a file as they are (no refitting).

A head is a folder the drafter loads, or a trainer checkpoint (`<output>/checkpoints/step_N`,
whose weights are the training objective's) given with `--architecture <a head folder of the
same shape>`, e.g. the run's `--init-from` head.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from hf_specdec.trainers.data import collate, tokenize_records
from hf_specdec.trainers.objectives import DraftTrainingObjective
from hf_specdec.trainers.regenerate import answer_batch
from hf_specdec.trainers.target_states import run_target
from safetensors.torch import load_file

from hf_specdec.config import MAX_TREE_TOPK
from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head
from hf_specdec.models.real_models import humaneval_user_turns, load_smollm2, mtbench_user_turns

RESULTS = Path(__file__).resolve().parent.parent / "results"
USER_TURNS = {"mt-bench": mtbench_user_turns, "humaneval": humaneval_user_turns}


def parse_sets(text: str) -> list[tuple[str, int]] | list[tuple[str, int, int]]:
    """"mt-bench:40,humaneval:20" -> [("mt-bench", 40), ("humaneval", 20)]: the first `count` of each
    set. An entry may instead give a range, name:start:end (questions start..end-1, e.g.
    "mt-bench:20:80"), which parses to (name, start, end), so that a tree can be fitted on questions
    the evaluation never sees. ValueError naming --sets."""
    sets = []
    for spec in text.split(","):
        name, *bounds = spec.split(":")
        valid = name in USER_TURNS and len(bounds) in (1, 2) and all(b.isdigit() for b in bounds)
        if valid and len(bounds) == 1:
            valid = int(bounds[0]) >= 1
        elif valid:
            valid = int(bounds[0]) < int(bounds[1])
        if not valid:
            raise ValueError(
                f"--sets entry {spec!r} is invalid; allowed: name:count with name in {sorted(USER_TURNS)} "
                "and count an integer >= 1, or name:start:end (questions start..end-1, start < end)"
            )
        sets.append((name, *map(int, bounds)))
    return sets


def set_label(entry: tuple) -> str:
    return ":".join(map(str, entry))


def cached_answers(model, tokenizer, entry: tuple, max_new_tokens: int) -> list[dict]:
    """The target's answers for one `parse_sets` entry, generated once and cached under `results/`
    (`head_acceptance_answers_<name>_<count>_<max_new_tokens>.jsonl`: the first `count` questions).
    A range start:end reads the smallest cached file holding its questions (else it answers the
    first `end` and caches them), so a range and its complement come from the same answers."""
    name, *bounds = entry
    start, end = (0, bounds[0]) if len(bounds) == 1 else bounds
    cached = RESULTS / f"head_acceptance_answers_{name}_{end}_{max_new_tokens}.jsonl"
    if len(bounds) == 2:
        larger = []
        for path in RESULTS.glob(f"head_acceptance_answers_{name}_*_{max_new_tokens}.jsonl"):
            count = path.name.removeprefix(f"head_acceptance_answers_{name}_").removesuffix(f"_{max_new_tokens}.jsonl")
            if count.isdigit() and int(count) >= end:
                larger.append((int(count), path))
        if larger:
            cached = min(larger)[1]
    if not cached.is_file():
        turns = USER_TURNS[name](end)
        if len(bounds) == 2 and len(turns) < end:  # name:count keeps the first count there are
            raise ValueError(f"--sets entry {set_label(entry)!r}: {name} has only {len(turns)} questions")
        records = target_answers(model, tokenizer, turns, max_new_tokens)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text("".join(json.dumps(r) + "\n" for r in records))
    records = [json.loads(line) for line in cached.read_text().splitlines()]
    if len(bounds) == 1:
        return records
    if len(records) < end:
        raise ValueError(f"--sets entry {set_label(entry)!r}: {name} has only {len(records)} questions")
    return records[start:end]


def target_answers(model, tokenizer, turns: list[str], max_new_tokens: int, batch_size: int = 16) -> list[dict]:
    """The target's greedy answers to each user turn, in order (truncated answers flagged)."""
    prompts = [[{"role": "user", "content": turn}] for turn in turns]
    return [
        record
        for begin in range(0, len(prompts), batch_size)
        for record in answer_batch(model, tokenizer, prompts[begin : begin + batch_size], max_new_tokens)
    ]


def load_head(source: str, target, architecture: str | None) -> EagleHead:
    if (Path(source) / "config.json").is_file():
        return load_eagle_head(source, target)
    if architecture is None:
        raise ValueError(f"{source!r} has no config.json: pass --architecture <a head folder of the same shape>")
    head = load_eagle_head(architecture, target)
    state = {k.removeprefix("head."): v for k, v in load_file(str(Path(source) / "model.safetensors")).items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    # only what the head borrows from the target may be absent; anything else is the wrong architecture
    missing = [name for name in missing if not name.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source!r} does not fit --architecture {architecture!r}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return head


def parse_tree_widths(text: str) -> tuple[int, ...]:
    """"4,2,1" -> (4, 2, 1); ValueError naming --tree-widths."""
    parts = text.split(",")
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(
            f"--tree-widths {text!r} is invalid; allowed: comma-separated integers >= 1, one per draft depth"
        )
    return tuple(int(part) for part in parts)


@torch.no_grad()
def simulated_acceptance(
    head: EagleHead, target, data, steps: int, states: dict, tree_widths: list[tuple[int, ...]] = (),
    tree_nodes: list[int] = (), confidence_edges: Sequence[float] = (),
    fixed_trees: dict[int, list[list[int]]] | None = None, ranks_out: list | None = None,
) -> dict:
    """`tau` of a k = `steps` chain; per tree in `tree_widths` (w_1, ..., w_D) the tau of a full
    draft tree whose every node at depth d has the head's w_d most likely tokens as children; per
    N in `tree_nodes` the tau of the best static tree of N nodes (`best_static_tree_tau`).
    `confidence_edges` (e.g. 0, 0.5, 0.9, 1) splits the chains' first drafts by the target's own
    probability of its greedy token there (`by_target_confidence`: per bucket its share of the
    positions, the head's acceptance and its share of the misses): do the misses sit where the
    target itself hesitates, or where it is sure and a better head would follow it?
    `fixed_trees` ({name: rank paths}) adds `fixed_tree_tau`: each given static tree's tau
    (`fixed_tree_tau`), with no refitting; `ranks_out` (a list) receives the `[chains, depth]` ranks,
    e.g. to fit trees over several sets at once.

    The target's greedy path is in such a tree up to the first depth where its token is not among
    the tree's children there, given the path so far: those are exactly the draft steps of the
    unroll (step j reads the path's tokens and the head's own earlier outputs), so each tree's
    accepted length follows from the target token's rank among the head's drafts at each step.
    A ceiling for what tree drafting (EAGLE-2 style, which generate() does not do) could give this
    head, before the cost of verifying every node.
    """
    fixed_trees = fixed_trees or {}
    fixed_nodes = [node for paths in fixed_trees.values() for node in paths]
    depth = max([steps, *(len(widths) for widths in tree_widths), *(len(node) for node in fixed_nodes)])
    rank_within = max([
        1, *(max(widths) for widths in tree_widths), *tree_nodes, *(max(node) + 1 for node in fixed_nodes)
    ])
    objective = DraftTrainingObjective(head.eval(), num_steps=depth).eval()
    correct = counted = 0
    ranks, confidences = [], []
    feature_layers = head.feature_layers_for(len(target.model.layers))
    for begin in range(0, len(data), 4):
        batch = collate(data, list(range(begin, min(begin + 4, len(data)))))
        key = (begin, feature_layers)
        if key not in states:  # the target's features depend only on the layers read: computed once per set
            states[key] = run_target(target, batch.input_ids, feature_layers)
        out = objective(
            batch.input_ids, batch.loss_mask, states[key], target.get_output_embeddings(), rank_within=rank_within
        )
        correct, counted = correct + out["correct"], counted + out["counted"]
        ranks.append(out["target_rank"][out["draft_start"]])
        if confidence_edges:
            if (begin, "top1") not in states:
                states[(begin, "top1")] = target_top1_prob(states[key].final_hidden, target.get_output_embeddings())
            # pair i's first draft is labelled by the target's logits at position i + 1
            confidences.append(states[(begin, "top1")][:, 1:][out["draft_start"]])
    ranks = torch.cat(ranks)  # [chains, depth]: one chain per labelled position
    if ranks_out is not None:
        ranks_out.append(ranks)

    def tau(widths: tuple[int, ...]) -> float:
        within = ranks[:, : len(widths)] < torch.tensor(widths)
        return 1 + within.long().cumprod(dim=-1).sum(dim=-1).double().mean().item()

    return {
        "tau": tau((1,) * steps),
        # step j: accepted given drafts 0..j-1 were (the chain's conditional acceptance)
        "acceptance_per_step": (correct / counted.clamp(min=1)).tolist(),
        "tree_tau": {",".join(map(str, widths)): tau(widths) for widths in tree_widths},
        "static_tree_tau": {nodes: best_static_tree_tau(ranks, nodes) for nodes in tree_nodes},
        "fixed_tree_tau": {name: fixed_tree_tau(ranks, paths) for name, paths in fixed_trees.items()},
        "tree_depth": depth,
        "by_target_confidence": (
            by_confidence(torch.cat(confidences), ranks[:, 0] == 0, confidence_edges) if confidence_edges else []
        ),
    }


@torch.no_grad()
def target_top1_prob(final_hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """`[batch, T]`: the target's probability of its own greedy token at each position (a row at a
    time: a batch's full-vocabulary probabilities would be one large buffer)."""
    weight = lm_head.weight.float()
    return torch.stack([(row.float() @ weight.T).softmax(dim=-1).amax(dim=-1) for row in final_hidden])


def by_confidence(confidence: torch.Tensor, hit: torch.Tensor, edges: Sequence[float]) -> list[dict]:
    """Per bucket [edges[i], edges[i + 1]) of `confidence` (the last one closed): its share of the
    positions, the acceptance of `hit` there and the bucket's share of all misses."""
    rows, misses = [], (~hit).sum().clamp(min=1)
    for i, (low, high) in enumerate(zip(edges, edges[1:])):
        inside = (confidence >= low) & ((confidence <= high) if i == len(edges) - 2 else (confidence < high))
        rows.append({
            "low": low, "high": high, "share": inside.double().mean().item(),
            "acceptance": hit[inside].double().mean().item() if inside.any() else float("nan"),
            "share_of_misses": ((~hit) & inside).sum().item() / misses.item(),
        })
    return rows


def parse_confidence_edges(text: str) -> tuple[float, ...]:
    """`--by-target-confidence 0,0.5,0.9,1` -> (0.0, 0.5, 0.9, 1.0): increasing, within [0, 1]."""
    try:
        edges = tuple(float(part) for part in text.split(","))
    except ValueError:
        edges = ()
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 0 or edges[-1] > 1:
        raise ValueError(
            f"--by-target-confidence {text!r} is invalid; allowed: two or more increasing numbers in [0, 1], "
            "comma-separated, e.g. 0,0.5,0.9,1"
        )
    return edges


def best_static_tree_tau(ranks: torch.Tensor, num_nodes: int) -> float:
    """The tau of the best draft tree of `num_nodes` nodes that is the same at every position.

    A node is a rank sequence (r_1, ..., r_d): the head's r_1-th draft, then its r_2-th draft
    after that one, ... The target's path contributes one accepted token per node on it, so a
    tree's accepted length summed over `ranks` ([chains, depth]) is the sum of its nodes' counts
    (how many chains start with that rank sequence). A prefix's count is at least its extensions',
    so the `num_nodes` largest counts form a tree (ties taken shallowest first) and no tree of that
    size does better. The tree is fitted on the answers it scores, so the figure is a ceiling.
    Nodes are restricted to ranks below `num_nodes` (a rarer draft than that rarely earns a place).
    The tree itself: `fit_static_tree`.
    """
    return fit_static_tree(ranks, num_nodes)[1]


def fit_static_tree(
    ranks: torch.Tensor, num_nodes: int, max_rank: int | None = None
) -> tuple[list[list[int]], float]:
    """The nodes of `best_static_tree_tau`'s tree, as rank paths (parents before children, by depth
    then rank), and its tau on `ranks`. Ties between counts go to the shallower node (a stable
    sort of the counts listed depth by depth): a node's count never exceeds its parent's, so the
    parent always comes first and the chosen set is prefix-closed. Ranks are below `num_nodes`, and
    below `max_rank` if given (generate()'s static trees take child ranks below 16)."""
    limit = num_nodes if max_rank is None else min(num_nodes, max_rank)
    paths, counts = [], []
    for depth in range(1, ranks.shape[1] + 1):
        prefixes = ranks[:, :depth]
        inside = (prefixes < limit).all(dim=-1)
        unique, count = torch.unique(prefixes[inside], dim=0, return_counts=True)
        paths.extend(unique.tolist())
        counts.append(count)
    order = torch.cat(counts).sort(descending=True, stable=True)
    chosen = order.indices[:num_nodes].tolist()
    tree = sorted((paths[i] for i in chosen), key=lambda path: (len(path), path))
    return tree, 1 + order.values[:num_nodes].sum().item() / len(ranks)


def fixed_tree_tau(ranks: torch.Tensor, paths: Sequence[Sequence[int]]) -> float:
    """The tau of a FIXED static tree (rank paths, prefix-closed) on `ranks` ([chains, depth]):
    per chain the accepted length is the number of leading depths d whose rank prefix
    (r_1, ..., r_d) is a node of the tree. A tree deeper than `ranks` is cut at its depth."""
    if not paths:
        return 1.0
    nodes = {tuple(path) for path in paths}
    missing = sorted({node[:-1] for node in nodes if len(node) > 1} - nodes)
    if missing:
        raise ValueError(f"the tree's paths {[list(m) for m in missing]} are prefixes of other paths but not nodes")
    base = max(int(ranks.max().item()) if ranks.numel() else 0, max(max(node) for node in nodes)) + 1
    code = torch.zeros(len(ranks), dtype=torch.long)
    inside = torch.ones(len(ranks), dtype=torch.bool)
    accepted = torch.zeros(len(ranks), dtype=torch.long)
    for depth in range(1, min(ranks.shape[1], max(map(len, nodes))) + 1):
        code = code * base + ranks[:, depth - 1]
        level = [node for node in nodes if len(node) == depth]
        level_codes = torch.tensor([sum(r * base ** (depth - 1 - i) for i, r in enumerate(node)) for node in level])
        inside &= torch.isin(code, level_codes)
        accepted += inside.long()
    return 1 + accepted.double().mean().item() if len(ranks) else 1.0


def read_trees(path: str | Path) -> dict[int, list[list[int]]]:
    """The static trees of a `--save-trees` file: {N: paths} from its keys that are integers
    (others, such as the header, are skipped). ValueError naming the file when it holds none or a
    path is not a list of ranks >= 0."""
    data = json.loads(Path(path).read_text())
    trees = {int(key): value for key, value in data.items() if key.isdigit()} if isinstance(data, dict) else {}
    valid = trees and all(
        isinstance(paths, list) and paths and all(
            isinstance(node, list) and node and all(isinstance(r, int) and r >= 0 for r in node) for node in paths
        )
        for paths in trees.values()
    )
    if not valid:
        raise ValueError(
            f"--score-trees {str(path)!r} holds no valid trees; allowed: JSON {{\"<N>\": [[rank, ...], ...], ...}} "
            "as --save-trees writes"
        )
    return trees


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--architecture", default=None, help="head folder describing trainer checkpoints' shape")
    parser.add_argument("--sets", default="mt-bench:40,humaneval:20", help="name:count, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="unrolled draft steps (the k of the simulated chain)")
    parser.add_argument(
        "--tree-widths", action="append", default=[], metavar="W1,W2,...",
        help="also score a full draft tree with W_d children per node at depth d (repeatable)",
    )
    parser.add_argument(
        "--tree-nodes", action="append", type=int, default=[], metavar="N",
        help="also score the best static draft tree of N nodes (repeatable)",
    )
    parser.add_argument(
        "--save-trees", default=None, metavar="FILE",
        help="write the best static tree of each --tree-nodes N, fitted on all --sets' answers together, as "
        'JSON {"<N>": [[rank path], ...]} (the layout speculative_config["tree"]["static"] takes); one head',
    )
    parser.add_argument(
        "--score-trees", default=None, metavar="FILE",
        help="also score the static trees in FILE (as --save-trees writes) as they are, without refitting",
    )
    parser.add_argument(
        "--by-target-confidence", default=None, metavar="E0,E1,...",
        help="also split the first drafts' acceptance by the target's probability of its greedy token, "
        "at these bucket edges (increasing, from 0 to 1), e.g. 0,0.3,0.5,0.7,0.9,1",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("steps", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: an integer >= 1")
    if any(nodes < 1 for nodes in args.tree_nodes):
        parser.error(f"--tree-nodes {args.tree_nodes} is invalid; allowed: integers >= 1")
    if args.save_trees and (not args.tree_nodes or len(args.heads) != 1):
        parser.error("--save-trees needs one head and at least one --tree-nodes N (the sizes of the trees to fit)")
    try:
        sets = parse_sets(args.sets)
        tree_widths = [parse_tree_widths(text) for text in args.tree_widths]
        confidence_edges = parse_confidence_edges(args.by_target_confidence) if args.by_target_confidence else ()
        fixed_trees = read_trees(args.score_trees) if args.score_trees else {}
    except (ValueError, OSError) as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    results: dict = {}
    pooled_ranks: list = []  # --save-trees: every set's chains, the one head's
    for entry in sets:
        spec = set_label(entry)
        try:
            records = cached_answers(model, tokenizer, entry, args.max_new_tokens)
        except ValueError as error:
            parser.error(str(error))
        data = tokenize_records(records, tokenizer, max_length=2048, min_loss_tokens=1)
        states: dict = {}
        for source in args.heads:
            head = load_head(source, model, args.architecture)
            scored = simulated_acceptance(
                head, model, data, args.steps, states, tree_widths, args.tree_nodes, confidence_edges,
                fixed_trees, pooled_ranks if args.save_trees else None,
            )
            results.setdefault(source, {})[spec] = scored
            per_step = " ".join(f"{a:.3f}" for a in scored["acceptance_per_step"])
            print(f"{spec:>14}  tau(k={args.steps}) {scored['tau']:.3f}  per step {per_step}  {source}", flush=True)
            for widths, value in scored["tree_tau"].items():
                print(f"{'':>14}  full tree {widths}: tau {value:.3f}", flush=True)
            for nodes, value in scored["static_tree_tau"].items():
                print(f"{'':>14}  best static tree of {nodes} nodes (depth {scored['tree_depth']}): tau {value:.3f}", flush=True)
            for nodes, value in scored["fixed_tree_tau"].items():
                print(f"{'':>14}  static tree of {nodes} nodes from {args.score_trees}: tau {value:.3f}", flush=True)
            for bucket in scored["by_target_confidence"]:
                print(
                    f"{'':>14}  target p(greedy token) in [{bucket['low']:g}, {bucket['high']:g}]: "
                    f"{bucket['share']:.3f} of positions, first draft accepted {bucket['acceptance']:.3f}, "
                    f"{bucket['share_of_misses']:.3f} of the misses", flush=True,
                )
    if args.save_trees:
        results["saved_trees"] = save_trees(args, sets, torch.cat(pooled_ranks))
    return results


def save_trees(args: argparse.Namespace, sets: list[tuple], ranks: torch.Tensor) -> dict:
    """Fit the best static tree of each --tree-nodes N on `ranks` (all sets' chains together), write
    them to --save-trees with a `fitted` header saying how, and return what was written."""
    out: dict = {
        "fitted": {
            "head": args.heads[0], "sets": [set_label(entry) for entry in sets], "chains": len(ranks),
            "depth": ranks.shape[1], "max_new_tokens": args.max_new_tokens,
            "how": "benchmarks/head_acceptance.py --save-trees: per N the N rank paths with the most chains "
            "starting with them, over all the sets' answers together (best_static_tree_tau's tree; child ranks "
            f"below min(N, {MAX_TREE_TOPK})), ties shallowest first",
            "fitted_tau": {},
        }
    }
    for nodes in args.tree_nodes:
        paths, value = fit_static_tree(ranks, nodes, max_rank=MAX_TREE_TOPK)
        out["fitted"]["fitted_tau"][str(nodes)] = round(value, 4)
        out[str(nodes)] = paths
        print(f"{'fitted on all':>14}  static tree of {nodes} nodes (depth {max(map(len, paths))}): tau {value:.3f}")
    Path(args.save_trees).parent.mkdir(parents=True, exist_ok=True)
    Path(args.save_trees).write_text(
        "{\n" + ",\n".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in out.items()) + "\n}\n"
    )
    print(f"wrote {args.save_trees}", flush=True)
    return out


if __name__ == "__main__":
    main()
