"""Speculative decoding: guess a row's next few tokens cheaply, feed them all to the model in one pass, and keep
the longest run of guesses that the model's own choices confirm.

At batch 1 a decoding step reads every weight to make one token; a pass over a few more positions reads them
once too, so a confirmed guess costs a fraction of a step (see below). The engine checks the guesses in order
(engine.py): position i's logits go through the same sampling call a decoding step would make (the row's
grammar, penalties, random generator), and the guess at i+1 stands only if it is the token drawn at i. So the
answer is the one plain decoding gives, token for token, greedy or seeded: each position's logits have the bits
of a decoding step's (the pass's rows and a step's are summed in the same order, see MAX_PASS_TOKENS), and each
row draws once per position it keeps, as it would step by step. For a guess that is a fixed token this is the
standard rejection rule: accepting a guess x with probability min(1, p(x) / q(x)) and, rejected, drawing from
p - q with its negative part cut off, is, where the guesser's q puts all its mass on x, accepting with
probability p(x) and otherwise drawing from p without x: what "the guess stands if it is the token drawn" does.

Two guessers, one interface (guess, record), so the engine need not know which a row has:
- PromptLookup guesses by prompt lookup (n-grams): the tokens that followed an earlier place where the row's most
  recent tokens occurred, in its prompt or its answer so far. Editing, extracting, summarising and code changes
  repeat long runs of their input; open-ended text rarely does, and then a row stops guessing for a while. It
  guesses as many tokens as the match has run so far. A pass of 4 positions costs about 1.5 decoding steps (the
  products' tile of 4 rows reads each weight once for them all), 5 about 2, then about a quarter of a step more
  per position (each its own multiply-adds: the CPU's arithmetic, not its memory, bounds the pass;
  benchmarks/speculative.py prints the costs). A 3-token match of common words is often wrong after a token or
  two; a run copied for 12 tokens mostly goes on.
- Draft guesses with a smaller model of the same vocabulary (a 135M drafting for a 360M or 1.7B; a quantized
  base drafting for a fine-tune of it): its greedy tokens, from a KV cache of the row's own that it rolls back to
  what the model kept. Each guess costs it a decoding step of its own, so it guesses as many as the model has
  kept lately: all of the last ones kept lengthens the next run, fewer shortens it. Greedy, not sampled: a fixed
  guess keeps the answer equal to plain decoding's token for token, seeded runs included, where a sampled draft
  would give another sample of the same distribution; at temperature 0, where the draft matters most, the two
  accept the same guesses.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SmolError
from ..model import SmolLM2
from .steps import cache_length, chunks, decode_step, prefill_chunk, untouched_cache

MAX_PASS_TOKENS = 16  # positions in one pass, over every row: the most the CPU decoding kernel takes at once
# (kernels.ops.MAX_ROWS), so a pass is summed as a decoding step is; past it the pass would run on other code
MAX_NGRAM = 3  # the longest run of recent tokens looked up; shorter ones are tried after it, down to MIN_NGRAM
MIN_NGRAM = 2  # a single token recurs too often in any text: its continuations are mostly wrong guesses
MIN_GUESS = 3  # tokens guessed from any match: a pass of 4 positions costs little more than a decoding step
MAX_GUESS = MAX_PASS_TOKENS - 1  # a row alone fills a pass; a longer match guesses no further
MAX_PAUSE = 32  # steps a row waits, at most, before guessing again after its guesses kept missing


class Guesser:
    """One row's guesses; guesses whose first token keeps missing pause it. A subclass says how it guesses
    (propose)."""

    def __init__(self):
        self.pause = 0  # steps still to wait before guessing again
        self.misses = 0  # passes in a row whose first guess missed
        self.guessed = self.kept = 0  # over the row's life: tokens guessed, and kept

    def guess(self, prompt: list[int], answer: list[int], room: int) -> list[int]:
        """Up to `room` tokens that may come next after the prompt and the answer so far."""
        if self.pause:
            self.pause -= 1
            return []
        return self.propose(prompt + answer, room) if room > 0 else []  # joined only if guessing

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """Up to `room` tokens that may come after `tokens`."""
        raise NotImplementedError

    def record(self, guessed: int, kept: int) -> None:
        """How many of the last guesses the model kept: a first guess missed several passes running pauses the
        guessing (for 2, 4, 8... steps)."""
        self.guessed, self.kept = self.guessed + guessed, self.kept + kept
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= 2:
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE)


class PromptLookup(Guesser):
    """Guesses by prompt lookup (see above)."""

    def propose(self, tokens: list[int], room: int) -> list[int]:
        return lookup(tokens, room)


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


class Draft(Guesser):
    """Guesses with a draft model (see above), through the steps the engine runs its model with: the tokens it
    has not seen yet (the prompt at first; then the model's correction, and guesses of its own that it did not
    feed) in one prefill, whose last position gives the first guess; then a decoding step per further guess."""

    def __init__(self, model: SmolLM2, length: int, kv_cache_dtype: str | None = None):
        """length: the most tokens the row will hold (its prompt and answer), guesses included; kv_cache_dtype:
        what its cache stores (kv_cache.KVCache), None for the draft model's dtype."""
        super().__init__()
        self.length = 3  # tokens to guess next
        self.model = model
        self.device = model.model.embed_tokens.weight.device
        self.cache = untouched_cache(model, 1, cache_length(length, model.config.max_position_embeddings),
                                     kv_cache_dtype)
        self.seen: list[int] = []  # the tokens whose keys and values the cache holds, slot by slot
        self.given = 0  # how many tokens the row had when it last guessed

    def record(self, guessed: int, kept: int) -> None:
        super().record(guessed, kept)
        self.length = min(self.length + 2, MAX_GUESS) if kept == guessed else max(kept + 1, 1)

    def propose(self, tokens: list[int], room: int) -> list[int]:
        # The last guess is never fed, so the cache takes len(tokens) + length - 1 slots.
        length = min(self.length, room, self.cache.k.shape[3] + 1 - len(tokens))
        if length <= 0:  # past the draft's context window
            return []
        # Keep what the cache holds of these tokens (from the first guess the model did not keep on, it is rolled
        # back, to be overwritten), less the last token at least: its position's logits give the first guess. The
        # row's tokens only grow, so those given last time are held still.
        same = min(self.given, len(tokens) - 1)
        while same < min(len(self.seen), len(tokens) - 1) and self.seen[same] == tokens[same]:
            same += 1
        for begin, end in chunks(same, len(tokens)):
            h = prefill_chunk(self.model, torch.tensor([tokens[begin:end]], device=self.device), self.cache, begin)
        guesses = [int(self.model.logits(h[:, -1]).argmax(-1))]
        for slot in range(len(tokens), len(tokens) + length - 1):
            ids = torch.tensor([[guesses[-1]]], device=self.device)
            at = torch.tensor([[slot]], device=self.device)
            guesses.append(int(decode_step(self.model, ids, at, self.cache.view(length=slot + 1), None).argmax(-1)))
        self.seen, self.given = tokens + guesses[:-1], len(tokens)
        return guesses


def check_speculative(speculative, vocab_size: int) -> None:
    """None, "ngram" (prompt lookup) or a draft model (a SmolLM2) of `vocab_size` tokens; else a SmolError."""
    if isinstance(speculative, SmolLM2):
        if speculative.config.vocab_size != vocab_size:
            raise SmolError(f"speculative: the draft model's vocabulary ({speculative.config.vocab_size} tokens) "
                            f"is not the model's ({vocab_size}): a draft must share its tokenizer")
    elif speculative not in (None, "ngram"):
        raise SmolError(f"speculative must be None, 'ngram' or a draft model (a SmolLM2), got {speculative!r}")


def new_guesser(speculative, length: int, kv_cache_dtype: str | None = None) -> Guesser | None:
    """A new row's guesser (see check_speculative), for a row of up to `length` tokens, a draft's cache storing
    kv_cache_dtype; None: no speculation."""
    if speculative is None:
        return None
    return Draft(speculative, length, kv_cache_dtype) if isinstance(speculative, SmolLM2) else PromptLookup()


def speculation(text: str | None, tokenizer, **options) -> SmolLM2 | str | None:
    """What `speculative=` takes, from the text the command line's --speculative gives: None or "off": None;
    "ngram": prompt lookup; "draft:SRC": the draft model at SRC (any source smollm2.load takes; "draft" alone: the
    embedded model), loaded as load() loads it with `options` (dtype, device, quantize, kernels). A draft's
    tokenizer must be `tokenizer`, the model's, every token at the same id: its guesses are token ids, which the
    model reads as its own; the vocabulary's size alone (check_speculative) would let another tokenizer through."""
    if text in (None, "off", "ngram"):
        return None if text == "off" else text
    # Imported here, for a draft alone: generation itself needs neither the loader nor the tokenizer (jinja2,
    # tokenizers: ~5 MB resident).
    from ..loading import load
    from ..tokenizer import Tokenizer

    kind, _, src = text.partition(":")
    if kind != "draft":
        raise SmolError(f"speculative must be ngram, off, draft or draft:SRC, got {text!r}")
    vocab = Tokenizer.from_pretrained(src or None).backend.get_vocab(with_added_tokens=True)
    if vocab != tokenizer.backend.get_vocab(with_added_tokens=True):
        raise SmolError(f"--speculative {text}: the draft's tokenizer is not the model's; a draft must share its "
                        f"vocabulary")
    return load(src or None, **options)
