"""Cross-entropy over the vocabulary fused with the output projection, a chunk of tokens at a time.

The plain way, F.cross_entropy(F.linear(h, W), y), keeps (tokens, vocab) logits for the backward pass,
writes a log-softmax of the same size, and in backward fills and scatters another one. With SmolLM2's
49152-token vocabulary that traffic is most of a small model's step. Here each chunk's logits are made,
turned in place into d(loss)/d(logits) = softmax - onehot, multiplied into the gradients of h and W, and
dropped: same matmuls, a fraction of the memory traffic, and no (tokens, vocab) tensor kept alive.
The gradients are computed in the forward pass; backward only scales them by the incoming gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn

IGNORE = -100  # label of a position that is not scored (as in transformers and F.cross_entropy)
CHUNK_ELEMENTS = 2**24  # logits per chunk (64 MiB in float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, need_h: bool, need_w: bool):
        # h: (N, C) hidden states, weight: (V, C) output projection, labels: (N,) next-token ids or IGNORE;
        # need_h, need_w: which gradients to compute (a frozen output projection, as under LoRA, needs none).
        device = h.device.type
        # Under autocast the matmuls run in its dtype (as F.linear would); softmax and sums in float32.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        with torch.autocast(device, enabled=False):
            x, w = h.to(dtype), weight.to(dtype)
            N, V = h.shape[0], weight.shape[0]
            chunk = min(N, max(1, CHUNK_ELEMENTS // V))
            # Two buffers reused by every chunk: fresh (chunk, V) tensors would cost page faults each time.
            logits = torch.empty(chunk, V, dtype=torch.float32, device=h.device)
            logp = torch.empty_like(logits)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
            for start in range(0, N, chunk):
                xc, y = x[start:start + chunk], labels[start:start + chunk]
                n, valid, target = len(y), y != IGNORE, y.clamp(min=0)[:, None]
                if dtype == torch.float32:
                    torch.matmul(xc, w.t(), out=logits[:n])
                else:
                    logits[:n] = xc @ w.t()
                torch.log_softmax(logits[:n], -1, out=logp[:n])  # (n, V)
                loss -= (logp[:n].gather(1, target)[:, 0] * valid).sum()
                if need_h or need_w:
                    grad = logp[:n].exp_()  # softmax: d(loss)/d(logits) = softmax - onehot(label)
                    grad.scatter_add_(1, target, torch.full_like(grad[:, :1], -1.0))
                    grad.index_fill_(0, (~valid).nonzero()[:, 0], 0.0)  # unscored positions give nothing
                    grad = grad.to(dtype)
                if need_h:
                    grad_h[start:start + n] = grad @ w
                if need_w and dtype == torch.float32:
                    grad_w.addmm_(grad.t(), xc)
                elif need_w:
                    grad_w += grad.t() @ xc
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_loss,
                None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sum over scored positions of -log softmax(h @ weight.T)[label]; h: (..., C), labels: (...)."""
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1),
                                     grad and h.requires_grad, grad and weight.requires_grad)


class NextTokenLoss(nn.Module):
    """A model and its training loss as one module: DDP and FSDP then see every use of the weights,
    the output projection in the loss included, inside forward.

    The training loop takes any objective shaped like this one (dpo.DPOLoss is the other): forward(*batch) gives
    the sums named in `metrics` over the batch's rows, "loss" first, count(batch) what they are averaged over, and
    projected(batch) how many positions it makes logits for (for MFU)."""

    metrics = ("loss",)
    perplexity = True  # exp(loss) means something: the validation perplexity is logged beside the loss

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """inputs, labels: (B, T); the summed loss over scored positions (labels != IGNORE)."""
        return {"loss": linear_cross_entropy(self.model.hidden_states(inputs), self.model.output_weight, labels)}

    @staticmethod
    def count(batch: tuple[torch.Tensor, ...]) -> int:
        """The loss is a mean over every scored token."""
        return int((batch[1] != IGNORE).sum())

    @staticmethod
    def projected(batch: tuple[torch.Tensor, ...]) -> int:
        """How many positions the output projection takes: every one (the unscored ones' logits are made too)."""
        return batch[0].numel()
