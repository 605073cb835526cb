"""Cross-entropy of an lm_head's logits against soft labels, a block of rows at a time.

The plain form, `-(probs * (hidden @ W.T).log_softmax(-1)).sum()`, materialises several
`[rows, vocabulary]` tensors per draft step (logits, log-probabilities, the labels gathered for
those rows, their product, and the gradient), each hundreds of MB for a batch of 8 x 512 tokens.
On CPU every fresh buffer that large is a new mapping whose pages fault in on first touch; with
them, an EAGLE-3 trainer step for SmolLM2 (16k draft vocabulary, 8 x 512 tokens, 2 cores) took
21.5 s against 17.0 s blockwise (medians over the same 10 batches). Here each block of rows computes its logits, its loss and its gradients at once and
drops the block: nothing vocabulary-wide outlives a block, and the per-block buffers are small
enough for the allocator to reuse.

The gradients are computed in the forward pass (the usual three matmuls, no more) and scaled by
the incoming gradient in the backward. Under autocast the weight is cast to the autocast dtype
once per call, not once per matmul as autocast would: three casts of a 16k x 576 weight per
block were 45% of a bf16 training step's CPU time. Libraries with fused linear cross-entropy (Liger, Apple's
cut-cross-entropy) are CUDA/Triton-only and take hard labels; we need CPU and soft labels.
"""

from __future__ import annotations

import torch

# elements of one block's [rows, vocabulary] buffers: 4M floats = 16 MB, below glibc's 32 MB
# mmap ceiling, so the allocator recycles them instead of mapping fresh pages per block
BLOCK_ELEMENTS = 1 << 22


def block_rows(vocab_size: int) -> int:
    return max(1, BLOCK_ELEMENTS // vocab_size)


def matmul_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `tensor` runs in here: the autocast dtype where autocast is on."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


class _SoftLabelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, label_probs, label_rows):
        rows = hidden.shape[0]
        ctx.weight_dtype = weight.dtype
        needs_hidden_grad, needs_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # bf16 / fp16 logits are scored in float32 (softmax over a whole vocabulary)
        score_dtype = torch.promote_types(hidden.dtype, torch.float32)
        compute_dtype = matmul_dtype(hidden)
        loss = hidden.new_zeros((), dtype=score_dtype)
        argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        hidden_grad = torch.zeros_like(hidden) if needs_hidden_grad else None
        weight_grad = torch.zeros_like(weight, dtype=score_dtype) if needs_weight_grad else None
        step = block_rows(weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c, hidden_c = weight.to(compute_dtype), hidden.to(compute_dtype)
            for begin in range(0, rows, step):
                block = slice(begin, begin + step)
                logits = (hidden_c[block] @ weight_c.T).to(score_dtype)
                probs = label_probs.index_select(0, label_rows[block]).to(score_dtype)
                log_probs = logits.log_softmax(dim=-1)
                loss -= (probs * log_probs).sum()
                argmax[block] = logits.argmax(dim=-1)
                if needs_hidden_grad or needs_weight_grad:
                    # d loss / d logits = softmax(logits) * sum(labels) - labels
                    logits_grad = log_probs.exp_().mul_(probs.sum(dim=-1, keepdim=True)).sub_(probs).to(compute_dtype)
                    if needs_hidden_grad:
                        hidden_grad[block] = logits_grad @ weight_c
                    if needs_weight_grad:
                        # cast first: a mixed-dtype += ran 3x slower than the cast and a plain add
                        weight_grad += (logits_grad.T @ hidden_c[block]).to(score_dtype)
        ctx.save_for_backward(hidden_grad, weight_grad)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, loss_grad, _argmax_grad):
        hidden_grad, weight_grad = ctx.saved_tensors
        if hidden_grad is not None:
            hidden_grad = hidden_grad * loss_grad.to(hidden_grad.dtype)
        if weight_grad is not None:
            weight_grad = (weight_grad * loss_grad).to(ctx.weight_dtype)
        return hidden_grad, weight_grad, None, None


def soft_label_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, label_probs: torch.Tensor, label_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`-(label_probs[label_rows] * (hidden @ weight.T).log_softmax(-1)).sum()` and each row's argmax.

    Args:
        hidden: `[rows, H]` the lm_head's inputs.
        weight: `[vocabulary, H]` the lm_head's weight (no bias).
        label_probs: `[labels, vocabulary]` label distributions, shared by several calls.
        label_rows: `[rows]` which of them labels each row.

    Returns the summed loss (a float32 or float64 scalar, differentiable in `hidden` and `weight`) and the
    `[rows]` argmax of the logits.
    """
    if hidden.shape[0] != label_rows.shape[0] or weight.shape[0] != label_probs.shape[-1]:
        raise ValueError(
            f"soft_label_cross_entropy: {hidden.shape[0]} rows with {label_rows.shape[0]} labels, and "
            f"a {weight.shape[0]}-token lm_head against {label_probs.shape[-1]}-token label distributions"
        )
    return _SoftLabelCrossEntropy.apply(hidden, weight, label_probs, label_rows)

