"""The engine's thread: one thread owns the model and its engine (generation.engine, where the scheduling is), and
steps it for as long as a request is in flight; requests join and leave the engine's rows between steps.

The engine's KV cache has `max_batch_size` rows; a request in flight holds one. Each step the thread
  1. drops the requests cancelled since (their client went away) from the engine;
  2. admits waiting requests while the engine has rows for them;
  3. steps the engine: one decoding step for the requests decoding, the next prefill chunk(s), at most
     PREFILL_CHUNK tokens a step, between them (a long prompt does not stall the others' streams), the prefix
     cache; and sends each request what the step did to it: its prompt's log-probabilities, its final text.
A finished request frees its row at once, so a waiting one joins at the next step instead of waiting for
the whole batch to end, as it would with static batching.

The HTTP side runs an asyncio loop in another thread: requests (generation.request.Request, made into engine rows
there, where an error is the client's 400) are handed over through a locked deque, and each one's events come back
through its own asyncio.Queue, fed with loop.call_soon_threadsafe. Other
work on the model (embeddings) is handed over the same way, as a function the thread calls between two steps,
its result coming back in an asyncio future.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import FieldError, SmolError
from ..generation import steps
from ..generation.adapters import Adapters
from ..generation.engine import Engine, PromptLogprobs, Row
from ..generation.logprobs import TokenLogprob
from ..generation.prefix_cache import DiskCache, PrefixCache
from ..generation.request import Request
from ..generation.sequence import Step
from ..generation.speculative import check_speculative
from ..generation.steps import decode_step, prefill_chunk, untouched_cache
from . import defaults

log = logging.getLogger(__name__)

WARM_UP_PROMPT = 8  # tokens of the warm-up's prompt (ids 0..7)


@dataclass
class Delta:
    """Text for the client, final: never part of a stop string; with the log-probabilities of the tokens
    generated since the last Delta, when the request asked for them."""
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Done:
    """The last event of a request. finish_reason: "stop" (EOS or a stop string, then stop_string) or "length";
    None with `error` set when the server ended the request (shutting down, or an internal error)."""
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    stop_string: str | None = None


class QueueFull(Exception):
    """More requests are already waiting than the engine thread accepts."""


class Generation:
    """One request being answered: its engine row (its Sequence: prompt, sampling, tokens, text, finish), and the
    queue its events go to."""

    def __init__(self, row: Row, loop: asyncio.AbstractEventLoop,
                 on_end: abc.Callable[[Generation], None] | None = None):
        self.row, self.sequence, self.on_end = row, row.sequence, on_end  # on_end(generation): told as it ends
        self.submitted, self.token_times = time.perf_counter(), []  # when it came, and when each token did
        self.cancelled = False  # set from the HTTP side; the thread drops the request at its next step
        self.done = False  # its last event is sent
        self._loop, self._events = loop, asyncio.Queue()

    async def events(self) -> abc.AsyncIterator[PromptLogprobs | Delta | Done]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Done):
                return

    def _emit(self, event: PromptLogprobs | Delta | Done) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def send(self, event: Step | PromptLogprobs) -> None:  # engine thread
        """Send what a step did: the prompt's log-probabilities, or the text its sequence's new token made final;
        and the end once the sequence has finished."""
        if isinstance(event, PromptLogprobs):
            self._emit(event)
            if self.sequence.max_new_tokens == 0:  # the prompt scored, nothing to generate
                self.finish()
            return  # its first Step, of the same engine step, follows
        if event.text or event.logprob:
            self._emit(Delta(event.text, [event.logprob] if event.logprob else []))
        if event.finish_reason:
            self.finish()

    def finish(self) -> None:
        self.done = True  # first: /health must not count it once its client has the answer
        sequence = self.sequence
        self._last(Done(sequence.finish_reason, len(sequence.prompt), len(sequence.tokens),
                        stop_string=sequence.stops.found))

    def fail(self, error: str) -> None:
        self._last(Done(None, len(self.sequence.prompt), len(self.sequence.tokens), error))

    def _last(self, done: Done) -> None:
        if self.on_end is not None:
            self.on_end(self)  # before its client can hear of the end: /metrics has counted it by then
        self._emit(done)


class EngineThread:
    """A thread that owns a model and its engine, and the queue of requests and calls handed to it."""

    def __init__(self, model, tokenizer, max_batch_size: int = defaults.MAX_BATCH_SIZE,
                 max_waiting: int = defaults.MAX_WAITING, max_seq_len: int | None = None,
                 on_end: abc.Callable[[Generation], None] | None = None,
                 prefix_cache_bytes: int = defaults.PREFIX_CACHE_BYTES, threads: int | None = None,
                 speculative=defaults.SPECULATIVE, kv_cache_dtype: str | None = None,
                 prefix_cache_dir: str | Path | None = None):
        """on_end(request) is told of every request that ends, finished, cancelled or failed (metrics).
        prefix_cache_bytes: the prefix cache's budget for keys and values; 0 keeps no prefix. speculative: how a
        request speculates unless it says otherwise: None (not), "ngram" (prompt lookup) or a draft model (a
        SmolLM2 of the same vocabulary, run on this thread too; generation.speculative). kv_cache_dtype: what
        the KV cache stores (Engine), None for the model's dtype. threads: the
        CPU threads this thread runs the model with (default: as many as the calling thread's).
        prefix_cache_dir: a folder where the prefix cache's blocks are also kept, for later processes, and looked
        for (generation.prefix_cache.DiskCache); it needs a prefix cache.

        Each thread that runs torch on the CPU has an OpenMP pool of its own (libgomp), and once the process's
        pools hold more threads than there are CPUs, their workers sleep between parallel regions instead of
        spinning: every small operation then waits for a wake-up. A server whose main thread ran the model (to
        load it) before the engine thread did was 2.6x slower at batch 1 on 2 CPUs; `smollm2 serve` loads
        with one thread, which makes no pool, and gives the engine thread its --threads."""
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
        self.threads = threads or torch.get_num_threads()
        # The check Request.row makes of each request's (which this default becomes: speculation()), made once
        # more here so that a bad draft fails the start, not every request.
        check_speculative(speculative, model.config.vocab_size)
        self.speculative = speculative
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        if prefix_cache_dir is not None:
            if self.prefix_cache is None:
                raise SmolError("a prefix cache folder needs a prefix cache: give prefix_cache_bytes > 0")
            try:
                Path(prefix_cache_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SmolError(f"the prefix cache folder {prefix_cache_dir}: cannot create it: {e.strerror}") from None
        self.prefix_cache_dir = prefix_cache_dir
        self.adapters = Adapters(model)  # LoRA adapters, loaded and unloaded while serving (server/adapters.py)
        self.engine = Engine(model, max_batch_size, self.max_seq_len, prefill_budget=steps.PREFILL_CHUNK,
                             prefix_cache=self.prefix_cache, step=decode_step, kv_cache_dtype=kv_cache_dtype,
                             adapters=self.adapters)
        self.requests: dict[Row, Generation] = {}  # in flight: each holds (or is queued for) a row of the engine
        self.waiting: collections.deque[Generation] = collections.deque()
        self.calls: collections.deque[tuple[abc.Callable, asyncio.Future]] = collections.deque()  # see call()
        self._wake = threading.Condition()  # guards waiting, calls and _stopping
        self._stopping = False
        self.ready = threading.Event()  # set once the thread's warm-up step has run (/ready)
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

    def submit(self, request: Request) -> Generation:
        """Queue a request, made into a row of this thread's engine (Request.row: checked against the model and
        max_seq_len), with its LoRA adapter where it names a loaded one; raises SmolError if it cannot run,
        QueueFull if too many are waiting."""
        row = request.row(self.model, self.max_seq_len, self.tokenizer)
        row.adapter = self.adapters.loaded.get(request.adapter)
        generation = Generation(row, asyncio.get_running_loop(), self.on_end)
        if row.sequence.finish_reason and row.prompt_logprobs is None:  # max_tokens 0: nothing to generate
            generation.finish()
            return generation
        with self._wake:
            if self._stopping:
                raise SmolError("the server is shutting down")
            self._check_room()
            self.waiting.append(generation)
            self._wake.notify()
        return generation

    @property
    def draft(self):
        """The draft model requests may ask for ("draft"), or None."""
        return None if self.speculative in (None, "ngram") else self.speculative

    def speculation(self, asked: str | None):
        """What a request that asks `asked` over HTTP speculates with, as a Request says it: None for the thread's
        default; "off", "ngram" (prompt lookup) or "draft" (the thread's draft model): None, "ngram" or the draft.
        The word is the body's to check (its schema), what it becomes Request.row's."""
        if asked is None:
            return self.speculative
        if asked == "draft":
            if self.draft is None:
                raise FieldError("speculative", "'draft' needs a server started with a draft model "
                                 "(--speculative draft:SRC)")
            return self.draft
        return None if asked == "off" else asked

    def call(self, function: abc.Callable[[], Any]) -> asyncio.Future:
        """Run function() on this thread between two steps; returns a future of its result (or of
        the exception it raised). For torch work beside generation (embeddings): a thread of the event loop's
        would run it on an OpenMP pool of its own, which slows the engine's steps (see __init__). Raises
        QueueFull as submit does; the requests in flight go on a step after it returns."""
        future = asyncio.get_running_loop().create_future()
        with self._wake:
            if self._stopping:
                raise SmolError("the server is shutting down")
            self._check_room()
            self.calls.append((function, future))
            self._wake.notify()
        return future

    def _check_room(self) -> None:  # under self._wake
        if len(self.waiting) + len(self.calls) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting) + len(self.calls)} requests are already waiting; try again later")

    def cancel(self, request: Generation) -> None:
        """Stop generating for this request (no-op once it is done); its slot frees at the next step."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    def load(self) -> dict:
        """Requests holding a cache row (decoding, or their prompt being prefilled), and those waiting for one:
        here or in the engine's queue."""
        engine = self.engine  # copies: the engine thread changes these meanwhile
        # a row of the prefill pass running now is in `planned` (and may be in `decoding` already): counted once
        holding = {id(row): row for row in [*engine.decoding, engine.filling, *engine.planned] if row is not None}
        queued = len(engine.queued)
        active = [self.requests.get(row) for row in holding.values()]
        return dict(active=sum(r is not None and not r.done for r in active),
                    waiting=len(self.waiting) + len(self.calls) + queued, slots=self.max_batch_size)

    # The engine thread.

    @torch.inference_mode()
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # a thread's own setting (OpenMP's), not inherited from its creator
        try:
            self._warm_up()
        except Exception:  # never ready: /ready stays 503, and the requests fail as the steps do
            log.exception("the warm-up step failed")
        else:
            self.ready.set()
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self.requests and not self.calls:
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._call()
                self._step()
            except Exception as e:  # a bug or out of memory: fail the requests in flight, keep serving
                log.exception("engine step failed")
                self.engine.reset()
                self._end(self._take_in_flight(), f"internal error: {e}")
        with self._wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
            calls, self.calls = list(self.calls), collections.deque()
        self._end([*waiting, *self._take_in_flight()], "the server is shutting down")
        for _, future in calls:
            settle(future, future.set_exception, SmolError("the server is shutting down"))

    def _warm_up(self) -> None:
        """A short prompt's prefill and a decoding step through the model's blocks, on this thread and with its
        threads, into a cache of their own (no row, no prefix cache, no count moves): what the first request
        would otherwise pay for falls here, before /ready says the server is ready: the OpenMP pool, the first
        pages of memory, and the kernels' choices for those passes (measured at their first call, and kept for
        later processes: choosing.py), and the disk cache's model identity. The logits' product is not run (the
        first request measures its choice, where no earlier process did), nor a longer prompt's kinds."""
        if self.prefix_cache_dir is not None:  # hashes the weights (the model's identity): a cost of starting
            self.prefix_cache.disk = DiskCache(self.prefix_cache_dir, self.model, self.engine.cache, self.threads)
        cache = untouched_cache(self.model, 1, steps.CACHE_BLOCK, self.engine.kv_cache_dtype)
        prompt = torch.arange(WARM_UP_PROMPT, device=self.device)[None]
        prefill_chunk(self.model, prompt, cache, 0)
        slot = torch.tensor([[WARM_UP_PROMPT]], device=self.device)
        self.model.hidden_states(prompt[:, -1:], slot, cache.view(length=WARM_UP_PROMPT + 1))

    def _call(self) -> None:
        """Run the functions handed over by call(), each to its future."""
        with self._wake:
            calls, self.calls = list(self.calls), collections.deque()
        for function, future in calls:
            if future.cancelled():  # its client went away
                continue
            try:
                result = function()
            except Exception as e:
                settle(future, future.set_exception, e)
            else:
                settle(future, future.set_result, result)

    def _step(self) -> None:
        for row, request in list(self.requests.items()):
            if request.cancelled:
                self.engine.cancel(row)
                del self.requests[row]
                self._cancelled(request)
        while self.engine.free and (request := self._next_waiting()) is not None:
            self.requests[self.engine.queue(request.row)] = request
        events = self.engine.step()
        now = time.perf_counter()
        for row, event in events:
            request = self.requests[row]
            if isinstance(event, Step):
                request.token_times.append(now)
            request.send(event)
            if request.done:
                del self.requests[row]

    def _next_waiting(self) -> Generation | None:
        with self._wake:
            while self.waiting:
                request = self.waiting.popleft()
                if not request.cancelled:
                    return request
                self._cancelled(request)
        return None

    def _take_in_flight(self) -> list[Generation]:
        """Every request in flight, which then holds no row."""
        requests, self.requests = [r for r in self.requests.values() if not r.done], {}
        return requests

    def _end(self, requests: list[Generation], error: str) -> None:
        for request in requests:
            request.fail(error)

    @staticmethod
    def _cancelled(request: Generation) -> None:
        # Its last event, which nobody may hear: whoever still waits on it (an answer not streamed) stops waiting.
        request.fail("cancelled: the client went away")


def settle(future: asyncio.Future, setter: abc.Callable, value) -> None:  # engine thread
    """Hand a result or exception to a future of the event loop's, unless it was cancelled meanwhile."""
    def set_it():
        if not future.done():
            setter(value)

    try:
        future.get_loop().call_soon_threadsafe(set_it)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
