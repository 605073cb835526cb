"""The trainer's simulated acceptance against what speculative generate() actually accepts.

The trainer's held-out evaluation and `benchmarks/head_acceptance.py` score a head by unrolling
it over the target's own greedy text (`DraftTrainingObjective`): per position, does the head's
j-th draft equal the target's token, given the features and its own earlier outputs there.
Replaying greedy speculative decoding on those hits (k drafts from the last context position,
accept the leading hits, move on by accepted + 1) must give exactly the drafts and accepted tokens
generate() counts; otherwise the head trains on features or own-output steps it never drafts
from, and the figures predict nothing.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama, left_padded_batch, load_benchmark, plain_generate
from hf_specdec.trainers.data import TokenizedData
from hf_specdec.trainers.objectives import DraftTrainingObjective
from hf_specdec.trainers.target_states import run_target

import hf_specdec
from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head

PROMPT_LEN, MAX_NEW_TOKENS, TTT_STEPS = 10, 24, 3


@pytest.fixture(scope="module")
def fitted_head(tmp_path_factory):
    """A target, the greedy text it writes for 8 prompts, and an EAGLE-3 head fitted to that text
    (so that many drafts are accepted and the hits decide the replay)."""
    torch.manual_seed(0)
    model = hf_specdec.enable(build_tiny_llama())
    model.generation_config.eos_token_id = None  # every row runs the full max_new_tokens
    prompts = torch.randint(3, model.config.vocab_size, (8, PROMPT_LEN)).tolist()
    inputs = left_padded_batch(prompts)
    sequences = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, PROMPT_LEN:] = 1

    vocab = model.config.vocab_size
    head = EagleHead.for_target(model, "eagle3", draft_vocab=list(range(0, vocab, 2)) + list(range(1, vocab, 2)), seed=0)
    head.train()
    objective = DraftTrainingObjective(head, num_steps=TTT_STEPS)
    states = run_target(model, sequences, head.feature_layers_for(len(model.model.layers)))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        out = objective(sequences, loss_mask, states, model.get_output_embeddings())
        (out["loss_sum"] / out["num_label_positions"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("head")
    head.save_pretrained(folder)
    return model, inputs, sequences, folder


@pytest.mark.parametrize("k", [1, 2, 3])
def test_simulated_hits_replay_speculative_generate(fitted_head, k):
    model, inputs, sequences, folder = fitted_head
    out = model.generate(
        **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": k},
    )
    assert torch.equal(out.sequences, sequences)

    head = load_eagle_head(folder, target=model, method="eagle3")  # the weights generate() drafted with
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, PROMPT_LEN:] = 1
    states = run_target(model, sequences, head.feature_layers_for(len(model.model.layers)))
    with torch.no_grad():
        hits = DraftTrainingObjective(head, num_steps=TTT_STEPS)(
            sequences, loss_mask, states, model.get_output_embeddings(), return_hits=True
        )["hits"]

    accepted_per_pos = [0] * k
    drafted = 0
    end = PROMPT_LEN + MAX_NEW_TOKENS
    for row in range(len(sequences)):
        length = PROMPT_LEN + 1  # the prefill step emits one token
        while length < end:
            max_draft = min(k, end - length - 1)  # never more than the row may still emit, minus the bonus
            # drafts from pair length - 2 (its feature, the last token) propose tokens length, length + 1, ...
            run = int(hits[row, length - 2, :max_draft].long().cumprod(dim=0).sum()) if max_draft > 0 else 0
            drafted += max_draft
            for position in range(run):
                accepted_per_pos[position] += 1
            length += run + 1
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] >= 0.3 * metrics["num_draft_tokens"], metrics  # the hits matter
    assert metrics["num_draft_tokens"] == drafted
    assert metrics["num_accepted_tokens_per_pos"] == accepted_per_pos


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_unrolled_steps_label_only_positions_inside_the_sequence(fitted_head, method):
    """Unrolled step j of pair i is labelled by the target at position i + 1 + j. Past the
    sequence's end there is no label (and, for EAGLE's regression, no next feature): step j scores
    exactly the loss_mask[:, 2 + j:] positions. (Padding past the end with label index 0 once gave
    the last j pairs of every row the batch's first label, and crashed EAGLE's regression.)"""
    model, _, sequences, folder = fitted_head
    if method == "eagle3":
        head = load_eagle_head(folder, target=model, method="eagle3")  # its draft vocabulary is the whole one
    else:
        head = EagleHead.for_target(model, "eagle", seed=0)
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, PROMPT_LEN:] = 1
    states = run_target(model, sequences, head.feature_layers_for(len(model.model.layers)))
    with torch.no_grad():
        out = DraftTrainingObjective(head, num_steps=TTT_STEPS)(sequences, loss_mask, states, model.get_output_embeddings())
    assert out["counted"].tolist() == [int(loss_mask[:, 2 + j :].sum()) for j in range(TTT_STEPS)]
    assert torch.isfinite(out["loss_sum"])


def test_head_acceptance_benchmark_scores_heads_of_both_methods_in_one_run(fitted_head):
    """`benchmarks/head_acceptance.py` keeps the target's features between heads: an EAGLE head (the
    last hidden state) and an EAGLE-3 head (three layers concatenated) read different ones, and
    each must score as it does alone (the shared cache once fed EAGLE's features to EAGLE-3)."""
    bench = load_benchmark("head_acceptance")
    model, _, sequences, folder = fitted_head
    data = TokenizedData(
        input_ids=sequences.tolist(), loss_masks=[[0] * PROMPT_LEN + [1] * MAX_NEW_TOKENS for _ in sequences]
    )
    heads = [EagleHead.for_target(model, "eagle", seed=0), load_eagle_head(folder, target=model, method="eagle3")]
    shared: dict = {}
    together = [bench.simulated_acceptance(head, model, data, TTT_STEPS, shared) for head in heads]
    alone = [bench.simulated_acceptance(head, model, data, TTT_STEPS, {}) for head in heads]
    assert together == alone
    assert together[1]["tau"] > 1.5  # the fitted EAGLE-3 head: a real score, not a degenerate one


def test_target_rank_is_zero_exactly_where_the_draft_hits(fitted_head):
    """`target_rank` ranks the target's token among the head's most likely drafts: rank 0 is the
    head's argmax (the chain's hit), and a smaller window only clips the ranks."""
    model, _, sequences, folder = fitted_head
    head = load_eagle_head(folder, target=model, method="eagle3")
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, PROMPT_LEN:] = 1
    states = run_target(model, sequences, head.feature_layers_for(len(model.model.layers)))
    objective = DraftTrainingObjective(head, num_steps=TTT_STEPS)
    with torch.no_grad():
        wide = objective(sequences, loss_mask, states, model.get_output_embeddings(), return_hits=True, rank_within=8)
        narrow = objective(sequences, loss_mask, states, model.get_output_embeddings(), rank_within=2)
    assert torch.equal(wide["target_rank"] == 0, wide["hits"])
    assert torch.equal(narrow["target_rank"], wide["target_rank"].clamp(max=2))
    ranked = wide["target_rank"][wide["draft_start"]]
    assert ((ranked > 0) & (ranked < 8)).any()  # some misses of the chain are near misses a tree would catch


def test_head_acceptance_tree_tau_spans_chain_to_every_token(fitted_head):
    """A tree of width 1 is the chain; a tree as wide as the draft vocabulary holds the target's
    path whole, so it accepts every labelled draft step; widths in between lie in between. The
    best static tree of N nodes grows with N from the first draft alone to the whole path."""
    bench = load_benchmark("head_acceptance")
    model, _, sequences, folder = fitted_head
    data = TokenizedData(
        input_ids=sequences.tolist(), loss_masks=[[0] * PROMPT_LEN + [1] * MAX_NEW_TOKENS for _ in sequences]
    )
    head = load_eagle_head(folder, target=model, method="eagle3")  # its draft vocabulary is the whole one
    vocab = model.config.vocab_size
    trees = [(1,) * TTT_STEPS, (2, 2, 1), (4, 4, 4), (vocab,) * TTT_STEPS]
    node_budgets = [1, TTT_STEPS, 8, vocab**TTT_STEPS]
    scored = bench.simulated_acceptance(head, model, data, TTT_STEPS, {}, trees, node_budgets)
    taus = [scored["tree_tau"][",".join(map(str, widths))] for widths in trees]
    assert taus[0] == pytest.approx(scored["tau"])
    assert taus == sorted(taus) and taus[0] < taus[-1]
    # pair i starts a chain when its step-0 label (token i + 2) is an answer token; step j is labelled
    # while token i + 2 + j is inside the sequence: min(k, width - 2 - i) steps from pair i
    width = PROMPT_LEN + MAX_NEW_TOKENS
    runs = [min(TTT_STEPS, width - 2 - i) for i in range(PROMPT_LEN - 2, width - 2)]
    assert taus[-1] == pytest.approx(1 + sum(runs) / len(runs))

    static = [scored["static_tree_tau"][nodes] for nodes in node_budgets]
    # one node: the head's first draft alone (the chain's step 0); k nodes: at least the k-chain
    assert static[0] == pytest.approx(1 + scored["acceptance_per_step"][0])
    assert static[1] >= scored["tau"] - 1e-9
    assert static == sorted(static) and static[2] > static[1]
    assert static[-1] == pytest.approx(taus[-1])  # room for every node: the whole target path


def test_head_acceptance_rejects_bad_tree_widths():
    bench = load_benchmark("head_acceptance")
    assert bench.parse_tree_widths("4,2,1") == (4, 2, 1)
    for bad in ("", "4,,1", "0,2", "a"):
        with pytest.raises(ValueError, match="--tree-widths"):
            bench.parse_tree_widths(bad)


def test_rank_of_matches_a_full_sort_of_the_heads_logits(fitted_head):
    """`_rank_of` against ranks read off a full sort of the draft logits, through the draft ->
    target vocabulary map (the fitted head's draft vocabulary is a permutation: d2t matters)."""
    model, _, _, folder = fitted_head
    head = load_eagle_head(folder, target=model, method="eagle3")
    torch.manual_seed(1)
    predicted = torch.randn(40, model.config.hidden_size)
    with torch.no_grad():
        logits = head.lm_head_input(predicted) @ head.output_head().weight.T
    order = head.draft_to_target(logits.argsort(dim=-1, descending=True))  # target ids, most likely first
    # one target per row at a known rank, 0..39: inside and outside the window of 8
    expected = torch.arange(40)
    target_ids = order[torch.arange(40), expected]
    with torch.no_grad():
        ranks = DraftTrainingObjective(head)._rank_of(predicted, target_ids, within=8)
    assert torch.equal(ranks, expected.clamp(max=8))


def test_head_acceptance_rejects_bad_tree_nodes(capsys):
    bench = load_benchmark("head_acceptance")
    with pytest.raises(SystemExit):
        bench.main(["some-head", "--tree-nodes", "0"])
    assert "--tree-nodes" in capsys.readouterr().err


def test_head_acceptance_splits_first_drafts_by_the_targets_confidence(fitted_head):
    """`--by-target-confidence`: the buckets partition the chains' first drafts by the target's own
    probability of its greedy token there (checked against the target's logits), and together
    they give the first draft's acceptance."""
    bench = load_benchmark("head_acceptance")
    model, _, sequences, folder = fitted_head
    data = TokenizedData(
        input_ids=sequences.tolist(), loss_masks=[[0] * PROMPT_LEN + [1] * MAX_NEW_TOKENS for _ in sequences]
    )
    head = load_eagle_head(folder, target=model, method="eagle3")
    # a chain starts at every position whose next token is an answer token: p(greedy token) there
    with torch.no_grad():
        top1 = model(sequences).logits.softmax(dim=-1).amax(dim=-1)[:, PROMPT_LEN - 1 : -1]
    # the tiny random target is never sure of anything: edges at its own quantiles fill every bucket
    edges = (0.0, top1.quantile(0.3).item(), top1.quantile(0.7).item(), 1.0)
    scored = bench.simulated_acceptance(head, model, data, TTT_STEPS, {}, confidence_edges=edges)
    buckets = scored["by_target_confidence"]
    assert [(b["low"], b["high"]) for b in buckets] == list(zip(edges, edges[1:]))
    assert all(b["share"] > 0.2 for b in buckets)
    assert [b["share"] for b in buckets] == pytest.approx(
        [((top1 >= low) & ((top1 < high) if high < 1 else (top1 <= high))).double().mean().item() for low, high in
         zip(edges, edges[1:])]
    )
    assert sum(b["share"] for b in buckets) == pytest.approx(1)
    assert sum(b["share_of_misses"] for b in buckets) == pytest.approx(1)
    accepted = sum(b["share"] * b["acceptance"] for b in buckets)
    assert accepted == pytest.approx(scored["acceptance_per_step"][0])
    assert bench.simulated_acceptance(head, model, data, TTT_STEPS, {})["by_target_confidence"] == []


def test_head_acceptance_rejects_bad_confidence_edges():
    bench = load_benchmark("head_acceptance")
    assert bench.parse_confidence_edges("0,0.5,1") == (0.0, 0.5, 1.0)
    for bad in ("0.5", "0,0.5,0.4", "-0.1,1", "0,1.5", "a,b", "0,,1"):
        with pytest.raises(ValueError, match="--by-target-confidence"):
            bench.parse_confidence_edges(bad)
