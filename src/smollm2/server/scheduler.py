"""Continuous batching: one thread owns the model and advances every request in flight together.

The KV cache has `max_batch_size` rows, the slots; a request in flight holds one row, its sequence at
positions 0.. of that row. The n requests decoding always hold rows 0..n-1, so that a decoding step runs on
those n rows alone: a lone request costs a batch of one, not a batch of every slot. A request whose prompt is
being prefilled holds row n, the next.
Each step the thread
  1. retires the finished and cancelled requests (their client went away); the last request moves into
     each freed row, its cache rows copied, so the rows in use stay 0..n-1 (and the prefilling one n);
  2. prefills prompts into the free rows, at most one prefill chunk of tokens (steps.PREFILL_CHUNK) in all: the
     next chunk of a long prompt, or several short prompts. A long prompt thus takes several steps, and the
     requests already decoding get a token at each one instead of waiting for its whole prefill. Chunks already
     in the prefix cache (same tokens, same place) are copied instead of computed, and those computed are kept;
  3. runs ONE decoding step for rows 0..n-1 at once, every row at its own position;
  4. picks every row's token in one sampling call, each row with its own parameters and random generator,
     and hands each to its request's Sequence, which says what text is final and whether it has finished;
     a finished request is retired at the next step.
A finished request frees its row at once, so a waiting one joins at the next step instead of waiting for
the whole batch to end, as it would with static batching.

The HTTP side runs an asyncio loop in another thread: requests are handed over through a locked deque,
and each request's events come back through its own asyncio.Queue, fed with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections import abc
from dataclasses import dataclass, field

import torch

from ..errors import SmolError
from ..generation.grammar import Grammar
from ..generation.logprobs import TokenLogprob, check_top, chunk_logprobs
from ..generation.sampling import Sampling
from ..generation.sequence import Sequence, Step, advance, check_request
from ..generation.prefix_cache import Block, PrefixCache
from ..generation import steps
from ..generation.steps import cache_length, chunks, decode_step, prefill_chunk, untouched_cache

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """Text for the client, final: never part of a stop string; with the log-probabilities of the tokens
    generated since the last Delta, when the request asked for them."""
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """The prompt's tokens' log-probabilities (None for the first), before any Delta: asked by echo."""
    logprobs: list[TokenLogprob | None]


@dataclass
class Done:
    """The last event of a request. finish_reason: "stop" (EOS or a stop string) or "length";
    None with `error` set when the server ended the request (shutting down, or an internal error)."""
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class QueueFull(Exception):
    """More requests are already waiting than the scheduler accepts."""


class Request:
    """One generation: its Sequence (prompt, sampling, tokens, text, finish), and the queue its events go to."""

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop, prompt_logprobs: int | None = None,
                 on_end: abc.Callable[[Request], None] | None = None):
        self.sequence, self.on_end = sequence, on_end  # on_end(request): told as it ends, however it ends
        self.submitted, self.token_times = time.perf_counter(), []  # when it came, and when each token did
        self.prompt_logprobs = prompt_logprobs  # None, or score the prompt with this many top tokens
        self.cancelled = False  # set from the HTTP side; the scheduler retires the request at its next step
        self.filled = 0  # prompt tokens in its cache row so far
        self.scored: list[TokenLogprob | None] = [None]  # echo: its prompt's log-probabilities so far
        self.blocks: list[Block] | None = []  # the prefix cache's blocks for its filled chunks; None: not kept
        self.done = False  # its last event is sent; the scheduler retires it at its next step
        self._loop, self._events = loop, asyncio.Queue()

    async def events(self) -> abc.AsyncIterator[PromptLogprobs | Delta | Done]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Done):
                return

    def _emit(self, event: PromptLogprobs | Delta | Done) -> None:  # scheduler thread
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def send(self, step: Step) -> None:  # scheduler thread
        """Send the text its sequence's new token made final, and the end once it has finished."""
        if step.text or step.logprob:
            self._emit(Delta(step.text, [step.logprob] if step.logprob else []))
        if step.finish_reason:
            self.finish()

    def send_prompt(self, logprobs: list[TokenLogprob | None]) -> None:  # scheduler thread
        self._emit(PromptLogprobs(logprobs))

    def finish(self) -> None:
        self.done = True  # first: /health must not count it once its client has the answer
        self._last(Done(self.sequence.finish_reason, len(self.sequence.prompt), len(self.sequence.tokens)))

    def fail(self, error: str) -> None:
        self._last(Done(None, len(self.sequence.prompt), len(self.sequence.tokens), error))

    def _last(self, done: Done) -> None:
        if self.on_end is not None:
            self.on_end(self)  # before its client can hear of the end: /metrics has counted it by then
        self._emit(done)


class Scheduler:
    def __init__(self, model, tokenizer, max_batch_size: int = 8, max_waiting: int = 64,
                 max_seq_len: int | None = None, on_end: abc.Callable[[Request], None] | None = None,
                 prefix_cache_bytes: int = 0):
        """on_end(request) is told of every request that ends, finished, cancelled or failed (metrics).
        prefix_cache_bytes: the prefix cache's budget for keys and values; 0 keeps no prefix."""
        context = model.config.max_position_embeddings
        if max_batch_size < 1 or max_waiting < 0 or (max_seq_len is not None and max_seq_len < 2) \
                or prefix_cache_bytes < 0:
            raise SmolError(f"need max_batch_size >= 1, max_waiting >= 0, max_seq_len >= 2 and prefix_cache_bytes "
                            f">= 0, got {max_batch_size}, {max_waiting}, {max_seq_len} and {prefix_cache_bytes}")
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len or context, context)
        self.max_waiting = max_waiting
        self.device = model.model.embed_tokens.weight.device
        self.max_batch_size = max_batch_size
        self.on_end = on_end
        self.cache = untouched_cache(model, max_batch_size, self.max_seq_len)
        self.active: list[Request] = []  # the requests decoding; active[b] holds cache row b
        self.filling: Request | None = None  # the request whose prompt is being prefilled, in row len(active)
        self.filling_row = 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()  # guards waiting and _stopping
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="smollm2-scheduler", daemon=True)

    # The HTTP side (the event loop's thread).

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End every request (their streams get a final Done with an error) and join the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(self, prompt: list[int], max_tokens: int, sampling: Sampling,
               stop: abc.Sequence[str] = (), logprobs: int | None = None,
               prompt_logprobs: int | None = None, grammar: Grammar | None = None) -> Request:
        """Queue a request; raises SmolError if it cannot fit, QueueFull if too many are waiting.
        logprobs: None, or each generated token's log-probability and its position's top `logprobs`;
        prompt_logprobs: None, or the same for the prompt's tokens, sent first (a PromptLogprobs event);
        grammar: None, or what the answer must fit (response_format)."""
        config = self.model.config
        (prompt,) = check_request([prompt], max_tokens, stop, config.vocab_size, self.max_seq_len)
        sequence = Sequence(prompt, max_tokens, sampling, config.eos_token_ids, stop, self.tokenizer, self.device,
                            logprobs, grammar)
        request = Request(sequence, asyncio.get_running_loop(), check_top(prompt_logprobs, "prompt_logprobs"),
                          self.on_end)
        if sequence.finish_reason and prompt_logprobs is None:  # max_tokens 0: nothing to generate
            request.finish()
            return request
        with self._wake:
            if self._stopping:
                raise SmolError("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting; try again later")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop generating for this request (no-op once it is done); its slot frees at the next step."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    def load(self) -> dict:
        active = [*self.active, self.filling]  # a copy: the scheduler thread reorders the list meanwhile
        return dict(active=sum(r is not None and not r.done for r in active), waiting=len(self.waiting),
                    slots=self.max_batch_size)

    # The scheduler thread.

    @torch.inference_mode()
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self.active and not self.filling:
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._step()
            except Exception as e:  # a bug or out of memory: fail the requests in flight, keep serving
                log.exception("scheduler step failed")
                self._end(self._take_active(), f"internal error: {e}")
        with self._wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
        self._end([*waiting, *self._take_active()], "the server is shutting down")

    def _step(self) -> None:
        self._retire()
        self._admit()
        self._retire()  # a request may end at its first token
        if self.active:
            self._decode()

    def _retire(self) -> None:
        """Drop the finished and cancelled requests, moving the last request into each row freed."""
        rows, b = self.active, 0
        while b < len(rows):
            if not (rows[b].done or rows[b].cancelled):
                b += 1
                continue
            if not rows[b].done:  # cancelled (a finished request was counted as it finished)
                self._cancelled(rows[b])
            last = rows.pop()
            if b < len(rows):  # the last request takes row b; one that has ended too is retired next
                if not (last.done or last.cancelled):
                    filled = len(last.sequence.prompt) + len(last.sequence.tokens) - 1  # all but the last sampled
                    self._move_row(len(rows), b, filled)
                rows[b] = last
        if self.filling is not None and self.filling.cancelled:
            self._cancelled(self.filling)
            self.filling = None
        if self.filling is not None and self.filling_row != len(rows):  # the prefilling row stays right after
            self._move_row(self.filling_row, len(rows), self.filling.filled)
            self.filling_row = len(rows)

    def _move_row(self, source: int, target: int, filled: int) -> None:
        # Only the filled slots; what the target row holds past them is hidden by the causal mask.
        for t in (self.cache.k, self.cache.v):  # (L, B, n_kv, S, hd)
            t[:, target, :, :filled] = t[:, source, :, :filled]

    def _next_waiting(self) -> Request | None:
        with self._wake:
            while self.waiting:
                request = self.waiting.popleft()
                if not request.cancelled:
                    return request
                self._cancelled(request)
        return None

    def _length(self, n: int) -> int:
        return cache_length(n, self.max_seq_len)

    def _admit(self) -> None:
        """Prefill prompts into the free rows, one chunk after another, until a chunk's worth of tokens is done;
        a request whose prompt is complete takes its first token and joins the decoding rows."""
        done, ready, logits = 0, [], []
        while len(self.active) < self.max_batch_size and done < steps.PREFILL_CHUNK \
                and (request := self.filling or self._start()) is not None:
            prompt, row, scoring = request.sequence.prompt, self.filling_row, request.prompt_logprobs is not None
            if request.filled == len(prompt):  # an equal prompt was prefilled before: its last state is cached
                h = request.blocks[-1].h
            else:
                begin, end = next(chunks(request.filled, len(prompt)))
                if done and done + end - begin > steps.PREFILL_CHUNK:  # a chunk is never split: next step
                    break
                h = self._prefill(request, row, begin, end)
                request.filled, done = end, done + end - begin
                if end < len(prompt):
                    continue
            self.filling = None
            if scoring:
                request.send_prompt(request.scored)
                if request.sequence.finish_reason:  # max_tokens 0: the prompt scored, nothing to generate
                    request.finish()
                    continue
            self.active.append(request)
            self.filling_row = len(self.active)
            ready.append(request)
            logits.append(self.model.logits(h[:, -1]))
        if ready:
            self._take(ready, torch.cat(logits))

    def _prefill(self, request: Request, row: int, begin: int, end: int) -> torch.Tensor:
        """One chunk of a request's prompt into its row, kept in the prefix cache if it is whole or ends the
        prompt; returns the last position's hidden state, (1, 1, C), as the prefill of any request computes it."""
        prompt = request.sequence.prompt
        cache = self.cache.view(slice(row, row + 1), self._length(len(prompt)))
        ids = torch.tensor([prompt[begin:end]], device=self.device)
        if request.prompt_logprobs is not None:  # echo: every position's state, scored as prompt_logprobs does
            h = prefill_chunk(self.model, ids, cache, begin, last_only=False)
            request.scored += chunk_logprobs(self.model, prompt, begin, h[0], request.prompt_logprobs)
        if request.prompt_logprobs is None or end == len(prompt):  # (echo: its keys and values written again, equal)
            h = prefill_chunk(self.model, ids, cache, begin)
        ends = end == len(prompt)
        if self.prefix_cache is not None and request.blocks is not None and (ends or end % steps.PREFILL_CHUNK == 0):
            block = self.prefix_cache.store(request.blocks, prompt[begin:end], self.cache.k[:, row, :, begin:end],
                                            self.cache.v[:, row, :, begin:end], h if ends else None)
            request.blocks = None if block is None else [*request.blocks, block]
        return h

    def _start(self) -> Request | None:
        """The next waiting request to prefill, in row len(active), its cached prefix copied in; None if none.
        A request that scores its prompt (echo) computes every chunk: it needs every position's hidden state."""
        request = self._next_waiting()
        if request is None:
            return None
        row = self.filling_row = len(self.active)
        self.filling = request  # first: should the prefill fail, the request is failed with the others
        if self.prefix_cache is not None and request.prompt_logprobs is None:
            request.blocks = self.prefix_cache.lookup(request.sequence.prompt)
            for block in request.blocks:
                begin, end = request.filled, request.filled + block.k.shape[-2]
                self.cache.k[:, row, :, begin:end] = block.k
                self.cache.v[:, row, :, begin:end] = block.v
                request.filled = end
        return request

    def _decode(self) -> None:
        """One token for every request in flight at once, rows 0..n-1, each row at its own position."""
        sequences = [r.sequence for r in self.active]
        ids = torch.tensor([[s.tokens[-1]] for s in sequences], device=self.device)
        pos = torch.tensor([[len(s.prompt) + len(s.tokens) - 1] for s in sequences], device=self.device)
        # No padding mask is needed: every row starts at slot 0, and the causal mask over slots
        # (slot <= input_pos) already hides what a previous, longer request left past a row's position.
        cache = self.cache.view(slice(0, len(sequences)), self._length(int(pos.max()) + 1))
        self._take(self.active, decode_step(self.model, ids, pos, cache, None))

    def _take(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Every request's next token from its row of logits, in one sampling call; each request then sends
        the text that became final, and its end once it has finished."""
        _, steps = advance(logits, [r.sequence for r in requests])
        now = time.perf_counter()
        for request, step in zip(requests, steps):
            if step is None:
                continue
            request.token_times.append(now)
            request.send(step)

    def _take_active(self) -> list[Request]:
        """Every request holding a row, which then holds none."""
        active, self.active = self.active + ([self.filling] if self.filling else []), []
        self.filling, self.filling_row = None, 0
        return [r for r in active if not r.done]

    def _end(self, requests: list[Request], error: str) -> None:
        for request in requests:
            request.fail(error)

    @staticmethod
    def _cancelled(request: Request) -> None:
        # Its last event, which nobody may hear: whoever still waits on it (an answer not streamed) stops waiting.
        request.fail("cancelled: the client went away")
