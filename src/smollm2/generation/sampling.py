"""Choosing the next token from logits: greedy, or seeded sampling after transformers' logits warpers.

Order as in transformers' generate: repetition penalty, temperature, top-k, top-p, min-p. Each row owns its
random generator, so a row samples the same tokens in a batch as alone, and no host sync is needed: the
draw is an exponential race (argmax of p / Exp(1) noise), which picks token i with probability p_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SmolError

# Temperatures below this decode greedily. Dividing float32 logits by a smaller one can overflow them to inf
# (then NaN, and token 0), and already at this one the softmax is one-hot for any logit gap above 1e-3.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**64 - 1  # seeds are 0..MAX_SEED: what torch.Generator.manual_seed takes, less the negative aliases


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        def number(name, ok, what):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or not ok(value)):
                raise SmolError(f"{name} must be {what}, got {value!r}")

        number("temperature", lambda t: t >= 0, "a number >= 0 (0 means greedy)")
        number("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
        number("min_p", lambda p: 0 <= p <= 1, "in [0, 1]")
        number("repetition_penalty", lambda r: r > 0, "a number > 0 (1 means none)")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise SmolError(f"top_k must be a whole number >= 0 (0 means none), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise SmolError(f"seed must be a whole number from 0 to 2**64-1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Next-token choice for a batch of rows, each with its own seeded generator."""

    def __init__(self, sampling: Sampling, batch_size: int, device):
        self.sampling = sampling
        self.generators = []
        if not sampling.greedy:
            base = sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ()).item())
            self.generators = [torch.Generator(device).manual_seed(base) for _ in range(batch_size)]

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """logits: (B, V); history: (B, S) ids the penalty applies to (-1 for none). Returns (B,) ids."""
        logits = self.warp(logits, history)
        if self.sampling.greedy:
            return logits.argmax(-1)
        noise = torch.stack([torch.empty_like(logits[0]).exponential_(generator=g) for g in self.generators])
        return (logits.softmax(-1) / noise).argmax(-1)

    def warp(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 logits sampling draws from: penalised, tempered, and -inf outside top-k/top-p/min-p."""
        s = self.sampling
        logits = logits.float()
        if s.repetition_penalty != 1.0 and history is not None:
            # Mark every token seen; -1 (no token) goes to a spare column that is then dropped.
            V = logits.shape[-1]
            seen = torch.zeros(logits.shape[0], V + 1, dtype=torch.bool, device=logits.device)
            seen = seen.scatter_(1, torch.where(history < 0, V, history), True)[:, :V]
            penalized = torch.where(logits < 0, logits * s.repetition_penalty, logits / s.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        if s.greedy:
            return logits
        logits = logits / s.temperature
        if s.top_k:
            kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if s.top_p is not None and s.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1)  # ascending, as transformers
            drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - s.top_p
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
        if s.min_p:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), -math.inf)
        return logits
