"""The OpenAI-compatible HTTP face of the scheduler: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics (Prometheus).

Request bodies are pydantic models. Every error, ours or FastAPI's, leaves as OpenAI's error body
{"error": {"message", "type", "param", "code"}} with a 4xx status (5xx only for a bug), and the server keeps
serving. Answers stream as server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
Beyond OpenAI's own limits, a stop string has at most MAX_STOP_LENGTH characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Header
from fastapi import Request as Connection
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..errors import SmolError
from ..generation.sampling import MAX_SEED, Sampling
from .metrics import CountResponses, Metrics
from .scheduler import Delta, QueueFull, Request, Scheduler

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat answers may run to the context window
MAX_STOPS = 4  # as OpenAI
MAX_STOP_LENGTH = 1000  # characters: far beyond any marker an answer ends at


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(e: APIError) -> JSONResponse:
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


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant"]
    content: Text


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Body(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Stops | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


class CompletionBody(Body):
    prompt: Text


class EventStream(StreamingResponse):
    """Server-sent events. The generator is closed however the response ends, so a client that leaves
    cancels its request, and frees its slot, at once rather than whenever the generator is collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 before anything parses it, chunked or not."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                response = error_response(APIError(413, f"the request body exceeds {self.max_bytes} bytes"))
                return await response(scope, receive, send)
            more = message.get("more_body", False)

        replayed = False

        async def replay():  # the whole body once, then the client's own messages (its disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def create_app(model, tokenizer, *, model_name: str = "SmolLM2-135M-Instruct", max_batch_size: int = 8,
               max_waiting: int = 64, max_seq_len: int | None = None, max_body_bytes: int = 1 << 20,
               api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the scheduler thread (which then owns the model) and stops it."""
    scheduler = Scheduler(model, tokenizer, max_batch_size, max_waiting, max_seq_len,
                          on_end=lambda request: metrics.ended(request))
    metrics = Metrics(scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    async def authorize(authorization: Annotated[str, Header()] = ""):
        # Constant-time comparison: the time taken must not tell how much of a guessed key is right.
        if api_key is not None and not secrets.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (expected 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")

    app = FastAPI(title="smollm2", lifespan=lifespan, dependencies=[Depends(authorize)])
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(CountResponses, metrics=metrics)  # outermost: a 413 from BodyLimit counts too

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(SmolError)
    async def smol_error(request, e: SmolError):
        return error_response(APIError(400, str(e)))

    @app.exception_handler(QueueFull)
    async def queue_full(request, e: QueueFull):
        return error_response(APIError(429, str(e), "rate_limit_error", code="queue_full"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, e: RequestValidationError):
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            return error_response(APIError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error')}"))
        where = [str(part) for part in error["loc"] if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {error['msg']}"
        return error_response(APIError(400, message, param=".".join(where) or None))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # unknown routes (404), wrong methods (405)
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", **scheduler.load()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "smollm2"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, connection: Connection):
        check_model(body.model)
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], add_generation_prompt=True)
        return await complete(body, prompt, body.max_completion_tokens or body.max_tokens, connection, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, connection: Connection):
        check_model(body.model)
        return await complete(body, tokenizer.encode(body.prompt), body.max_tokens or COMPLETION_MAX_TOKENS,
                              connection, chat=False)

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")

    async def complete(body: Body, prompt: list[int], max_tokens: int | None, connection: Connection, chat: bool):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:
            max_tokens = max(scheduler.max_seq_len - len(prompt), 1)  # too long a prompt still fails as such
        sampling = Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        request = scheduler.submit(prompt, max_tokens, sampling, body.stop or [])
        reply = Reply(chat, model_name)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(stream(scheduler, request, reply, usage))
        # Nothing is sent before the whole answer, so only listening tells that the client went away.
        watcher = asyncio.create_task(cancel_on_disconnect(connection, scheduler, request))
        text = []
        try:
            async for event in request.events():
                if isinstance(event, Delta):
                    text.append(event.text)
                elif event.error:
                    raise APIError(503, event.error, "server_error")
                else:
                    return reply.whole("".join(text), event)
        finally:
            watcher.cancel()
            scheduler.cancel(request)  # no-op once done; a shutdown mid-answer must not leave it running

    return app


class Reply:
    """OpenAI's response objects, for chat ("chat.completion") or plain completions ("text_completion")."""

    def __init__(self, chat: bool, model_name: str):
        self.chat, self.model = chat, model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return dict(id=self.id, object=kind, created=self.created, model=self.model, choices=choices, **extra)

    @staticmethod
    def usage(done) -> dict:
        return dict(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                    total_tokens=done.prompt_tokens + done.completion_tokens)

    def whole(self, text: str, done) -> dict:
        if self.chat:
            choice = dict(index=0, message=dict(role="assistant", content=text), logprobs=None,
                          finish_reason=done.finish_reason)
            return self._object("chat.completion", [choice], usage=self.usage(done))
        choice = dict(index=0, text=text, logprobs=None, finish_reason=done.finish_reason)
        return self._object("text_completion", [choice], usage=self.usage(done))

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        """A streamed piece; text None: the last piece, which carries the finish_reason."""
        if self.chat:
            delta = {} if text is None else dict(role="assistant", content=text) if role else dict(content=text)
            return self._object("chat.completion.chunk", [dict(index=0, delta=delta, logprobs=None,
                                                                finish_reason=finish_reason)])
        return self._object("text_completion", [dict(index=0, text=text or "", logprobs=None,
                                                     finish_reason=finish_reason)])

    def usage_chunk(self, done) -> dict:  # stream_options.include_usage: one more chunk, with no choices
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=self.usage(done))


async def cancel_on_disconnect(connection: Connection, scheduler: Scheduler, request: Request):
    # The body is already read: what comes next is the client's disconnect (or the server's, once it answered).
    while (await connection.receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(request)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(scheduler: Scheduler, request: Request, reply: Reply, include_usage: bool):
    try:
        if reply.chat:
            yield sse(reply.chunk("", role=True))
        async for event in request.events():
            if isinstance(event, Delta):
                if event.text:
                    yield sse(reply.chunk(event.text))
            elif event.error:  # the status is already sent: the error can only travel in the stream
                yield sse({"error": dict(message=event.error, type="server_error", param=None, code=None)})
            else:
                yield sse(reply.chunk(None, event.finish_reason))
                if include_usage:
                    yield sse(reply.usage_chunk(event))
        yield sse("[DONE]")
    finally:
        scheduler.cancel(request)  # no-op once done; frees the slot when the client went away mid-answer
