"""The trainer's blockwise lm_head loss and target labels against their plain, whole-batch forms."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama
from hf_specdec.trainers import lm_head_loss
from hf_specdec.trainers.lm_head_loss import soft_label_cross_entropy
from hf_specdec.trainers.objectives import target_labels

from hf_specdec.heads.eagle_heads import EagleHead


@pytest.fixture
def small_blocks(monkeypatch):
    # 3 rows per block for a 40-token vocabulary: 11 rows run as 4 blocks, the last one short
    monkeypatch.setattr(lm_head_loss, "BLOCK_ELEMENTS", 120)


@pytest.mark.parametrize("train_weight", [True, False])
def test_soft_label_cross_entropy_matches_the_plain_form(small_blocks, train_weight):
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, dtype=torch.float64, requires_grad=train_weight)
    label_probs = torch.rand(6, 40, dtype=torch.float64)
    label_probs[:3] /= label_probs[:3].sum(dim=-1, keepdim=True)  # rows 3.. do not sum to 1
    label_rows = torch.tensor([5, 0, 0, 3, 1, 2, 4, 5, 1, 0, 3])

    loss, argmax = soft_label_cross_entropy(hidden, weight, label_probs, label_rows)
    (2.5 * loss).backward()
    hidden_grad, weight_grad = hidden.grad, weight.grad
    hidden.grad = weight.grad = None

    logits = hidden @ weight.T
    expected = -(label_probs[label_rows] * logits.log_softmax(dim=-1)).sum()
    (2.5 * expected).backward()
    torch.testing.assert_close(loss.double(), expected.detach())
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(hidden_grad, hidden.grad)
    if train_weight:
        torch.testing.assert_close(weight_grad, weight.grad)
    else:
        assert weight_grad is None


def test_soft_label_cross_entropy_without_grad_and_bad_shapes(small_blocks):
    hidden, weight = torch.randn(4, 8), torch.randn(40, 8, requires_grad=True)
    label_probs = torch.softmax(torch.randn(2, 40), dim=-1)
    with torch.no_grad():
        loss, argmax = soft_label_cross_entropy(hidden, weight, label_probs, torch.tensor([0, 1, 1, 0]))
    expected = -(label_probs[[0, 1, 1, 0]] * (hidden @ weight.T).log_softmax(dim=-1)).sum()
    torch.testing.assert_close(loss, expected.detach())
    assert not loss.requires_grad and argmax.shape == (4,)
    with pytest.raises(ValueError, match="4 rows with 3 labels"):
        soft_label_cross_entropy(hidden, weight, label_probs, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="40-token lm_head against 39-token"):
        soft_label_cross_entropy(hidden, weight, label_probs[:, :39], torch.tensor([0, 1, 1, 0]))


def test_target_labels_match_the_whole_vocabulary_form(monkeypatch):
    torch.manual_seed(0)
    target = build_tiny_llama()
    vocab_size = target.config.vocab_size
    monkeypatch.setattr(lm_head_loss, "BLOCK_ELEMENTS", 2 * vocab_size + 1)  # 2 rows per block
    draft_vocab = sorted(torch.randperm(vocab_size)[: vocab_size // 2].tolist())
    head = EagleHead.for_target(target, "eagle3", draft_vocab=draft_vocab)
    final_hidden = torch.randn(7, target.config.hidden_size)

    argmax, in_draft_vocab, probs = target_labels(final_hidden, target.get_output_embeddings(), head)

    logits = target.get_output_embeddings()(final_hidden)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    assert torch.equal(in_draft_vocab, torch.isin(argmax, torch.tensor(draft_vocab)))
    torch.testing.assert_close(probs, logits[:, draft_vocab].softmax(dim=-1))


def test_target_labels_keep_the_targets_precision_under_the_heads_autocast():
    # --mixed-precision bf16 trains the head in bf16; the labels stay the fp32 target's unless
    # --target-precision asks for bf16, and then they are the bf16 matmul's
    torch.manual_seed(0)
    target = build_tiny_llama()
    head = EagleHead.for_target(target, "eagle3")
    final_hidden = torch.randn(9, target.config.hidden_size)
    weight = target.get_output_embeddings().weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, fp32_probs = target_labels(final_hidden, target.get_output_embeddings(), head)
        _, _, bf16_probs = target_labels(final_hidden, target.get_output_embeddings(), head, torch.bfloat16)
    assert torch.equal(fp32_probs, (final_hidden @ weight.T).softmax(dim=-1))
    expected_bf16 = (final_hidden.bfloat16() @ weight.bfloat16().T).float().softmax(dim=-1)
    assert torch.equal(bf16_probs, expected_bf16) and not torch.equal(bf16_probs, fp32_probs)


def test_soft_label_cross_entropy_under_bf16_autocast(small_blocks):
    # --mixed-precision bf16: the matmuls run in bf16, the loss is scored and the gradients land in fp32
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    label_probs = torch.softmax(torch.randn(6, 40), dim=-1)
    label_rows = torch.tensor([5, 0, 0, 3, 1, 2, 4, 5, 1, 0, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = soft_label_cross_entropy(hidden, weight, label_probs, label_rows)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32

    reference_hidden = hidden.detach().requires_grad_()
    reference_weight = weight.detach().requires_grad_()
    expected = -(label_probs[label_rows] * (reference_hidden @ reference_weight.T).log_softmax(dim=-1)).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=2e-2, atol=0)
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(weight.grad, reference_weight.grad, rtol=5e-2, atol=5e-2)


def test_a_head_whose_lm_head_has_a_bias_is_refused():
    from hf_specdec.trainers.objectives import DraftTrainingObjective

    target = build_tiny_llama()
    head = EagleHead.for_target(target, "eagle3")
    head.lm_head = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=True)
    with pytest.raises(ValueError, match="lm_head has a bias is not supported"):
        DraftTrainingObjective(head)
