"""One sequence being generated, whichever driver runs it (its request checked before: request.py): its sampling
and random generator; its tokens and text; and when and why it ends.

Fed one token at a time, a sequence returns a Step: the token, the text that is now final, and the finish
reason once it has one. It ends at an EOS token or a stop token id, or once its text holds a stop string ("stop"),
or at its max_new_tokens ("length"); not before its sampling's min_new_tokens, until which EOS and the stop token
ids are banned and stop strings let pass. The text ends before the first stop string, and an end of the text that
may yet grow into one is held back until it cannot: no stop string is ever shown, streamed or not.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

import torch

from ..errors import SmolError
from .grammar import Grammar
from .logprobs import TokenLogprob, token_logprobs
from .sampling import Sampling, sample


class StopStrings:
    """Finds the first stop string in a text that grows at its end. Each new character is looked at once per
    stop string (Knuth-Morris-Pratt), however long the strings: rescanning the text, or trying every prefix of
    a string, at each token would cost time quadratic in their lengths (in the server, every client's time)."""

    def __init__(self, stop: abc.Sequence[str]):
        self.stop = tuple(stop)
        self.borders = [borders(s) for s in self.stop]
        self.matched = [0] * len(self.stop)  # per string: the longest end of the text that begins it
        self.seen = 0  # characters of the text fed so far
        self.found: str | None = None  # the stop string that ended the text, once one has

    def feed(self, new: str, ending: bool = True) -> int:
        """Take the text's next characters; returns where the first stop string completed in them starts, or -1.
        ending=False: a stop string completed now does not end the text (min_new_tokens): matching goes past it."""
        cut = -1
        for j, (stop, border) in enumerate(zip(self.stop, self.borders)):
            k = self.matched[j]
            for i, c in enumerate(new):
                while k and stop[k] != c:
                    k = border[k - 1]
                k += stop[k] == c
                if k == len(stop):
                    start = self.seen + i + 1 - k
                    if ending and (cut < 0 or start < cut):
                        cut, self.found = start, stop
                    k = border[k - 1]
            self.matched[j] = k
        self.seen += len(new)
        return cut

    @property
    def held(self) -> int:
        """Characters at the end of the text that may yet grow into a stop string."""
        return max(self.matched, default=0)


def borders(s: str) -> list[int]:
    """borders[i]: the length of the longest proper prefix of s[:i + 1] that also ends it."""
    result, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = result[k - 1]
        k += s[i] == s[k]
        result[i] = k
    return result


@dataclass(frozen=True)
class Step:
    """What one token did to its sequence. text: the text that became final with it (often "", while a
    character or a possible stop string is incomplete; always "" without a tokenizer); finish_reason: "stop"
    (EOS or a stop string) or "length" on the sequence's last token, else None. logprob: the token's
    log-probability and its position's most likely tokens, when the sequence was asked for them."""
    token: int
    text: str
    finish_reason: str | None
    logprob: TokenLogprob | None = None


class Sequence:
    """A prompt and everything generated after it, for one row of a batch."""

    def __init__(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, eos: abc.Collection[int],
                 stop: abc.Sequence[str | int] = (), tokenizer=None, device="cpu", logprobs: int | None = None,
                 grammar: Grammar | None = None):
        """stop: strings (which need the tokenizer) and token ids; a stop token ends the sequence as EOS does."""
        strings = [s for s in stop if isinstance(s, str)]
        if strings and tokenizer is None:
            raise SmolError("stop strings need a tokenizer: pass tokenizer=")
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        # A grammar's answer ends with its EOS, which ends the sequence even where the caller's EOS set lacks it.
        self.eos = frozenset(eos) | {s for s in stop if not isinstance(s, str)} | (
            {grammar.eos_token_id} if grammar else set())
        self.matcher = grammar.matcher() if grammar else None  # where the answer stands in the grammar
        self.sampling, self.generator = sampling, sampling.generator(device)
        self.logprobs = logprobs  # None: none; n: each token's logprob and its position's top n
        self.stops = StopStrings(strings)
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True) if tokenizer is not None else None
        self.tokens: list[int] = []  # generated so far, EOS included
        self.text = ""  # the answer so far, cut before the first stop string
        self.released = 0  # characters of text already returned
        self.finish_reason: str | None = None if max_new_tokens else "length"

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> Step:
        """Take the next token (and its log-probabilities); returns the text that is now final."""
        if self.matcher is not None:
            self.matcher.accept(token)
        self.tokens.append(token)
        if token in self.eos:  # a grammar that gave up ends its answer short, as max_new_tokens would
            self._finish("length" if self.matcher is not None and self.matcher.cut_short else "stop")
        else:
            new = self.decoder.step(token) if self.decoder else ""
            self.text += new
            cut = self.stops.feed(new, ending=len(self.tokens) >= self.sampling.min_new_tokens)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"  # what the decoder still holds comes after the stop string: dropped
            elif len(self.tokens) == self.max_new_tokens:
                self._finish("length")
        # Hold back an end of the text that may yet grow into a stop string, until the sequence ends.
        end = len(self.text) if self.finish_reason else len(self.text) - self.stops.held
        text = self.text[self.released:end]
        self.released += len(text)
        return Step(token, text, self.finish_reason, logprob)

    def _finish(self, reason: str) -> None:
        if self.decoder:  # a character still incomplete at the end comes out as decode() shows it
            self.text += self.decoder.finish()
        self.finish_reason = reason

    @property
    def banned(self) -> abc.Collection[int]:
        """The token ids this sequence may not take next: its EOS and stop ids, before its min_new_tokens."""
        return self.eos if len(self.tokens) < self.sampling.min_new_tokens else ()


def next_tokens(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """One token for each sequence, (B,), from its row of logits (B, V): one sampling call for the batch, after
    each row under a grammar has lost the tokens its grammar forbids next, and each row short of its
    min_new_tokens its EOS and stop ids."""
    going = [not s.finish_reason for s in sequences]
    constrained = [s.matcher if s.matcher is not None and go else None for s, go in zip(sequences, going)]
    banned = [list(s.banned) if go else [] for s, go in zip(sequences, going)]
    if any(constrained) or any(banned):
        logits = logits.float().clone()  # the caller's logits stay raw: log-probabilities come from them
        for row, matcher, ids in zip(logits, constrained, banned):
            if matcher is not None:
                matcher.allowed(row)
            row[ids] = float("-inf")
    history = generated = None
    if any(s.sampling.repetition_penalty != 1.0 for s in sequences):  # the ids the repetition penalty applies to
        history = id_rows([s.prompt + s.tokens for s in sequences], logits.device)
    if any(s.sampling.presence_penalty or s.sampling.frequency_penalty for s in sequences):  # OpenAI's count these
        generated = id_rows([s.tokens for s in sequences], logits.device)
    return sample(logits, [s.sampling for s in sequences], [s.generator for s in sequences], history, generated)


def id_rows(ids: list[list[int]], device) -> torch.Tensor:
    """Lists of ids of any lengths as one (B, S) tensor, -1 after each row's ids."""
    out = torch.full((len(ids), max(map(len, ids), default=0)), -1, dtype=torch.long)
    for row, seen in zip(out, ids):
        row[:len(seen)] = torch.tensor(seen, dtype=torch.long)
    return out.to(device)


def advance(logits: torch.Tensor, sequences: list[Sequence]) -> list[Step | None]:
    """Every sequence's next token from its row of logits (B, V), handed to the sequences that have not
    finished; their Steps (None for a finished one) carry the token's log-probabilities where asked."""
    ids = next_tokens(logits, sequences)
    tokens = ids.tolist()
    want = [b for b, s in enumerate(sequences) if s.logprobs is not None and not s.finish_reason]
    logprobs = [None] * len(sequences)
    if want:
        rows = torch.tensor(want, device=logits.device)
        for b, lp in zip(want, token_logprobs(logits[rows], ids[rows], [sequences[b].logprobs for b in want])):
            logprobs[b] = lp
    return [None if s.finish_reason else s.accept(t, lp) for s, t, lp in zip(sequences, tokens, logprobs)]
