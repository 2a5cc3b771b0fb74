"""Continuous batching: one thread owns the model and advances every request in flight together.

The KV cache has `max_batch_size` rows, the slots; a request in flight holds one row, its sequence at
positions 0.. of that row. The n requests in flight always hold rows 0..n-1, so that a decoding step runs on
those n rows alone: a lone request costs a batch of one, not a batch of every slot.
Each step the thread
  1. retires the finished and cancelled requests (their client went away); the last request moves into
     each freed row, its cache rows copied, so the rows in use stay 0..n-1;
  2. admits waiting requests into the free rows, prefilling each prompt alone into its own row;
  3. runs ONE decoding step for rows 0..n-1 at once, every row at its own position;
  4. samples each request's token with its own Sampler; a finished request is retired at the next step.
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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import SmolError
from ..generation.engine import cache_length, decode_step, prefill, prompt_rows
from ..generation.sampling import Sampler, Sampling

log = logging.getLogger(__name__)

CACHE_BLOCK = 128  # attention reads the cache up to the next multiple of this past the longest sequence


@dataclass
class Delta:
    """New text for the client (possibly empty while a stop string might be forming)."""
    text: str


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


class StopStrings:
    """Finds the first stop string in a text that grows at its end. Each new character is looked at once per
    stop string (Knuth-Morris-Pratt), however long the strings: rescanning the text, or trying every prefix of
    a string, at each token would cost the scheduler's thread, so every client, time quadratic in their lengths."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.borders = [borders(s) for s in self.stop]
        self.matched = [0] * len(self.stop)  # per string: the longest end of the text that begins it
        self.seen = 0  # characters of the text fed so far

    def feed(self, new: str) -> int:
        """Take the text's next characters; returns where the first stop string now complete starts, or -1."""
        cut = -1
        for j, (stop, border) in enumerate(zip(self.stop, self.borders)):
            k = self.matched[j]
            for i, c in enumerate(new):
                while k and stop[k] != c:
                    k = border[k - 1]
                k += stop[k] == c
                if k == len(stop):
                    start = self.seen + i + 1 - k
                    cut = start if cut < 0 else min(cut, start)
                    break
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


class Request:
    """One generation: its prompt and limits, its sampler and text, and the queue its events go to."""

    def __init__(self, prompt: list[int], max_tokens: int, sampling: Sampling, stop: Sequence[str],
                 tokenizer, device, loop: asyncio.AbstractEventLoop):
        self.prompt, self.max_tokens, self.stop = prompt, max_tokens, StopStrings(stop)
        self.sampler = Sampler(sampling, 1, device)  # batch of one: the request's seed alone decides its draws
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.tokens: list[int] = []  # generated so far, EOS included
        self.text = ""  # the answer so far
        self.sent = 0  # characters of text already sent
        self.cancelled = False  # set from the HTTP side; the scheduler retires the request at its next step
        self.done = False  # its last event is sent; the scheduler retires it at its next step
        self._loop, self._events = loop, asyncio.Queue()

    async def events(self) -> AsyncIterator[Delta | Done]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Done):
                return

    def emit(self, event: Delta | Done) -> None:  # scheduler thread
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Scheduler:
    def __init__(self, model, tokenizer, max_batch_size: int = 8, max_waiting: int = 64,
                 max_seq_len: int | None = None):
        context = model.config.max_position_embeddings
        if max_batch_size < 1 or max_waiting < 0 or (max_seq_len is not None and max_seq_len < 2):
            raise SmolError(f"need max_batch_size >= 1, max_waiting >= 0 and max_seq_len >= 2, got "
                            f"{max_batch_size}, {max_waiting} and {max_seq_len}")
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len or context, context)
        self.max_waiting = max_waiting
        self.eos = set(model.config.eos_token_ids)
        self.device = model.model.embed_tokens.weight.device
        self.max_batch_size = max_batch_size
        self.cache = model.new_cache(max_batch_size, self.max_seq_len)
        self.active: list[Request] = []  # the requests in flight; active[b] holds cache row b
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

    def submit(self, prompt: list[int], max_tokens: int, sampling: Sampling, stop: Sequence[str] = ()) -> Request:
        """Queue a request; raises SmolError if it cannot fit, QueueFull if too many are waiting."""
        (prompt,) = prompt_rows([prompt], self.model.config.vocab_size)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise SmolError(f"max_tokens must be a whole number >= 1, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.max_seq_len:
            raise SmolError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                            f"context window of {self.max_seq_len} tokens")
        if not all(isinstance(s, str) and s for s in stop):
            raise SmolError("every stop string must be a non-empty string")
        request = Request(prompt, max_tokens, sampling, stop, self.tokenizer, self.device, asyncio.get_running_loop())
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
        active = list(self.active)  # a copy: the scheduler thread reorders the list meanwhile
        return dict(active=sum(not r.done for r in active), waiting=len(self.waiting), slots=self.max_batch_size)

    # The scheduler thread.

    @torch.inference_mode()
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self.active:
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
        while len(self.active) < self.max_batch_size and (request := self._next_waiting()) is not None:
            self._prefill(request)
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
            last = rows.pop()
            if b < len(rows) and not (last.done or last.cancelled):
                # Copy the filled slots only; what row b holds past them is hidden by the causal mask.
                filled = len(last.prompt) + len(last.tokens) - 1  # every token but the last sampled
                for t in (self.cache.k, self.cache.v):  # (L, B, n_kv, S, hd)
                    t[:, b, :, :filled] = t[:, len(rows), :, :filled]
                rows[b] = last

    def _next_waiting(self) -> Request | None:
        with self._wake:
            while self.waiting:
                request = self.waiting.popleft()
                if not request.cancelled:
                    return request
        return None

    def _length(self, n: int) -> int:
        return cache_length(n, self.max_seq_len, CACHE_BLOCK)

    def _prefill(self, request: Request) -> None:
        """Run the prompt alone through the next free cache row, in chunks as the engine does, and take its
        first token."""
        row = len(self.active)
        self.active.append(request)  # first: should the prefill fail, the request is failed with the others
        T = len(request.prompt)
        cache = self.cache.view(slice(row, row + 1), self._length(T))
        h = prefill(self.model, torch.tensor([request.prompt], device=self.device), cache)
        self._accept(request, request.sampler(self.model.logits(h))[0].item())

    def _decode(self) -> None:
        """One token for every request in flight at once, rows 0..n-1, each row at its own position."""
        active = self.active
        ids = torch.tensor([[r.tokens[-1]] for r in active], device=self.device)
        pos = torch.tensor([[len(r.prompt) + len(r.tokens) - 1] for r in active], device=self.device)
        # No padding mask is needed: every row starts at slot 0, and the causal mask over slots
        # (slot <= input_pos) already hides what a previous, longer request left past a row's position.
        cache = self.cache.view(slice(0, len(active)), self._length(int(pos.max()) + 1))
        logits = decode_step(self.model, ids, pos, cache, None)  # (n, V)
        tokens = torch.cat([r.sampler(logits[b:b + 1]) for b, r in enumerate(active)]).tolist()
        for r, token in zip(active, tokens):
            self._accept(r, token)

    def _accept(self, request: Request, token: int) -> None:
        """Record a new token; send the text that is final; retire the request when it is done."""
        request.tokens.append(token)
        if token in self.eos:
            return self._finish(request, "stop")
        new = request.decoder.step(token)
        request.text += new
        cut = request.stop.feed(new)
        if cut >= 0:
            request.text = request.text[:cut]
            return self._finish(request, "stop", flush=False)
        if len(request.tokens) == request.max_tokens:
            return self._finish(request, "length")
        # Hold back an end of the text that may yet grow into a stop string: the client must never see one.
        end = len(request.text) - request.stop.held
        if end > request.sent:
            request.emit(Delta(request.text[request.sent:end]))
            request.sent = end

    def _finish(self, request: Request, reason: str, flush: bool = True) -> None:
        if flush:  # a character still incomplete at the end comes out as decode() shows it
            request.text += request.decoder.finish()
        if len(request.text) > request.sent:
            request.emit(Delta(request.text[request.sent:]))
        request.done = True  # first: /health must not count it once its client has the answer
        request.emit(Done(reason, len(request.prompt), len(request.tokens)))

    def _take_active(self) -> list[Request]:
        active, self.active = self.active, []
        return [r for r in active if not r.done]

    @staticmethod
    def _end(requests: list[Request], error: str) -> None:
        for request in requests:
            request.emit(Done(None, len(request.prompt), len(request.tokens), error))
