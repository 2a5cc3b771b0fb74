"""The HTTP face of the scheduler: OpenAI's /v1/chat/completions, /v1/completions and /v1/models here, its
/v1/responses (responses.py) and /v1/embeddings (embeddings.py), Anthropic's /v1/messages (messages.py); /health
(alive), /ready (worth sending requests to), /metrics (Prometheus), and llama.cpp's /tokenize and /detokenize.

Request bodies are pydantic models. Every error, ours or FastAPI's, leaves as OpenAI's error body
{"error": {"message", "type", "param", "code"}} (Anthropic's on its own routes) with a 4xx status (5xx only for a
bug), and the server keeps serving. Answers stream as server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`.
Beyond OpenAI's own limits, a stop string has at most MAX_STOP_LENGTH characters. Beyond OpenAI's own fields,
vLLM's `stop_token_ids` and `min_tokens`, and response_format types "choice" and "regex" (see grammar.py).

The routes are module-level functions on `router` (and on each other API's own); what they serve (schedulers,
tokenizer, metrics, API key) is their own app's Served, in app.state, so that several apps can live in one process
(tests, benchmarks). What the routes of every API share is in serving.py.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import secrets
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi import Request as Connection
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException
from torch import nn

from ..errors import FieldError, SmolError
from ..generation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ..generation.sampling import MAX_BIAS, MAX_PENALTY, MAX_SEED, Sampling
from ..generation.sequence import prompt_rows
from ..tools import ToolCall, ToolCallParser, Tools, parse_tool_calls
from . import embeddings, inspect, messages, page, responses
from .draining import Admission
from .metrics import CountResponses, Metrics
from .scheduler import Delta, PromptLogprobs, QueueFull, Request, Scheduler
from .serving import (APIError, AppState, Ask, EventStream, Served, Stops, Text, answers, as_api_error,
                      check_room, check_token_ids, content_text, error_response, grammar, merged, sse, submit,
                      text_or_ids)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat answers may run to the context window
MAX_N = 8  # choices per prompt: each is a request of its own in the batch
MAX_PROMPTS = 16  # prompts per /v1/completions request
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries: each is applied to its row's logits at every step

# A token id as a JSON object's key, which is a string: "1234" is token 1234 (and "1234.0" or " 1234" none).
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$"), AfterValidator(int)]


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts: checked by content_text
    tool_calls: Any = None  # an assistant's: checked with the chat (smollm2.tools.check_tool_messages)
    tool_call_id: Text | None = None  # a tool's: the call it answers

    def chat(self, i: int) -> dict:
        """The message as the tokenizer takes it; content None only for an assistant's that makes tool calls."""
        message = dict(role=self.role, content=None if self.content is None and self.tool_calls
                       else content_text(self.content, f"messages.{i}.content"))
        for key in ("tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


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
    n: int = Field(1, ge=1, le=MAX_N)  # choice i samples with seed + i
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema" | "choice" | "regex",
    # ...}: see grammar.py
    speculative: Literal["ngram", "draft", "off"] | None = None  # our extension: None is the server's --speculative
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = \
        Field(None, max_length=MAX_LOGIT_BIAS)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = Field(0, ge=0)
    steering: inspect.Steering | None = None  # our extension: a vector added to this request's residual stream
    steer: list[inspect.FeatureSteering] = Field([], max_length=inspect.MAX_FEATURE_STEERS)  # ours: by SAE features


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs
    tools: list | None = None  # OpenAI's function tools, checked by smollm2.tools.Tools
    tool_choice: str | dict | None = None  # "auto" (the default with tools), "none", "required", or a function
    parallel_tool_calls: bool = True


class CompletionBody(Body):
    # Each text or token ids; a list of them is a batch: each prompt's choices in turn.
    prompt: Annotated[list[str | list[int]], BeforeValidator(lambda prompt: text_or_ids(prompt, MAX_PROMPTS))]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (echo with logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI allows up to 5; we, as many as chat
    echo: bool = False


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


def create_app(model, tokenizer, *, model_name: str = "SmolLM2-135M-Instruct", max_batch_size: int = 8,
               max_waiting: int = 64, max_seq_len: int | None = None, max_body_bytes: int = 1 << 20,
               api_key: str | None = None, prefix_cache_bytes: int = 256 << 20, adapters: dict | None = None,
               threads: int | None = None, speculative="ngram", kv_cache_dtype: str | None = None,
               prefix_cache_dir: str | Path | None = None) -> FastAPI:
    """The app; its lifespan starts the scheduler threads (each then owns its model) and stops them.
    The defaults are `smollm2 serve`'s but for the KV cache's dtype (tests/test_server.py holds them equal).
    prefix_cache_bytes: memory for the keys and values of prompt prefixes kept for later prompts (0: none), each
    model's own. adapters: more models served beside `model_name`, by name, chosen per request by its `model`
    field: copies of the model with a LoRA adapter merged in (smollm2.lora.with_adapter), sharing every other
    weight with it. Each model has a scheduler (a thread and a KV cache) of its own, running it with `threads`
    CPU threads (default: as many as this thread's; see Scheduler). speculative: how requests guess tokens
    unless they say otherwise: None (they do not), "ngram" (prompt lookup) or a draft model, a smaller SmolLM2
    with the same tokenizer (generation.speculative; the same answers either way), with which each scheduler
    drafts as a copy of its own (own_copy). kv_cache_dtype: what each KV cache stores, "fp32", "bf16" (half fp32's
    memory, perplexity within 0.1%; `smollm2 serve`'s default) or "int8" (smollm2.kv_cache.KVCache); None, the
    model's dtype, gives the answers and log-probabilities of generate() on the same model, bit for bit.
    prefix_cache_dir: a folder where each model's prefix cache also keeps its blocks, as files a later process (or
    another on a shared disk) reads instead of prefilling them again, with the same bits
    (generation.prefix_cache.DiskCache)."""
    if model_name in (adapters or {}):
        raise SmolError(f"an adapter cannot be served as {model_name!r}, the base model's name")
    models = {model_name: model, **(adapters or {})}
    drafted = isinstance(speculative, nn.Module)
    schedulers = {name: Scheduler(m, tokenizer, max_batch_size, max_waiting, max_seq_len,
                                  on_end=lambda request, name=name: metrics.ended(request, name),
                                  prefix_cache_bytes=prefix_cache_bytes, threads=threads,
                                  speculative=own_copy(speculative) if drafted and i else speculative,
                                  kv_cache_dtype=kv_cache_dtype, prefix_cache_dir=prefix_cache_dir)
                  for i, (name, m) in enumerate(models.items())}
    metrics = Metrics(schedulers)
    app = FastAPI(title="smollm2", lifespan=lifespan, dependencies=[Depends(authorize)],
                  exception_handlers=EXCEPTION_HANDLERS)
    app.state.served = served = Served(schedulers, tokenizer, metrics, api_key)
    for routes in (router, responses.router, messages.router, embeddings.router, inspect.router):
        app.include_router(routes)
    page.serve(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Admission, served=served)
    app.add_middleware(CountResponses, metrics=metrics)  # outermost: a 413 from BodyLimit, a 503 while draining count
    return app


def own_copy(model: nn.Module) -> nn.Module:
    """A copy of model for another scheduler's thread: the weights (parameters and buffers, a GGUF file's blocks
    among them) shared, not copied; what running a model changes its own: its accelerator's plans and measured
    choices, its RoPE tables as they grow (SmolLM2.extend_rope). One object run by two threads would have both
    change those under each other."""
    return copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    schedulers = app.state.served.schedulers.values()
    for scheduler in schedulers:
        scheduler.start()
    try:
        yield
    finally:
        for scheduler in schedulers:
            scheduler.stop()


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
    loads = [scheduler.load() for scheduler in served.schedulers.values()]
    return {"status": "ok", **{key: sum(load[key] for load in loads) for key in loads[0]}}


@router.get("/ready")
async def ready(served: AppState):
    """Whether a load balancer may send this server requests: 503 until every model has run its warm-up step (the
    scheduler's, at start), 200 then, 503 again once it drains (SIGTERM)."""
    if served.ready:
        return {"status": "ready"}
    return JSONResponse({"status": "draining" if served.draining else "loading"}, 503)


@router.get("/metrics")
async def prometheus(served: AppState):
    return Response(served.metrics.render(), media_type=served.metrics.content_type)


@router.get("/v1/models")
async def models(served: AppState):
    # meta, as llama.cpp's: what a client (the page) may want to know of the model's shape
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "smollm2",
                                        "meta": meta(scheduler.model.config)}
                                       for name, scheduler in served.schedulers.items()]}


def meta(config) -> dict:
    return dict(n_vocab=config.vocab_size, n_ctx_train=config.max_position_embeddings, n_embd=config.hidden_size,
                n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                n_head_kv=config.num_key_value_heads)


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, served: AppState):
    # add_special: the special tokens the tokenizer's own post-processor adds (SmolLM2's: none).
    return {"tokens": served.tokenizer.backend.encode(body.content, add_special_tokens=body.add_special).ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, served: AppState):
    check_token_ids({f"tokens.{j}": t for j, t in enumerate(body.tokens)}, served.tokenizer.vocab_size)
    return {"content": served.tokenizer.decode(body.tokens)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, connection: Connection, served: AppState):
    scheduler = served.scheduler(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs to be true", param="top_logprobs")
    tools = None
    if body.tools is not None or body.tool_choice is not None:
        tools = Tools(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    messages = [m.chat(i) for i, m in enumerate(body.messages)]
    try:
        prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except FieldError:
        raise  # it names its own field (messages.1.tool_call_id)
    except SmolError as e:  # the template refused these messages, or rendering them ran past its bounds
        raise FieldError("messages", str(e)) from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    return await complete(body, scheduler, [prompt], body.max_completion_tokens or body.max_tokens, connection,
                          Reply(True, body.model, served.tokenizer, logprobs, tools=tools), limit)


@router.post("/v1/completions")
async def completions(body: CompletionBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.scheduler(body.model), served.tokenizer
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    prompts, texts = [], []
    for prompt in body.prompt:
        if isinstance(prompt, str):
            prompts.append(tokenizer.encode(prompt))
            texts.append(prompt)
        else:  # token ids: checked against the vocabulary (SmolError: a 400 naming the id) before decoding
            prompts.append(prompt_rows([prompt], scheduler.model.config.vocab_size)[0] if prompt else [])
            texts.append(tokenizer.decode(prompts[-1]))
    return await complete(body, scheduler, prompts, max_tokens, connection,
                          Reply(False, body.model, tokenizer, body.logprobs, texts if body.echo else None))


async def complete(body: Body, scheduler: Scheduler, prompts: list[list[int]], max_tokens: int | None,
                   connection: Connection, reply: Reply, limit: str = "max_tokens"):
    """Choice p * n + i: prompt p's choice i, a request of its own, seeded seed + i. limit: the field max_tokens
    came in, which an error names."""
    for p, prompt in enumerate(prompts):
        where = "messages" if reply.chat else "prompt" if len(prompts) == 1 else f"prompt.{p}"
        check_room(prompt, max_tokens, scheduler.max_seq_len, where, limit)
    if len(prompts) * body.n > scheduler.max_waiting:  # it could never be queued whole
        raise APIError(400, f"n: {len(prompts)} prompt(s) x n={body.n} choices is {len(prompts) * body.n} "
                       f"requests, more than this server queues ({scheduler.max_waiting})", param="n")
    vocab_size = scheduler.model.config.vocab_size
    check_token_ids({f"stop_token_ids.{j}": t for j, t in enumerate(body.stop_token_ids)}, vocab_size)
    check_token_ids({f"logit_bias.{t}": t for t in body.logit_bias or {}}, vocab_size)
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})",
                       param="min_tokens")
    if body.min_tokens and body.response_format is not None and body.response_format.get("type") != "text":
        raise APIError(400, "min_tokens: cannot be combined with response_format, whose grammar decides where "
                       "the answer ends", param="min_tokens")
    reply.prompts, reply.n = prompts, body.n
    sampling = Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                        logit_bias=body.logit_bias, min_new_tokens=body.min_tokens)
    ask = Ask(prompts, max_tokens, sampling, stop=[*(body.stop or []), *body.stop_token_ids], n=body.n,
              grammar=await grammar(body.response_format, reply.tokenizer, "response_format", reply.tools),
              logprobs=reply.logprobs, prompt_logprobs=reply.logprobs if reply.echo is not None else None,
              speculative=body.speculative,
              hooks=await inspect.steering_hooks(body.steering, scheduler, reply.tokenizer, body.steer, connection))
    requests = submit(scheduler, ask)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(stream(scheduler, requests, reply, usage))
    return reply.whole(*await answers(scheduler, requests, connection))


class Reply:
    """OpenAI's response objects, for chat ("chat.completion") or plain completions ("text_completion").
    logprobs: None, or the number of top tokens each token's log-probabilities list; echo: the prompt's text,
    which a completion's text then starts with (and its tokens, its logprobs); tools: a chat's, whose answers
    are read for tool calls where the model may make them."""

    def __init__(self, chat: bool, model_name: str, tokenizer, logprobs: int | None = None,
                 echo: list[str] | None = None, tools: Tools | None = None):
        self.chat, self.model, self.tokenizer, self.logprobs, self.echo = chat, model_name, tokenizer, logprobs, echo
        self.tools = tools if tools is not None and tools.offered else None
        self.parsers = collections.defaultdict(ToolCallParser)  # each choice's, as its calls stream
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts: list[list[int]] = []  # each prompt's ids, once known; choice c answers prompt c // n
        self.n = 1
        self.offsets = collections.defaultdict(int)  # completions' text_offset, per choice: characters of the
        # text before the next token's

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return dict(id=self.id, object=kind, created=self.created, model=self.model, choices=choices, **extra)

    def echoed(self, index: int) -> str:
        """The text choice `index` starts with: its prompt's, with echo."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def usage(self, dones) -> dict:
        """Each prompt counted once, however many choices."""
        prompt = sum(map(len, self.prompts))
        completion = sum(done.completion_tokens for done in dones)
        return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def format_logprobs(self, items: list[TokenLogprob | None], index: int = 0) -> dict | None:
        """The log-probabilities of some tokens in OpenAI's shape: chat's {"content": [...]}, or completions'
        {tokens, token_logprobs, top_logprobs, text_offset}. None unless the request asked for them."""
        if self.logprobs is None:
            return None
        text = self.tokenizer.token_text
        if self.chat:
            def entry(token, logprob):
                return dict(token=text(token), logprob=logprob, bytes=list(self.tokenizer.token_bytes(token)))
            return {"content": [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
                                for lp in items]}
        out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, lp in enumerate(items):
            if lp is None:  # the prompt's first token (echo): nothing predicts it
                token, logprob, top = text(self.prompts[index // self.n][0]), None, None
            else:
                token, logprob, top = text(lp.token), lp.logprob, {text(t): v for t, v in lp.top}
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
        return out

    def whole(self, texts: list[str], dones: list, logprobs: list[list[TokenLogprob | None]]) -> dict:
        """The whole answer: choice i's text, its end (a scheduler Done) and its tokens' logprobs."""
        choices = []
        for i, (text, done, items) in enumerate(zip(texts, dones, logprobs)):
            if self.chat:
                message, calls = dict(role="assistant", content=text), []
                if self.tools is not None:
                    message["content"], calls = parse_tool_calls(text)
                    if calls:
                        message["tool_calls"] = [call.openai() for call in calls]
                choices.append(dict(index=i, message=message, logprobs=self.format_logprobs(items, i),
                                    finish_reason=tool_finish(done.finish_reason, calls)))
            else:
                choices.append(dict(index=i, text=self.echoed(i) + text, logprobs=self.format_logprobs(items, i),
                                    finish_reason=done.finish_reason))
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage=self.usage(dones))

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: list[TokenLogprob | None] = ()) -> dict | None:
        """A streamed piece of choice `index`; text None: its last piece, which carries the finish_reason.
        None where there is nothing to send: text held back while it may be the start of a tool call."""
        formatted = self.format_logprobs(logprobs, index) if logprobs else None
        if self.chat:
            if role:
                delta = dict(role="assistant", content=text)
            elif self.tools is not None:
                delta = self.tool_delta(index, text)
                if text is None:
                    finish_reason = tool_finish(finish_reason, self.parsers[index].calls)
                elif not delta and not formatted:
                    return None
            else:
                delta = {} if text is None else dict(content=text)
            return self._object("chat.completion.chunk", [dict(index=index, delta=delta, logprobs=formatted,
                                                                finish_reason=finish_reason)])
        return self._object("text_completion", [dict(index=index, text=text or "", logprobs=formatted,
                                                     finish_reason=finish_reason)])

    def tool_delta(self, index: int, text: str | None) -> dict:
        """Choice `index`'s new text as OpenAI streams it: its own text as content, and each call's first piece
        (its index, id and name) then pieces of its arguments as tool_calls (text None: the choice has ended)."""
        parser = self.parsers[index]
        content, pieces = (parser.finish(), []) if text is None else parser.feed(text)
        delta = dict(content=content) if content else {}
        if pieces:
            delta["tool_calls"] = [
                dict(index=p.index, id=p.call.id, type="function", function=dict(name=p.call.name,
                                                                                   arguments=p.arguments))
                if p.first else dict(index=p.index, function=dict(arguments=p.arguments)) for p in pieces]
        return delta

    def usage_chunk(self, dones) -> dict:  # stream_options.include_usage: one more chunk, with no choices
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=self.usage(dones))


def tool_finish(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not cut short) with calls."""
    return "tool_calls" if reason == "stop" and calls else reason


async def stream(scheduler: Scheduler, requests: list[Request], reply: Reply, include_usage: bool):
    try:
        for i, request in enumerate(requests):
            if reply.chat:
                yield sse(reply.chunk(i, "", role=True))
            elif reply.echoed(i) and request.prompt_logprobs is None:
                yield sse(reply.chunk(i, reply.echoed(i)))
        dones, failed = [], False
        async with contextlib.aclosing(merged(requests)) as events:
            async for i, event in events:
                if isinstance(event, PromptLogprobs):
                    yield sse(reply.chunk(i, reply.echoed(i), logprobs=event.logprobs))
                elif isinstance(event, Delta):
                    if (event.text or event.logprobs) and \
                            (chunk := reply.chunk(i, event.text, logprobs=event.logprobs)) is not None:
                        yield sse(chunk)
                elif event.error:  # the status is already sent: the error can only travel in the stream
                    yield sse({"error": dict(message=event.error, type="server_error", param=None, code=None)})
                    failed = True
                    break
                else:
                    dones.append(event)
                    yield sse(reply.chunk(i, None, event.finish_reason))
        if include_usage and not failed:
            yield sse(reply.usage_chunk(dones))
        yield sse("[DONE]")
    finally:
        for request in requests:  # no-op once done; frees the slots when the client went away mid-answer
            scheduler.cancel(request)
