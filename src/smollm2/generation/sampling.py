"""Choosing the next token of many rows at once: greedy, or seeded sampling after transformers' logits warpers.

Order: OpenAI's logit bias and presence and frequency penalties, added to the raw logits (their order among
themselves does not matter: all three add); then, as in transformers' generate, repetition penalty, temperature,
top-k, top-p, min-p. Every row brings its
own parameters and its own random generator, and each warper works on a row alone (its parameters are
per-row columns, and a row whose parameter means "none" passes through unchanged), so a row draws the same
token in any batch as alone. The draw is an exponential race (argmax of p / Exp(1) noise), which picks token i
with probability p_i and needs no host sync.
"""

from __future__ import annotations

import math
from collections import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import SmolError

# Temperatures below this decode greedily. Dividing float32 logits by a smaller one can overflow them to inf
# (then NaN, and token 0), and already at this one the softmax is one-hot for any logit gap above 1e-3.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**64 - 1  # seeds are 0..MAX_SEED: what torch.Generator.manual_seed takes, less the negative aliases
MAX_BIAS = 100  # logit_bias values are in [-MAX_BIAS, MAX_BIAS], as OpenAI's
MAX_PENALTY = 2  # presence and frequency penalties are in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted from each token generated so far, once
    frequency_penalty: float = 0.0  # OpenAI's: subtracted from each token generated so far, once per time
    logit_bias: abc.Mapping[int, float] | None = None  # token id -> added to its logit (-100 bans it in practice)
    # until the row has generated this many, its EOS and stop ids are banned (stop strings pass)
    min_new_tokens: int = 0
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
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, lambda p: -MAX_PENALTY <= p <= MAX_PENALTY, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if self.top_k is not None and not whole(self.top_k):
            raise SmolError(f"top_k must be a whole number >= 0 (0 means none), got {self.top_k!r}")
        if not whole(self.min_new_tokens):
            raise SmolError(f"min_new_tokens must be a whole number >= 0, got {self.min_new_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, abc.Mapping):
                raise SmolError(f"logit_bias must map token ids to biases, not {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not whole(token):
                    raise SmolError(f"logit_bias: {token!r} is not a token id")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
                    raise SmolError(f"logit_bias of token {token}: {bias!r} is not a number in "
                                    f"[-{MAX_BIAS}, {MAX_BIAS}]")
        if self.seed is not None and not (whole(self.seed) and self.seed <= MAX_SEED):
            raise SmolError(f"seed must be a whole number from 0 to 2**64-1, got {self.seed!r}")

    @property
    def additive(self) -> bool:
        """Whether this row adds to its raw logits: a logit bias, or a presence or frequency penalty."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device) -> torch.Generator | None:
        """The random generator of one row: seeded with `seed` (a random one if None); None when greedy."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(2**62, ()).item())
        return torch.Generator(device).manual_seed(seed)


def whole(value) -> bool:
    """A whole number >= 0 (not a bool, which Python counts as an int)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def column(values, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """One parameter per row, (B, 1): broadcast along the vocabulary."""
    return torch.tensor(values, dtype=dtype, device=like.device)[:, None]


def counts(ids: torch.Tensor, V: int) -> torch.Tensor:
    """(B, V) float32: how many times each token is in each row of ids, (B, S) with -1 for none."""
    # -1 (no token) goes to a spare column that is then dropped.
    out = torch.zeros(ids.shape[0], V + 1, device=ids.device)
    return out.scatter_add_(1, torch.where(ids < 0, V, ids), torch.ones(ids.shape, device=ids.device))[:, :V]


def added(logits: torch.Tensor, samplings: Sequence[Sampling], generated: torch.Tensor | None) -> torch.Tensor:
    """What OpenAI's logit bias and presence and frequency penalties add to each row's logits, (B, V):
    bias[j] - presence * (count[j] > 0) - frequency * count[j], count[j] the times token j is in the row of
    `generated` (as for penalized). Zero in the rows that ask for none."""
    out = torch.zeros_like(logits)
    for row, s in zip(out, samplings):
        if s.logit_bias:
            row[torch.tensor(list(s.logit_bias), device=out.device)] = torch.tensor(
                [float(b) for b in s.logit_bias.values()], device=out.device)
    if generated is not None:
        count = counts(generated, logits.shape[-1])
        out -= column([s.presence_penalty for s in samplings], logits) * (count > 0)
        out -= column([s.frequency_penalty for s in samplings], logits) * count
    return out


def penalized(logits: torch.Tensor, samplings: Sequence[Sampling], history: torch.Tensor | None = None,
              generated: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits with each row's own additions (its logit bias, and its presence and frequency penalties on
    the ids in its row of `generated`, the tokens generated so far), then its repetition penalty on the ids in its
    row of `history` (its prompt's and generated tokens); both (B, S) with -1 for none, None where no row needs
    them. Greedy rows take the argmax of these."""
    logits = logits.float()
    if any(s.additive for s in samplings):
        logits = logits + added(logits, samplings, generated)
    if history is None or all(s.repetition_penalty == 1.0 for s in samplings):
        return logits
    seen = counts(history, logits.shape[-1]) > 0
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
           history: torch.Tensor | None = None, generated: torch.Tensor | None = None) -> torch.Tensor:
    """One next token per row, (B,): logits (B, V); per row its Sampling and its generator (None when greedy);
    history and generated as for penalized. Each sampling row draws once from its own generator."""
    logits = penalized(logits, samplings, history, generated)
    greedy = logits.argmax(-1)
    if all(g is None for g in generators):
        return greedy
    noise = torch.ones_like(logits)
    for row, g in zip(noise, generators):
        if g is not None:
            row.exponential_(generator=g)
    drawn = (warped(logits, samplings).softmax(-1) / noise).argmax(-1)
    return torch.where(torch.tensor([g is None for g in generators], device=logits.device), greedy, drawn)
