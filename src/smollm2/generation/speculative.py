"""Speculative decoding: guess a row's next few tokens cheaply, feed them all to the model in one pass, and keep
the longest run of guesses that the model's own choices confirm.

At batch 1 a decoding step reads every weight to make one token; a pass over a few more positions reads them
once too, so a confirmed guess costs a fraction of a step (see below). The engine checks the guesses in order
(engine.py): position i's logits go through the same sampling call a decoding step would make (the row's
grammar, penalties, random generator), and the guess at i+1 stands only if it is the token drawn at i. So the
answer is the one plain decoding gives, token for token, greedy or seeded: each position's logits have the bits
of a decoding step's (the pass's rows and a step's are summed in the same order, see MAX_PASS_TOKENS), and each
row draws once per position it keeps, as it would step by step. For a guess that is a fixed token (a lookup, not
a sampled draft) this is the standard rejection rule: the guess stands with the probability the model gives it.

PromptLookup guesses by prompt lookup (n-grams): the tokens that followed an earlier place where the row's most
recent tokens occurred, in its prompt or its answer so far. Editing, extracting, summarising and code changes
repeat long runs of their input; open-ended text rarely does, and then a row stops guessing for a while.

How many to guess: as many as the match has run so far. A pass costs about a decoding step up to 4 positions
(the products' tile of 4 rows reads each weight once for them all), then about 0.28 of a step more per position
(at 5 and over, each position is its own multiply-adds: the CPU's arithmetic, not its memory, bounds the pass).
A 3-token match of common words is often wrong after a token or two; a run copied for 12 tokens mostly goes on.
"""

from __future__ import annotations

import numpy as np

MAX_PASS_TOKENS = 16  # positions in one pass, over every row: the most the CPU decoding kernel takes at once
# (kernels.ops.MAX_ROWS), so a pass is summed as a decoding step is; past it the pass would run on other code
MAX_NGRAM = 3  # the longest run of recent tokens looked up; shorter ones are tried after it, down to MIN_NGRAM
MIN_NGRAM = 2  # a single token recurs too often in any text: its continuations are mostly wrong guesses
MIN_GUESS = 3  # tokens guessed from any match: a pass of 4 positions costs little more than a decoding step
MAX_GUESS = MAX_PASS_TOKENS - 1  # a row alone fills a pass; a longer match guesses no further
MAX_PAUSE = 32  # steps a row waits, at most, before guessing again after its guesses kept missing


class PromptLookup:
    """One row's guesses by prompt lookup; guesses whose first token keeps missing pause it."""

    def __init__(self):
        self.pause = 0  # steps still to wait before guessing again
        self.misses = 0  # passes in a row whose first guess missed
        self.guessed = self.kept = 0  # over the row's life: tokens guessed, and kept

    def guess(self, prompt: list[int], answer: list[int], room: int) -> list[int]:
        """Up to `room` tokens that may come next after the prompt and the answer so far."""
        if self.pause:
            self.pause -= 1
            return []
        return lookup(prompt + answer, room) if room > 0 else []  # joined only when looked up

    def record(self, guessed: int, kept: int) -> None:
        """How many of the last guesses the model kept: a first guess missed several passes running pauses the
        guessing (for 2, 4, 8... steps)."""
        self.guessed, self.kept = self.guessed + guessed, self.kept + kept
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= 2:
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE)


def lookup(tokens: list[int], room: int) -> list[int]:
    """The tokens after the earlier occurrence of the last n tokens (n = MAX_NGRAM, then shorter, down to
    MIN_NGRAM) whose match runs furthest back (the latest of equals): as many as the match has run, from
    MIN_GUESS to MAX_GUESS, and at most `room`; [] where none occurs."""
    seen = np.asarray(tokens)
    for n in range(min(MAX_NGRAM, len(seen) - 1), MIN_NGRAM - 1, -1):
        tail = seen[-n:]
        starts = np.flatnonzero(seen[:len(seen) - n] == tail[0])  # each with a token after its n-gram
        for j in range(1, n):
            starts = starts[seen[starts + j] == tail[j]]
        if starts.size:
            run = n + matched_before(seen, starts, len(seen) - n, MAX_GUESS - n)
            best = int(np.flatnonzero(run == run.max())[-1])
            after = int(starts[best]) + n
            return seen[after:after + min(max(int(run[best]), MIN_GUESS), MAX_GUESS, room)].tolist()
    return []


def matched_before(seen: np.ndarray, starts: np.ndarray, end: int, most: int) -> np.ndarray:
    """For each start, how many tokens just before it equal those just before `end` (up to `most`)."""
    back = np.arange(1, most + 1)
    ours, theirs = end - back, starts[:, None] - back  # each candidate's tokens before it, nearest first
    same = (theirs >= 0) & (seen[np.maximum(theirs, 0)] == seen[np.maximum(ours, 0)]) & (ours >= 0)
    return np.where(same.all(axis=1), most, np.argmin(same, axis=1))
