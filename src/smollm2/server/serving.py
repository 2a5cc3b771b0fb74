"""What every route of the server shares, whichever API it speaks: errors (any exception as the APIError its client
gets), the app's state (Served), request bodies' text and stop strings, running requests on an engine thread (submit,
answers) and server-sent events, streamed along one path for every API (stream, each API's Writer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
from collections import abc
from typing import Annotated

from fastapi import Depends
from fastapi import Request as Connection
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BeforeValidator, Field
from starlette.exceptions import HTTPException

from ..errors import FieldError, SmolError
from ..generation.grammar import Grammar
from ..generation.logprobs import TokenLogprob
from ..generation.request import Request
from ..generation.sampling import MAX_SEED
from ..tools import CallPiece, ToolCall, ToolCallParser, Tools, parse_tool_calls
from .metrics import Metrics
from .scheduler import Delta, Done, EngineThread, Generation, PromptLogprobs, QueueFull

MAX_STOPS = 4  # as OpenAI
MAX_STOP_LENGTH = 1000  # characters: far beyond any marker an answer ends at


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def as_api_error(e: Exception) -> APIError:
    """Whatever a route raised, as what its client is told: an APIError as it is; a SmolError (bad input) a 400;
    a full queue a 429; FastAPI's body validation a 400 naming the field (as messages.0.content); an unknown
    route or method a 404 or 405; anything else, a bug, a 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SmolError):
        return APIError(400, str(e), param=e.field if isinstance(e, FieldError) else None)
    if isinstance(e, QueueFull):
        return APIError(429, str(e), "rate_limit_error", code="queue_full")
    if isinstance(e, RequestValidationError):
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error')}")
        where = ".".join(str(part) for part in error["loc"] if part != "body")
        return APIError(400, f"{where or 'body'}: {error['msg']}", param=where or None)
    if isinstance(e, HTTPException):
        return APIError(e.status_code, str(e.detail))
    return APIError(500, f"internal error: {type(e).__name__}", "server_error")


def error_response(e: APIError) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": dict(message=e.message, type=e.type, param=e.param, code=e.code)}, e.status)


# Request bodies. Strict: a string is not a number here, nor a number a string. Unknown fields are ignored.

def unicode(text: str) -> str:
    """Valid JSON can still hold a lone surrogate ("\\ud800"), which is no character: no tokenizer encodes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate at character {e.start + 1})") from None
    return text


Text = Annotated[str, AfterValidator(unicode)]
# One stop string or a list of them, as a list: an error then names the string, as stop.2, whichever was sent.
Stops = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(unicode)]],
                  Field(max_length=MAX_STOPS), BeforeValidator(lambda stop: [stop] if isinstance(stop, str) else stop)]


def text_of(value, where: str) -> str:
    """A string of a request's JSON that the body's schema leaves open (a message's content, a part's text), or
    an APIError naming where it is."""
    if not isinstance(value, str):
        raise APIError(400, f"{where}: must be a string", param=where)
    try:
        return unicode(value)
    except ValueError as e:
        raise APIError(400, f"{where}: {e}", param=where) from None


def content_text(content, where: str, kinds: abc.Collection[str] = ("text",), others: abc.Collection[str] = ()) \
        -> str:
    """A message's content as one string: the string itself, or its text parts ({"type": "text", "text": ...},
    or another of `kinds`) joined; an APIError naming the field (as messages.0.content.1.type) for anything else.
    `where`: the content's field; `others`: the types of parts the caller reads itself (tool calls), passed over."""
    if isinstance(content, str):
        return text_of(content, where)
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise APIError(400, f"{where}.{j}: must be an object {{'type': {next(iter(kinds))!r}, 'text': ...}}",
                           param=f"{where}.{j}")
        if part.get("type") in others:
            continue
        if part.get("type") not in kinds:
            raise APIError(400, f"{where}.{j}.type: only {' and '.join(map(repr, [*kinds, *others]))} parts are "
                           f"supported, got {part.get('type')!r}", param=f"{where}.{j}.type")
        parts.append(text_of(part.get("text"), f"{where}.{j}.text"))
    return "".join(parts)


def text_or_ids(value, most: int) -> list[str | list[int]]:
    """OpenAI's prompt (or embeddings' input): a string, token ids, or a non-empty list of up to `most` of those.
    A body validator: an error (ValueError) names the field alone. Returns a list, each text or token ids."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be text, token ids, or a non-empty list of those")
    if len(value) > most:
        raise ValueError(f"{len(value)} items in one request; at most {most}")
    for item in value:
        if isinstance(item, str):
            unicode(item)
        elif not (isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in item)):
            raise ValueError("must be text, token ids, or a non-empty list of those")
    return value


class Served:
    """What one app serves, kept in its app.state.served: an engine thread per model name (the base model's and its
    adapters'), the tokenizer they share, the metrics, the API key (None: no key asked), the conversations of
    the /v1/responses answers stored for a later previous_response_id (responses.py bounds them), and whether it
    drains."""

    def __init__(self, engines: dict[str, EngineThread], tokenizer, metrics: Metrics, api_key: str | None):
        self.engines, self.tokenizer, self.metrics, self.api_key = engines, tokenizer, metrics, api_key
        self.responses: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
        self.draining = False  # set on SIGTERM: new requests get 503 (draining.py)
        self.admitted = 0  # HTTP requests being answered, the probes aside

    @property
    def ready(self) -> bool:
        """Whether to send this server requests: every model's warm-up step has run, and it is not draining."""
        return not self.draining and all(engine.ready.is_set() for engine in self.engines.values())

    def engine(self, name: str) -> EngineThread:
        """The engine thread of the model a request names (Request.adapter): the base model's, or the one that
        holds the LoRA adapter of that name (its rows then have the adapter: EngineThread.submit)."""
        for base, thread in self.engines.items():
            if name == base or name in thread.adapters.loaded:
                return thread
        raise APIError(404, f"the model {name!r} does not exist; this server has {', '.join(map(repr, self.models))}",
                       param="model", code="model_not_found")

    @property
    def models(self) -> list[str]:
        """The names requests may give as their model: each base model's, then its adapters'."""
        return [name for base, thread in self.engines.items() for name in (base, *thread.adapters.loaded)]


async def app_state(connection: Connection) -> Served:  # async: FastAPI would run a plain def in a thread
    return connection.app.state.served


AppState = Annotated[Served, Depends(app_state)]  # what a route serves: its own app's, as several apps may run


# Running requests.

async def grammar(response_format: dict | None, tokenizer, param: str, tools: Tools | None = None) \
        -> Grammar | None:
    """What a request's answer must fit (Grammar.for_answer), compiled: its response_format (a bad one is a 400
    naming `param`, the field it came in), or the calls of the tools it may call (a 400 naming tools)."""
    calls = tools is not None and tools.offered
    if response_format is None and not calls:
        return None
    try:  # in a thread: a new schema compiles in milliseconds, the tokenizer's tables in about a second
        return await run_in_threadpool(Grammar.for_answer, tokenizer, response_format, tools)
    except SmolError as e:
        raise APIError(400, str(e), param="tools" if calls and response_format is None else param) from None


def submit(served: Served, requests: list[Request], n: int = 1) -> list[Generation]:
    """Each request's n choices, in that order, queued on the engine thread of its model (its adapter), choice i
    sampled with the sampling's seed + i (without a seed, each draws a random one); none queued if one fails."""
    generations = []
    try:
        for request in requests:
            thread, seed = served.engine(request.adapter), request.sampling.seed
            for i in range(n):
                sampling = dataclasses.replace(request.sampling,
                                               seed=None if seed is None else (seed + i) % (MAX_SEED + 1))
                generations.append((thread, thread.submit(dataclasses.replace(request, sampling=sampling))))
    except BaseException:
        for thread, generation in generations:
            thread.cancel(generation)
        raise
    return [generation for _, generation in generations]


@dataclasses.dataclass
class Whole:
    """One choice's whole answer: its text outside its tool calls, the calls it made (where its request offered
    tools), its end, and its tokens' log-probabilities, the prompt's first when asked."""
    text: str
    calls: list[ToolCall]
    done: Done
    logprobs: list[TokenLogprob | None]


async def answers(thread: EngineThread, generations: list[Generation], connection: Connection,
                  tools: Tools | None = None) -> list[Whole]:
    """Each choice's whole answer, its calls read where `tools` offered them. A request the server ended
    (shutting down, a failed step) is a 503."""
    # Nothing is sent before the whole answer, so only listening tells that the client went away.
    watcher = asyncio.create_task(cancel_on_disconnect(connection, thread, generations))
    texts, logprobs, dones = [[] for _ in generations], [[] for _ in generations], [None] * len(generations)
    try:
        async with contextlib.aclosing(merged(generations)) as events:
            async for i, event in events:
                if isinstance(event, PromptLogprobs):
                    logprobs[i] = event.logprobs
                elif isinstance(event, Delta):
                    texts[i].append(event.text)
                    logprobs[i] += event.logprobs
                elif event.error:
                    raise APIError(503, event.error, "server_error")
                else:
                    dones[i] = event
    finally:
        watcher.cancel()
        for generation in generations:  # no-op once done; a shutdown mid-answer must not leave them running
            thread.cancel(generation)
    offered = tools is not None and tools.offered
    split = [parse_tool_calls("".join(text)) if offered else ("".join(text), []) for text in texts]
    return [Whole(text, calls, done, items) for (text, calls), done, items in zip(split, dones, logprobs)]


async def cancel_on_disconnect(connection: Connection, thread: EngineThread, generations: list[Generation]):
    # The body is already read: what comes next is the client's disconnect (or the server's, once it answered).
    while (await connection.receive())["type"] != "http.disconnect":
        pass
    for generation in generations:
        thread.cancel(generation)


async def merged(generations: list[Generation]) -> abc.AsyncIterator[tuple[int, PromptLogprobs | Delta | Done]]:
    """The events of several generations (a request's choices) as they come, each with its choice's index, until
    every one has ended."""
    if len(generations) == 1:
        async for event in generations[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, generation: Generation):
        async for event in generation.events():
            queue.put_nowait((i, event))

    pumps = [asyncio.create_task(pump(i, generation)) for i, generation in enumerate(generations)]
    try:
        left = len(generations)
        while left:
            i, event = await queue.get()
            left -= isinstance(event, Done)
            yield i, event
    finally:
        for task in pumps:
            task.cancel()


# Server-sent events.

class Writer:
    """How an API writes a streamed answer: the server-sent events for each thing the one streaming path
    (stream()) meets, each method returning them (an iterable of strings, maybe empty)."""

    def begin(self) -> abc.Iterable[str]:
        """Before any event of the engine's."""
        return ()

    def scored(self, index: int, logprobs: list[TokenLogprob | None]) -> abc.Iterable[str]:
        """Choice `index`'s prompt's log-probabilities (echo), before its first piece."""
        return ()

    def piece(self, index: int, text: str, pieces: list[CallPiece], logprobs: list[TokenLogprob]) \
            -> abc.Iterable[str]:
        """A piece of choice `index`: its new text outside its tool calls, what it added to its calls, and its new
        tokens' log-probabilities where asked."""
        raise NotImplementedError

    def finished(self, index: int, done: Done, text: str, calls: list[ToolCall]) -> abc.Iterable[str]:
        """Choice `index` has ended: the last of its text (what the call parser held back) and all its calls."""
        raise NotImplementedError

    def failed(self, error: str) -> abc.Iterable[str]:
        """The server ended the answer (shutting down, a failed step): the status is already sent, so the error
        can only travel in the stream. Nothing else is written after it, but end()."""
        raise NotImplementedError

    def end(self, dones: list[Done], failed: bool) -> abc.Iterable[str]:
        """After every choice has ended (or one failed)."""
        return ()


async def stream(thread: EngineThread, generations: list[Generation], writer: Writer, tools: Tools | None = None):
    """The one streaming path of every API: each choice's events as they come, its text through a tool-call
    parser of its own where `tools` offered calls, written by the API's writer. However the stream ends (its
    client gone too), the generations are cancelled (a no-op once done), which frees their rows at once."""
    offered = tools is not None and tools.offered
    parsers = [ToolCallParser() if offered else None for _ in generations]
    dones, failed = [], False
    try:
        for sent in writer.begin():
            yield sent
        async with contextlib.aclosing(merged(generations)) as events:
            async for i, event in events:
                parser = parsers[i]
                if isinstance(event, PromptLogprobs):
                    written = writer.scored(i, event.logprobs)
                elif isinstance(event, Delta):
                    text, pieces = parser.feed(event.text) if parser is not None else (event.text, [])
                    written = writer.piece(i, text, pieces, event.logprobs)
                elif event.error:
                    failed, written = True, writer.failed(event.error)
                else:
                    dones.append(event)
                    written = writer.finished(i, event, parser.finish() if parser is not None else "",
                                              parser.calls if parser is not None else [])
                for sent in written:
                    yield sent
                if failed:
                    break
        for sent in writer.end(dones, failed):
            yield sent
    finally:
        for generation in generations:
            thread.cancel(generation)


class EventStream(StreamingResponse):
    """Server-sent events. The generator is closed however the response ends, so a client that leaves
    cancels its request, and frees its slot, at once rather than whenever the generator is collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(data: dict | str, event: str | None = None) -> str:
    """One server-sent event: its data (JSON, or a string as it is), named `event` where the API names them."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
