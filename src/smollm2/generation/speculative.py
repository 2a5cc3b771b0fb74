"""Speculative decoding: guess a row's next few tokens cheaply, feed them all to the model in one pass, and keep
the longest run of guesses that the model's own choices confirm.

At batch 1 a decoding step reads every weight to make one token; a pass over a few more positions reads them
once too, so every confirmed guess is a token for (almost) nothing. The engine checks the guesses in order
(engine.py): position i's logits go through the same sampling call a decoding step would make (the row's
grammar, penalties, random generator), and the guess at i+1 stands only if it is the token drawn at i. So the
answer is the one plain decoding gives, token for token, greedy or seeded: each position's logits have the bits
of a decoding step's (the pass's rows and a step's are summed in the same order, see MAX_PASS_TOKENS), and each
row draws once per position it keeps, as it would step by step. For a guess that is a fixed token (a lookup, not
a sampled draft) this is the standard rejection rule: the guess stands with the probability the model gives it.

PromptLookup guesses by prompt lookup (n-grams): the tokens that followed the last place where the row's most
recent tokens occurred before, in its prompt or its answer so far. Editing, extracting, summarising and code
changes repeat long runs of their input; open-ended text rarely does, and then a row stops guessing for a while.
"""

from __future__ import annotations

import numpy as np

MAX_PASS_TOKENS = 16  # positions in one pass, over every row: the most the CPU decoding kernel takes at once
# (kernels.ops.MAX_ROWS), so a pass is summed as a decoding step is; past it the pass would run on other code
MAX_NGRAM = 3  # the longest run of recent tokens looked up; shorter ones are tried after it, down to MIN_NGRAM
MIN_NGRAM = 2  # a single token recurs too often in any text: its continuations are mostly wrong guesses
MAX_GUESS = 8  # tokens guessed at once: a pass of 9 positions costs about 1.5 decoding steps on the CPU
MAX_PAUSE = 32  # steps a row waits, at most, before guessing again after its guesses kept missing


class PromptLookup:
    """One row's guesses by prompt lookup, their length adapted to how many the model has kept lately."""

    def __init__(self):
        self.length = 3  # tokens to guess next
        self.pause = 0  # steps still to wait before guessing again
        self.misses = 0  # passes in a row whose first guess missed
        self.guessed = self.kept = 0  # over the row's life: tokens guessed, and kept

    def guess(self, prompt: list[int], answer: list[int], room: int) -> list[int]:
        """Up to `room` tokens that may come next after the prompt and the answer so far."""
        if self.pause:
            self.pause -= 1
            return []
        return lookup(prompt + answer, min(self.length, room)) if room > 0 else []  # joined only when looked up

    def record(self, guessed: int, kept: int) -> None:
        """How many of the last guesses the model kept: all of them lengthens the next, fewer shortens it, and a
        first guess missed several passes running pauses the guessing (for 2, 4, 8... steps)."""
        self.guessed, self.kept = self.guessed + guessed, self.kept + kept
        self.length = min(self.length + 2, MAX_GUESS) if kept == guessed else max(kept + 1, 1)
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= 2:
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE)


def lookup(tokens: list[int], length: int) -> list[int]:
    """The `length` tokens after the latest earlier occurrence of the last n tokens (n = MAX_NGRAM, then shorter,
    down to MIN_NGRAM); [] where none occurs."""
    seen = np.asarray(tokens)
    for n in range(min(MAX_NGRAM, len(seen) - 1), MIN_NGRAM - 1, -1):
        tail = seen[-n:]
        starts = np.flatnonzero(seen[:len(seen) - n] == tail[0])  # each with a token after its n-gram
        for j in range(1, n):
            starts = starts[seen[starts + j] == tail[j]]
        if starts.size:
            after = int(starts[-1]) + n
            return seen[after:after + length].tolist()
    return []
