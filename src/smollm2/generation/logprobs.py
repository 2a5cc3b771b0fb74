"""Log-probabilities of tokens, as OpenAI and vLLM define them: log-softmax, in float32, of the model's raw
logits, before any sampling transform (repetition penalty, temperature, top-k/p, min-p). Shared by the
drivers' next tokens and by the scoring of a prompt (echo, lm-eval's log-likelihoods)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import SmolError

MAX_TOP_LOGPROBS = 20  # as OpenAI


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, and the `top` most likely tokens at its position with theirs, most likely
    first: (token id, logprob) pairs."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(top, name: str = "logprobs") -> int | None:
    """None (no log-probabilities) or a whole number 0..MAX_TOP_LOGPROBS (how many top tokens to list)."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise SmolError(f"{name} must be None or a whole number from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
    return top


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) raw logits -> float32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor,
                   tops: Sequence[int] | int = 0) -> list[TokenLogprob]:
    """For each row of logits (N, V), the log-probability of its target token, and its `tops[i]` (one number
    for all rows) most likely tokens. One host transfer for all rows."""
    logp = log_probs(logits)
    targets = torch.as_tensor(targets, device=logp.device).reshape(-1, 1)
    tops = [tops] * logp.shape[0] if isinstance(tops, int) else list(tops)
    chosen = logp.gather(-1, targets)[:, 0].tolist()
    k = max(tops, default=0)
    if k:
        values, ids = logp.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, lp, tuple(zip(ids[i][:n], values[i][:n])) if n else ())
            for i, (t, lp, n) in enumerate(zip(targets[:, 0].tolist(), chosen, tops))]


def chunk_logprobs(model, prompt: Sequence[int], begin: int, h: torch.Tensor, top: int) -> list[TokenLogprob]:
    """The prompt's tokens that prefill chunk [begin, begin + n) predicts, scored from its hidden states (n, C):
    position i predicts token i + 1 (the chunk's last position, at the prompt's end, predicts nothing)."""
    targets = prompt[begin + 1:begin + 1 + len(h)]
    return token_logprobs(model.logits(h[:len(targets)]), targets, top) if targets else []
