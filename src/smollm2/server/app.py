"""The app: its factory (the model's engine thread), its middleware and its API key; /health (alive), /ready (worth
sending requests to), /metrics (Prometheus), and llama.cpp's /tokenize and /detokenize here. Each API has a module
of its own: OpenAI's chat completions, completions and models (openai.py), its Responses (responses.py) and
embeddings (embeddings.py), Anthropic's Messages (messages.py), /inspect (inspect.py), and vLLM's LoRA adapters
loaded while serving (adapters.py).

Request bodies are pydantic models. Every error, ours or FastAPI's, leaves as OpenAI's error body
{"error": {"message", "type", "param", "code"}} (Anthropic's on its own routes) with a 4xx status (5xx only for a
bug), and the server keeps serving. Beyond OpenAI's own limits, a stop string has at most MAX_STOP_LENGTH
characters.

The routes are module-level functions on `router` (and on each other API's own); what they serve (engine threads,
tokenizer, metrics, API key) is their own app's Served, in app.state, so that several apps can live in one process
(tests, benchmarks). What the routes of every API share is in serving.py.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
import torch

from .. import loading
from ..errors import SmolError
from ..generation.request import check_token_id
from ..generation.speculative import speculation
from ..tokenizer import Tokenizer
from . import adapters as lora_adapters
from . import defaults, embeddings, inspect, messages, openai, page, responses
from .draining import Admission
from .metrics import CountResponses, Metrics
from .scheduler import EngineThread, QueueFull
from .serving import APIError, AppState, Served, Text, as_api_error, error_response


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True)
    content: Text
    add_special: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True)
    tokens: list[int]


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


def create_app(model, tokenizer, *, model_name: str = "SmolLM2-135M-Instruct",
               max_batch_size: int = defaults.MAX_BATCH_SIZE, max_waiting: int = defaults.MAX_WAITING,
               max_seq_len: int | None = None, max_body_bytes: int = 1 << 20, api_key: str | None = None,
               prefix_cache_bytes: int = defaults.PREFIX_CACHE_BYTES, adapters: dict[str, str | Path] | None = None,
               threads: int | None = None, speculative=defaults.SPECULATIVE, kv_cache_dtype: str | None = None,
               prefix_cache_dir: str | Path | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread (which then owns the model) and stops it.
    The defaults are a server's (defaults.py), `smollm2 serve`'s too but for the KV cache's dtype.
    prefix_cache_bytes: memory for the keys and values of prompt prefixes kept for later prompts (0: none).
    adapters: LoRA adapters served over the model from the start, {name: directory in PEFT's format},
    chosen per request by its `model` field, as those loaded later (POST /v1/load_lora_adapter, adapters.py):
    each held as its low-rank matrices, its rows decoding in the same passes as the base's
    (generation/adapters.py). The model's engine thread runs it with `threads` CPU threads (default: as many as
    this thread's; see EngineThread). speculative: how requests guess tokens unless they say otherwise: None
    (they do not), "ngram" (prompt lookup) or a draft model, a smaller SmolLM2 with the same tokenizer
    (generation.speculative; the same answers either way). kv_cache_dtype: what the KV cache stores, "fp32",
    "bf16" (half fp32's memory, perplexity within 0.1%; `smollm2 serve`'s default) or "int8"
    (smollm2.kv_cache.KVCache); None, the model's dtype, gives the answers and log-probabilities of generate() on
    the same model, bit for bit.
    prefix_cache_dir: a folder where the prefix cache also keeps its blocks, as files a later process (or
    another on a shared disk) reads instead of prefilling them again, with the same bits
    (generation.prefix_cache.DiskCache)."""
    engines = {model_name: EngineThread(model, tokenizer, max_batch_size, max_waiting, max_seq_len,
                                        on_end=lambda generation: metrics.ended(generation, model_name),
                                        prefix_cache_bytes=prefix_cache_bytes, threads=threads,
                                        speculative=speculative, kv_cache_dtype=kv_cache_dtype,
                                        prefix_cache_dir=prefix_cache_dir)}
    metrics = Metrics(engines)
    app = FastAPI(title="smollm2", lifespan=lifespan, dependencies=[Depends(authorize)],
                  exception_handlers=EXCEPTION_HANDLERS)
    app.state.served = served = Served(engines, tokenizer, metrics, api_key)
    lora_adapters.load_at_start(served, adapters or {})
    for routes in (router, openai.router, responses.router, messages.router, embeddings.router, inspect.router,
                   lora_adapters.router):
        app.include_router(routes)
    page.serve(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Admission, served=served)
    app.add_middleware(CountResponses, metrics=metrics)  # outermost: a 413 from BodyLimit, a 503 while draining count
    return app


def load_app(src=None, *, load: dict | None = None, lora: dict | None = None,
             speculative: str | None = defaults.SPECULATIVE, threads: int | None = None, saes: list[str] = (),
             **options) -> FastAPI:
    """create_app over what sources name, loaded as `smollm2 serve` loads them: the model at `src` (as smollm2.load
    takes it, with `load`'s options: dtype, device, adapter, quantize, kernels) and its tokenizer, served as `src`
    (unless options say model_name); `lora`: LoRA adapters by name, each a directory (create_app's `adapters`);
    `speculative`: the guesser in the command line's words (generation.speculative.speculation: "ngram", "off",
    "draft:SRC", a draft loaded with `load`'s options but the adapter); `saes`: the sparse dictionaries served on
    the page and the inspect routes (inspect.serve_dictionaries). options: create_app's.

    This thread loads everything with one torch thread, and keeps one: the model runs on the engine thread,
    `threads` (default: this thread's count before), and an OpenMP pool of this thread's own, made by the load's
    first parallel operation, would add to its and, past the count of CPUs, put every pool's workers to sleep
    between parallel regions (see EngineThread): 2.6x slower at batch 1 on 2 CPUs."""
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    load = load or {}
    model, tokenizer = loading.load(src, **load), Tokenizer.from_pretrained(src)
    guesser = speculation(speculative, tokenizer, **{k: v for k, v in load.items() if k != "adapter"})
    if src is not None:
        options.setdefault("model_name", str(src))
    app = create_app(model, tokenizer, adapters=lora, threads=threads, speculative=guesser, **options)
    inspect.serve_dictionaries(app, saes)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    engines = app.state.served.engines.values()
    for engine in engines:
        engine.start()
    try:
        yield
    finally:
        for engine in engines:
            engine.stop()


async def authorize(served: AppState, authorization: Annotated[str, Header()] = "",
                    x_api_key: Annotated[str, Header()] = ""):
    """The key as OpenAI's clients send it (Authorization: Bearer KEY) or as Anthropic's may (x-api-key: KEY)."""
    if served.api_key is None:
        return
    # Constant-time comparisons: the time taken must not tell how much of a guessed key is right.
    bearer = secrets.compare_digest(authorization.encode(), f"Bearer {served.api_key}".encode())
    keyed = secrets.compare_digest(x_api_key.encode(), served.api_key.encode()) and x_api_key != ""
    if not (bearer or keyed):
        raise APIError(401, "invalid or missing API key (expected 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                       "authentication_error", code="invalid_api_key")


async def openai_error(request, e: Exception):
    return error_response(as_api_error(e))


# Each class its handler: FastAPI's own handlers of the last two would otherwise answer in its shape.
EXCEPTION_HANDLERS = {kind: openai_error for kind in (APIError, SmolError, QueueFull, RequestValidationError,
                                                       HTTPException, Exception)}

router = APIRouter()


@router.get("/health")
async def health(served: AppState):
    loads = [engine.load() for engine in served.engines.values()]
    return {"status": "ok", **{key: sum(load[key] for load in loads) for key in loads[0]}}


@router.get("/ready")
async def ready(served: AppState):
    """Whether a load balancer may send this server requests: 503 until every model has run its warm-up step (the
    engine thread's, at start), 200 then, 503 again once it drains (SIGTERM)."""
    if served.ready:
        return {"status": "ready"}
    return JSONResponse({"status": "draining" if served.draining else "loading"}, 503)


@router.get("/metrics")
async def prometheus(served: AppState):
    return Response(served.metrics.render(), media_type=served.metrics.content_type)


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, served: AppState):
    # add_special: the special tokens the tokenizer's own post-processor adds (SmolLM2's: none).
    return {"tokens": served.tokenizer.backend.encode(body.content, add_special_tokens=body.add_special).ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, served: AppState):
    for j, t in enumerate(body.tokens):  # the tokenizer's vocabulary: it decodes them
        check_token_id(t, served.tokenizer.vocab_size, f"tokens.{j}")
    return {"content": served.tokenizer.decode(body.tokens)}
