"""Choosing the next token of many rows at once: greedy, or seeded sampling after transformers' logits warpers.

Order as in transformers' generate: repetition penalty, temperature, top-k, top-p, min-p. Every row brings its
own parameters and its own random generator, and each warper works on a row alone (its parameters are
per-row columns, and a row whose parameter means "none" passes through unchanged), so a row draws the same
token in any batch as alone. The draw is an exponential race (argmax of p / Exp(1) noise), which picks token i
with probability p_i and needs no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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

    def generator(self, device) -> torch.Generator | None:
        """The random generator of one row: seeded with `seed` (a random one if None); None when greedy."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(2**62, ()).item())
        return torch.Generator(device).manual_seed(seed)


def column(values, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """One parameter per row, (B, 1): broadcast along the vocabulary."""
    return torch.tensor(values, dtype=dtype, device=like.device)[:, None]


def penalized(logits: torch.Tensor, samplings: Sequence[Sampling], history: torch.Tensor | None) -> torch.Tensor:
    """float32 logits, each row's repetition penalty applied to the ids in its row of history, (B, S) with -1
    for none. Greedy rows take the argmax of these."""
    logits = logits.float()
    if history is None or all(s.repetition_penalty == 1.0 for s in samplings):
        return logits
    # Mark every token seen; -1 (no token) goes to a spare column that is then dropped.
    V = logits.shape[-1]
    seen = torch.zeros(logits.shape[0], V + 1, dtype=torch.bool, device=logits.device)
    seen = seen.scatter_(1, torch.where(history < 0, V, history), True)[:, :V]
    penalty = column([s.repetition_penalty for s in samplings], logits)
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def warped(logits: torch.Tensor, samplings: Sequence[Sampling]) -> torch.Tensor:
    """The (penalized) logits sampling rows draw from: tempered, and -inf outside top-k/top-p/min-p. Greedy
    rows pass through at temperature 1 (their result is not used)."""
    V = logits.shape[-1]
    logits = logits / column([1.0 if s.greedy else s.temperature for s in samplings], logits)
    if any(s.top_k for s in samplings):
        k = column([min(s.top_k or V, V) for s in samplings], logits, torch.long)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)  # each row's k-th largest
        logits = logits.masked_fill(logits < kth, -math.inf)
    if any(s.top_p is not None and s.top_p < 1 for s in samplings):
        # Drop the least likely tokens while their probabilities add up to at most 1 - top_p, that difference
        # taken in float64 as transformers does; -1 drops none, in the rows without top-p.
        mass = column([1 - s.top_p if s.top_p is not None and s.top_p < 1 else -1.0 for s in samplings], logits)
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as transformers
        drop = sorted_logits.softmax(-1).cumsum(-1) <= mass
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
    if any(s.min_p for s in samplings):
        min_p = column([s.min_p or 0.0 for s in samplings], logits)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    return logits


def sample(logits: torch.Tensor, samplings: Sequence[Sampling], generators: Sequence[torch.Generator | None],
           history: torch.Tensor | None = None) -> torch.Tensor:
    """One next token per row, (B,): logits (B, V); per row its Sampling and its generator (None when greedy);
    history as for penalized. Each sampling row draws once from its own generator."""
    logits = penalized(logits, samplings, history)
    greedy = logits.argmax(-1)
    if all(g is None for g in generators):
        return greedy
    noise = torch.ones_like(logits)
    for row, g in zip(noise, generators):
        if g is not None:
            row.exponential_(generator=g)
    drawn = (warped(logits, samplings).softmax(-1) / noise).argmax(-1)
    return torch.where(torch.tensor([g is None for g in generators], device=logits.device), greedy, drawn)
