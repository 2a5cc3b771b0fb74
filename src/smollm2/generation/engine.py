"""The engine: the rows of one KV cache, each a Sequence at its own positions, advanced a step at a time. Every
driver runs on it: generate()/stream() (batch.py) admit a static batch and step until every row has finished;
the server's engine thread admits requests as they come and steps for as long as any is in flight. Both make
their rows of Requests the one way (request.py: Request.row) and queue them (queue).

A row is admitted into a queue. The rows decoding hold cache rows 0..n-1, so that a decoding step runs on those
n rows alone (a lone row costs a batch of one, not of every cache row); the row whose prompt is being prefilled
holds row n, the next. Each step
  1. runs ONE decoding pass for rows 0..n-1 at once, every row at its own position (slot s of a row holds
     position s of its sequence; the causal mask over slots hides what an earlier, longer row left past it),
     and picks every row's next token in one sampling call (sequence.advance), each row with its own
     parameters and random generator; its Sequence says what text is final and whether it has finished. A row
     that speculates (speculative.py) feeds the tokens it guessed after its last one, in the same pass; its
     positions are then taken in order, one sampling call each, for as long as the token drawn is the guess
     fed after it: such a row may gain several tokens a step;
  2. retires the rows that have finished: the last row decoding moves into each freed row, its filled slots
     copied, so the rows decoding stay 0..n-1 (and the prefilling one n);
  3. prefills the queued prompts into the free rows, in chunks that end at multiples of PREFILL_CHUNK
     (steps.chunks), up to a budget of tokens a step: the server's lets the rows decoding go on between a long
     prompt's chunks; several short prompts fit in one step. The chunks are those one prompt after another would
     take, computed in waves (each row's first, then its second, ...), where several rows' chunks share one pass
     (steps.prefill_rows), each row's bits those it gets alone. Chunks already in the prefix cache (same tokens,
     same place) are copied instead of computed, and those computed are kept. A row that scores its prompt
     (echo) computes every chunk, scoring each. The rows whose prompt is complete take their first token (one
     sampling call), and decode from the next step on.
A row with hooks (hooks.py: steering, or any function at a hook point) runs its own passes through them: its
prompt's chunks, never taken from or kept in the prefix cache, and after each decoding pass, which it takes
part in as any row, its positions again, alone, overwriting its keys and values and its logits. The other
rows' passes are what they would be without it, to the bit.
"""

from __future__ import annotations

import collections
from collections import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import SmolError
from ..kernels.choosing import rows_bucket
from ..kernels.held import release_freed_memory
from . import steps
from .adapters import Adapters, LoRA
from .hooks import Hooks
from .logprobs import TokenLogprob, chunk_logprobs
from .prefix_cache import Block, PrefixCache
from .sampling import Sampling
from .sequence import Sequence, Step, advance
from .speculative import MAX_PASS_TOKENS, Guesser, check_speculative, new_guesser
from .steps import cache_length, chunks, decode_step, prefill_chunk, release_slots, untouched_cache, verify_step

if TYPE_CHECKING:
    from ..model import SmolLM2


@dataclass
class PromptLogprobs:
    """A row's prompt tokens' log-probabilities (None for the first), once its prefill is complete and before
    its first Step: asked for with prompt_logprobs (echo)."""
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True)
class PassCounts:
    """What an engine's decoding passes did: tokens per pass is decoded / passes, above 1 with speculation; its
    acceptance rate is kept / guessed."""
    passes: int  # decoding passes run
    decoded: int  # the tokens they gave
    guessed: int  # tokens speculating rows guessed
    kept: int  # and those the model kept


@dataclass(eq=False)
class Row:
    """A sequence in the engine, and how far its prompt is in its cache row. Made by admit() from a Sequence, or
    by Request.row() (request.py) from a request, the way generate()/stream() and the server both make theirs."""
    sequence: Sequence
    prompt_logprobs: int | None = None  # None, or score the prompt with this many top tokens
    speculative: str | SmolLM2 | None = None  # None, or guess its next tokens by "ngram" or with a draft model
    hooks: Hooks | None = None  # its passes run through these, alone (see above)
    adapter: LoRA | None = None  # its LoRA adapter (adapters.py), never taken from or kept in the prefix cache
    guesser: Guesser | None = None  # how it speculates (from `speculative`), made as it is queued
    filled: int = 0  # slots of its cache row holding its keys and values
    scored: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # its prompt's, as prefilled
    blocks: list[Block] | None = field(default_factory=list)  # the prefix cache's, for its filled chunks; None:
    # not kept (a block evicted meanwhile)
    cancelled: bool = False

    @property
    def ended(self) -> bool:
        return self.cancelled or self.sequence.finish_reason is not None


class Engine:
    """The rows of one KV cache and the sequences in them, stepped by a driver (see above)."""

    def __init__(self, model, rows: int, length: int, *, prefill_budget: int | None,
                 prefix_cache: PrefixCache | None = None, step: abc.Callable = decode_step, whole_cache: bool = False,
                 kv_cache_dtype: str | None = None, adapters: Adapters | None = None):
        """rows: how many sequences may hold a cache row at once; length: the most slots one takes (its prompt
        and new tokens). prefill_budget: the most prompt tokens prefilled a step (a chunk is never split, so a
        step prefills one at least), or None: every queued prompt at once. prefix_cache: where prompts' chunks
        are looked up and kept, None for nowhere. step: the decoding step, decode_step or a compiled one;
        whole_cache: every decoding step runs over every row and slot of the cache, one shape, as a CUDA graph
        needs. kv_cache_dtype: what the cache stores, "fp32", "bf16" or "int8" (kv_cache.KVCache), None for the
        model's dtype; a draft model's cache (speculative.Draft) stores the same. adapters: the LoRA adapters its
        rows may have (Row.adapter): a pass with such rows runs on their adapted model (adapters.py)."""
        self.model, self.cache_rows, self.kv_cache_dtype, self.adapters = model, rows, kv_cache_dtype, adapters
        self.device = model.model.embed_tokens.weight.device
        self.cache = untouched_cache(model, rows, cache_length(length, model.config.max_position_embeddings),
                                     kv_cache_dtype)
        if whole_cache and self.device.type == "cuda":
            for t in self.cache.parts:  # a CUDA graph may update these in place only if they never move
                torch._dynamo.mark_static_address(t)
        self.prefill_budget, self.prefix_cache = prefill_budget, prefix_cache
        self.step_fn, self.whole_cache = step, whole_cache
        self.decoding: list[Row] = []  # decoding[b] holds cache row b
        self.filling: Row | None = None  # the row whose prompt is being prefilled, in cache row len(decoding)
        self.filling_at = 0  # the cache row it holds (a retired row moves it to len(decoding) again)
        self.planned: list[Row] = []  # the rows of the prefill pass running now, out of the queue (load() counts them)
        self.planned_slots: dict[int, int] = {}  # id(row): the cache slots each planned row holds once the pass ends
        self.queued: collections.deque[Row] = collections.deque()  # admitted, waiting for a cache row
        self.passes = self.decoded = 0  # decoding passes run, and the tokens they gave (more with speculation)
        self.guessed = self.kept = 0  # tokens speculating rows guessed, and those the model kept
        self.prefilled = 0  # prompt tokens the prefill computed (not copied from the prefix cache)

    @property
    def counts(self) -> PassCounts:
        return PassCounts(self.passes, self.decoded, self.guessed, self.kept)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the cache's slots (every row's whole length) that rows hold, from 0 to 1; a row of the
        prefill pass running now holds the slots the pass writes (as vLLM counts a scheduled prompt's blocks). Read
        from another thread too (metrics): it copies what it reads."""
        planned = self.planned_slots  # the pass running now writes these rows' slots: they hold them already
        rows = {id(row): row.filled for row in [*self.decoding, self.filling] if row is not None}
        return sum({**rows, **planned}.values()) / (self.cache_rows * self.cache.max_len)

    @property
    def free(self) -> int:
        """Cache rows that neither a row holds nor a queued row will take."""
        return self.cache_rows - len(self.decoding) - (self.filling is not None) - len(self.queued)

    def admit(self, sequence: Sequence, prompt_logprobs: int | None = None, speculative=None,
              hooks: Hooks | None = None) -> Row:
        """Queue a bare sequence (see queue), its speculation checked as Request.row checks a request's (a
        request's row is queued as it is). speculative: None, or guess its next tokens by prompt lookup ("ngram")
        or with a draft model (a SmolLM2 of the same vocabulary; speculative.py); its tokens are the same. hooks:
        run its passes through these (see above)."""
        check_speculative(speculative, self.model.config.vocab_size)
        return self.queue(Row(sequence, prompt_logprobs, speculative, hooks))

    def queue(self, row: Row) -> Row:
        """Queue a row (a request's: Request.row checked it); it takes a cache row, and its prefill starts, once
        the rows before it have theirs."""
        if row.speculative is not None and self.whole_cache:
            raise SmolError("speculative decoding needs passes of varying length: not with a compiled step")
        sequence = row.sequence
        row.guesser = new_guesser(row.speculative, len(sequence.prompt) + sequence.max_new_tokens,
                                  self.kv_cache_dtype)
        if row.adapter is not None and self.adapters is None:
            raise SmolError("a row with a LoRA adapter needs an engine given adapters")
        if row.hooks is not None or row.adapter is not None:  # never taken from or kept in the prefix cache
            row.blocks = None
        self.queued.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """Drop a row at once, wherever it is: queued, prefilling or decoding."""
        row.cancelled = True
        if row in self.queued:
            self.queued.remove(row)
        elif row is self.filling:
            self.filling = None
            self._release(self.filling_at)
        self._retire()

    def reset(self) -> None:
        """Drop every row (after a step that failed: it may have left them half moved)."""
        self.decoding, self.filling = [], None
        self.queued.clear()
        for at in range(self.cache_rows):
            self._release(at)

    @torch.inference_mode()  # for callers of the engine itself too: with gradients on, no kernel would run
    def step(self) -> list[tuple[Row, Step | PromptLogprobs]]:
        """One step (see the module's docstring); returns what it did to each row, in order: a row's Step (its
        new token), or its PromptLogprobs, which come before its first Step."""
        events = []
        if self.decoding:
            self._decode(events)
        prefilled = self.prefilled
        ready, logits = self._prefill(events)
        if ready:
            self._take(ready, torch.cat(logits), events)
        if self.prefilled > prefilled and self.filling is None and not self.queued:
            # The last prompt is in: its activations' freed pages go back to the OS rather than stay resident beside
            # the KV cache the decoding steps grow (the heap keeps up to 64 MiB of them: held.py); a later prompt
            # faults them in again (~0.4 ms a MiB). ~7 MB of the 360M model's peak over a 128-token prompt.
            release_freed_memory()
        return events

    def _decode(self, events: list) -> None:
        """One pass over the rows decoding: each feeds its last token at its next slot, and a row that
        speculates the tokens it guesses after it; then their positions are taken in order (see above)."""
        rows = self.decoding
        guesses = self._guesses(rows)
        fed = [[row.sequence.tokens[-1], *guess] for row, guess in zip(rows, guesses)]
        slots = [list(range(row.filled, row.filled + len(ids))) for row, ids in zip(rows, fed)]
        width = max(map(len, fed))
        for ids, at in zip(fed, slots):  # a shorter row's padding goes past its own slots, where nothing reads it
            at += [min(at[-1] + j, self.cache.max_len - 1) for j in range(1, width - len(ids) + 1)]
            ids += [0] * (width - len(ids))
        if self.whole_cache:  # the other rows feed a token at the last slot, which no row reads: the cache is
            # sized for the longest prompt and all its new tokens, and the last token is never fed
            fed += [[0]] * (self.cache_rows - len(rows))
            slots += [[self.cache.max_len - 1]] * (self.cache_rows - len(rows))
            cache = self.cache
        else:  # the filled slots only
            cache = self.cache.view(slice(0, len(rows)), max(at[-1] for at in slots) + 1)
        ids, slots = torch.tensor(fed, device=self.device), torch.tensor(slots, device=self.device)
        model = self._model([row.adapter for row in rows] + [None] * (len(ids) - len(rows)))
        if width == 1:
            step = self.step_fn if model is self.model else decode_step  # (a compiled step is the base's)
            logits = step(model, ids, slots, cache, None)[:len(rows), None]  # (n, 1, V)
        else:
            logits = verify_step(model, ids, slots, cache)  # (n, width, V)
        for b, row in enumerate(rows):
            if row.hooks is not None:
                alone = self._model([row.adapter])
                logits[b] = alone.logits(row.hooks.hidden_states(alone, ids[b:b + 1], slots[b:b + 1],
                                                                 cache.view(slice(b, b + 1))))[0]
        self.passes += 1
        before = [row.filled for row in rows]
        going = range(len(rows))  # the rows whose position i is taken
        for i in range(width):
            taken = advance(logits[:, i] if i == 0 else logits[going, i], [rows[b].sequence for b in going])
            self.decoded += len(taken)
            events += [(rows[b], step) for b, step in zip(going, taken)]
            for b in going:
                rows[b].filled += 1
            going = [b for b, step in zip(going, taken)
                     if i < len(guesses[b]) and step.token == guesses[b][i] and not step.finish_reason]
        for row, guess, filled in zip(rows, guesses, before):
            if guess:  # kept: the guesses the row's slots now hold, past the last token it fed
                kept = row.filled - filled - 1
                row.guesser.record(len(guess), kept)
                self.guessed, self.kept = self.guessed + len(guess), self.kept + kept
        self._retire()

    def _guesses(self, rows: list[Row]) -> list[list[int]]:
        """Each row's guesses for this pass ([] for a row that does not speculate): within what its answer may
        still take, and the pass within MAX_PASS_TOKENS positions over all rows."""
        room = MAX_PASS_TOKENS // len(rows) - 1
        return [row.guesser.guess(row.sequence.prompt, row.sequence.tokens,
                                  min(room, row.sequence.max_new_tokens - len(row.sequence.tokens) - 1))
                if row.guesser is not None else [] for row in rows]

    def _prefill(self, events: list) -> tuple[list[Row], list[torch.Tensor]]:
        """Prefill the queued prompts until the step's budget is spent: the chunks one prompt after another would
        take (_plan), computed in waves (_fill). Returns the rows whose prompt is complete, which join the rows
        decoding, and their next-token logits, (1, V) each (a row's logits do not depend on the rows beside it)."""
        spent, ready, logits = 0, [], []
        try:
            while plan := self._plan(spent):
                self.planned = [row for row, _, _ in plan]
                self.planned_slots = {id(row): taken[-1][1] if taken else row.filled for row, _, taken in plan}
                spent += sum(end - begin for _, _, chunks in plan for begin, end in chunks)
                for (row, at, _), h in zip(plan, self._fill(plan)):
                    if row.filled < len(row.sequence.prompt):  # the budget is spent: the rest is the next step's
                        self.filling, self.filling_at = row, at
                        continue
                    if row.prompt_logprobs is not None:
                        events.append((row, PromptLogprobs(row.scored)))
                    if row.sequence.finish_reason:  # max_new_tokens 0: the prompt scored, nothing to generate
                        continue
                    self.decoding.append(row)
                    ready.append(row)
                    logits.append(self.model.logits(h[:, -1]))
                if self.filling is not None:
                    break
        finally:
            self.planned, self.planned_slots = [], {}
        return ready, logits

    def _plan(self, spent: int) -> list[tuple[Row, int, list[tuple[int, int]]]]:
        """The rows to prefill next, each with its cache row and the chunks it computes, as one prompt after another
        would take them: each chunk ends at a multiple of PREFILL_CHUNK (steps.chunks), and is never split, within
        the budget; rows decoding stay 0..n-1 and these take n, n+1, .. (each complete but maybe the last). It ends
        before a prompt that would find in the prefix cache a chunk one of these computes, and after a row that
        will not decode (its cache row is the next one's)."""
        plan, budget = [], self.prefill_budget
        while len(self.decoding) + len(plan) < self.cache_rows and (budget is None or spent < budget):
            if self.filling is not None:
                row, at, self.filling = self.filling, self.filling_at, None
            elif not self.queued or self._finds_planned(plan):
                break
            else:
                row = self._start(at := len(self.decoding) + len(plan))
            taken = []
            for begin, end in chunks(row.filled, len(row.sequence.prompt)):
                if spent and budget is not None and spent + end - begin > budget:
                    break  # a chunk is never split: it is the next step's
                taken.append((begin, end))
                spent += end - begin
            plan.append((row, at, taken))
            if (taken[-1][1] if taken else row.filled) < len(row.sequence.prompt) or row.sequence.finish_reason:
                break
        return plan

    def _finds_planned(self, plan: list) -> bool:
        """Whether the next queued prompt would find in the prefix cache a chunk a planned row computes: it then
        waits until they are kept, and copies it."""
        row = self.queued[0]
        if self.prefix_cache is None or row.prompt_logprobs is not None or row.hooks is not None \
                or row.adapter is not None:
            return False
        prompt = row.sequence.prompt
        first = min(steps.PREFILL_CHUNK, len(prompt))
        return any(other.sequence.prompt[:first] == prompt[:first] for other, _, _ in plan)

    def _fill(self, plan: list) -> list[torch.Tensor | None]:
        """The planned chunks, in waves: each row's i-th in the i-th, where the rows' chunks of one kind share
        passes (steps.prefill_rows: each row's bits are those it gets alone), and the others' run alone. Returns
        each row's last hidden state, (1, 1, C), where its prompt is complete (its cached one where an equal
        prompt was prefilled before and it computed nothing)."""
        last = [row.blocks[-1].h if not taken and row.filled == len(row.sequence.prompt) else None
                for row, _, taken in plan]
        for wave in range(max(len(taken) for _, _, taken in plan)):
            kinds: dict[int, list] = {}  # packed chunks by kind, in plan order
            for i, (row, at, taken) in enumerate(plan):
                if wave >= len(taken):
                    continue
                begin, end = taken[wave]
                if row.hooks is None and row.prompt_logprobs is None and row.adapter is None \
                        and steps.packs(self.model, end - begin):
                    kinds.setdefault(rows_bucket(end - begin), []).append(i)
                else:
                    last[i] = self._prefill_chunk(row, at, begin, end)
            for rows in kinds.values():
                for group in (rows[j:j + steps.PACKED_ROWS] for j in range(0, len(rows), steps.PACKED_ROWS)):
                    self._prefill_chunks([(plan[i][0], plan[i][1], *plan[i][2][wave]) for i in group], last, group)
        return last

    def _prefill_chunks(self, work: list[tuple[Row, int, int, int]], last: list, at: list[int]) -> None:
        """Chunks of several rows, (row, cache row, begin, end), in one pass (one alone: prefill_chunk's); each
        row's last hidden state into last[at[i]]."""
        if len(work) == 1:
            last[at[0]] = self._prefill_chunk(*work[0])
            return
        h = steps.prefill_rows(self.model, [steps.Chunk(cache_row, begin, row.sequence.prompt[begin:end])
                                            for row, cache_row, begin, end in work], self.cache)
        for i, (row, cache_row, begin, end) in enumerate(work):
            last[at[i]] = self._keep(row, cache_row, begin, end, h[:, i:i + 1].clone())  # kept apart (prefix cache)

    def _start(self, at: int) -> Row:
        """The next queued row, to prefill in cache row `at`, its cached prefix copied in. A row that scores its
        prompt computes every chunk: it needs every position's hidden state."""
        row = self.queued.popleft()
        if self.prefix_cache is not None and row.prompt_logprobs is None and row.hooks is None \
                and row.adapter is None:
            row.blocks = self.prefix_cache.lookup(row.sequence.prompt)
            for block in row.blocks:
                begin, end = row.filled, row.filled + block.length
                for t, part in zip(self.cache.parts, block.parts):
                    t[:, at, :, begin:end] = part
                row.filled = end
        return row

    def _prefill_chunk(self, row: Row, at: int, begin: int, end: int) -> torch.Tensor:
        """One chunk of a row's prompt into its cache row `at`, alone; returns the last position's hidden state,
        (1, 1, C), as any prefill computes it."""
        prompt = row.sequence.prompt
        cache = self.cache.view(slice(at, at + 1))
        ids, model = torch.tensor([prompt[begin:end]], device=self.device), self._model([row.adapter])
        if row.prompt_logprobs is not None:  # echo: every position's state, each chunk scored
            h = prefill_chunk(model, ids, cache, begin, last_only=False, hooks=row.hooks)
            row.scored += chunk_logprobs(model, prompt, begin, h[0], row.prompt_logprobs)
        if row.prompt_logprobs is None or end == len(prompt):  # (echo: its keys and values written again, equal)
            h = prefill_chunk(model, ids, cache, begin, hooks=row.hooks)
        return self._keep(row, at, begin, end, h)

    def _keep(self, row: Row, at: int, begin: int, end: int, h: torch.Tensor) -> torch.Tensor:
        """A chunk computed into cache row `at`: counted, and kept in the prefix cache if it is whole or ends the
        prompt; returns h, its last position's hidden state."""
        prompt = row.sequence.prompt
        ends = end == len(prompt)
        row.filled = end
        self.prefilled += end - begin
        if self.prefix_cache is not None and row.blocks is not None and (ends or end % steps.PREFILL_CHUNK == 0):
            block = self.prefix_cache.store(row.blocks, prompt[begin:end],
                                            [t[:, at, :, begin:end] for t in self.cache.parts], h if ends else None)
            row.blocks = None if block is None else [*row.blocks, block]
        return h

    def _model(self, adapters: list[LoRA | None]):
        """The model a pass of rows with these adapters (None: the base) runs on: the base itself where none has
        one, else the adapted copy, this pass's rows' adapters selected (adapters.py)."""
        return self.model if self.adapters is None else self.adapters.model_for(adapters)

    def _take(self, rows: list[Row], logits: torch.Tensor, events: list) -> None:
        """Every row's next token from its row of logits, in one sampling call; then the finished rows go."""
        taken = advance(logits, [row.sequence for row in rows])
        events += [(row, step) for row, step in zip(rows, taken) if step is not None]
        self._retire()

    def _retire(self) -> None:
        """Drop the rows that have ended, moving the last row decoding into each row freed; the memory of the
        slots no row holds any more goes back to the OS."""
        rows, b, touched = self.decoding, 0, set()
        while b < len(rows):
            if not rows[b].ended:
                b += 1
                continue
            last = rows.pop()
            touched |= {b, len(rows)}
            if b < len(rows):  # the last row takes row b; one that has ended too is dropped next
                if not last.ended:
                    self._move(len(rows), b, last.filled)
                rows[b] = last
        if self.filling is not None and self.filling_at != len(rows):  # the prefilling row stays right after
            self._move(self.filling_at, len(rows), self.filling.filled)
            touched |= {self.filling_at, len(rows)}
            self.filling_at = len(rows)
        for at in touched:
            self._release(at)

    def _release(self, at: int) -> None:
        """Cache row `at`'s slots past those its row holds (all of them if none holds it): back to the OS."""
        holder = self.decoding[at] if at < len(self.decoding) else (
            self.filling if self.filling is not None and at == self.filling_at else None)
        release_slots(self.cache, at, holder.filled if holder is not None else 0)

    def _move(self, source: int, target: int, filled: int) -> None:
        # Only the filled slots; what the target row holds past them is hidden by the causal mask.
        for t in self.cache.parts:  # (L, B, n_kv, S, ...)
            t[:, target, :, :filled] = t[:, source, :, :filled]


def prompt_logprobs(model, ids: abc.Sequence[int], top: int = 0) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first, which nothing
    predicts), computed as the server computes it: by the engine's prefill, chunk by chunk, each chunk scored."""
    ids = list(ids)
    if not ids:
        raise SmolError("the prompt is empty")
    with torch.inference_mode():
        scoring = Engine(model, 1, len(ids), prefill_budget=None)
        scoring.admit(Sequence(ids, 0, Sampling(), eos=()), prompt_logprobs=top)
        ((_, scored),) = scoring.step()
    return scored.logprobs
