"""Simulated greedy acceptance of EAGLE heads on SmolLM2-135M-Instruct's own answers.

    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 [more heads ...]
    python benchmarks/head_acceptance.py runs/x/checkpoints/step_60 --architecture runs/x/init-head
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --steps 6 --tree-widths 4,2,2,1,1,1 \
        --tree-nodes 16 --tree-nodes 64
    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 --by-target-confidence 0,0.5,0.9,1

The target answers MT-bench and HumanEval first turns greedily (once; cached under `results/`),
then each head is scored on those answers the way the trainer's held-out evaluation scores it
(`DraftTrainingObjective`, `--steps` unrolled draft steps): at each answer position, does the
head's j-th draft equal the target's greedy token, given that drafts 0..j-1 did? With greedy
decoding that is exactly what speculative generate() accepts, so `tau` (1 + mean accepted of a
k = --steps chain) predicts the benchmark's tau without a timing run: a cheap way to compare
checkpoints. Speed still comes from `hf-specdec bench`. `--tree-widths` / `--tree-nodes` also score
draft trees (a ceiling for tree drafting, which generate() does not do: see `simulated_acceptance`);
`--by-target-confidence` splits the first drafts' acceptance by how sure the target was there.

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

from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head
from hf_specdec.models.real_models import humaneval_user_turns, load_smollm2, mtbench_user_turns

RESULTS = Path(__file__).resolve().parent.parent / "results"
USER_TURNS = {"mt-bench": mtbench_user_turns, "humaneval": humaneval_user_turns}


def parse_sets(text: str) -> list[tuple[str, int]]:
    """"mt-bench:40,humaneval:20" -> [("mt-bench", 40), ("humaneval", 20)]; ValueError naming --sets."""
    sets = []
    for spec in text.split(","):
        name, _, count = spec.partition(":")
        if name not in USER_TURNS or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--sets entry {spec!r} is invalid; allowed: name:count with name in {sorted(USER_TURNS)} "
                "and count an integer >= 1"
            )
        sets.append((name, int(count)))
    return sets


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
) -> dict:
    """`tau` of a k = `steps` chain; per tree in `tree_widths` (w_1, ..., w_D) the tau of a full
    draft tree whose every node at depth d has the head's w_d most likely tokens as children; per
    N in `tree_nodes` the tau of the best static tree of N nodes (`best_static_tree_tau`).
    `confidence_edges` (e.g. 0, 0.5, 0.9, 1) splits the chains' first drafts by the target's own
    probability of its greedy token there (`by_target_confidence`: per bucket its share of the
    positions, the head's acceptance and its share of the misses): do the misses sit where the
    target itself hesitates, or where it is sure and a better head would follow it?

    The target's greedy path is in such a tree up to the first depth where its token is not among
    the tree's children there, given the path so far: those are exactly the draft steps of the
    unroll (step j reads the path's tokens and the head's own earlier outputs), so each tree's
    accepted length follows from the target token's rank among the head's drafts at each step.
    A ceiling for what tree drafting (EAGLE-2 style, which generate() does not do) could give this
    head, before the cost of verifying every node.
    """
    depth = max([steps, *(len(widths) for widths in tree_widths)])
    rank_within = max([1, *(max(widths) for widths in tree_widths), *tree_nodes])
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

    def tau(widths: tuple[int, ...]) -> float:
        within = ranks[:, : len(widths)] < torch.tensor(widths)
        return 1 + within.long().cumprod(dim=-1).sum(dim=-1).double().mean().item()

    return {
        "tau": tau((1,) * steps),
        # step j: accepted given drafts 0..j-1 were (the chain's conditional acceptance)
        "acceptance_per_step": (correct / counted.clamp(min=1)).tolist(),
        "tree_tau": {",".join(map(str, widths)): tau(widths) for widths in tree_widths},
        "static_tree_tau": {nodes: best_static_tree_tau(ranks, nodes) for nodes in tree_nodes},
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
    """
    counts = []
    for depth in range(1, ranks.shape[1] + 1):
        prefixes = ranks[:, :depth]
        inside = (prefixes < num_nodes).all(dim=-1)
        counts.append(torch.unique(prefixes[inside], dim=0, return_counts=True)[1])
    best = torch.cat(counts).sort(descending=True).values[:num_nodes]
    return 1 + best.sum().item() / len(ranks)


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
    try:
        sets = parse_sets(args.sets)
        tree_widths = [parse_tree_widths(text) for text in args.tree_widths]
        confidence_edges = parse_confidence_edges(args.by_target_confidence) if args.by_target_confidence else ()
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    results: dict = {}
    for name, count in sets:
        spec = f"{name}:{count}"
        cached = RESULTS / f"head_acceptance_answers_{name}_{count}_{args.max_new_tokens}.jsonl"
        if not cached.is_file():
            records = target_answers(model, tokenizer, USER_TURNS[name](count), args.max_new_tokens)
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text("".join(json.dumps(r) + "\n" for r in records))
        records = [json.loads(line) for line in cached.read_text().splitlines()]
        data = tokenize_records(records, tokenizer, max_length=2048, min_loss_tokens=1)
        states: dict = {}
        for source in args.heads:
            head = load_head(source, model, args.architecture)
            scored = simulated_acceptance(
                head, model, data, args.steps, states, tree_widths, args.tree_nodes, confidence_edges
            )
            results.setdefault(source, {})[spec] = scored
            per_step = " ".join(f"{a:.3f}" for a in scored["acceptance_per_step"])
            print(f"{spec:>14}  tau(k={args.steps}) {scored['tau']:.3f}  per step {per_step}  {source}", flush=True)
            for widths, value in scored["tree_tau"].items():
                print(f"{'':>14}  full tree {widths}: tau {value:.3f}", flush=True)
            for nodes, value in scored["static_tree_tau"].items():
                print(f"{'':>14}  best static tree of {nodes} nodes (depth {scored['tree_depth']}): tau {value:.3f}", flush=True)
            for bucket in scored["by_target_confidence"]:
                print(
                    f"{'':>14}  target p(greedy token) in [{bucket['low']:g}, {bucket['high']:g}]: "
                    f"{bucket['share']:.3f} of positions, first draft accepted {bucket['acceptance']:.3f}, "
                    f"{bucket['share_of_misses']:.3f} of the misses", flush=True,
                )
    return results


if __name__ == "__main__":
    main()
