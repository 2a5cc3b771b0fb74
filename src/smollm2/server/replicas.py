"""Replicas under Ray Serve: `smollm2 serve --replicas N`, or `serve run smollm2.server.replicas:app replicas=N`.

Each replica is a Ray actor, a process of its own, that loads the model itself (Recipe) and answers through
create_app's app, called in process: every route the single server has, streaming included, with its answers.
In front of them, one deployment that takes no CPU (Front) gets each HTTP request from Ray Serve's proxy, reads
its body and hands it to a replica through a deployment handle, whose router (PrefixRouter) sends requests whose
prompts start with the same first prefill chunk (generation.steps.PREFILL_CHUNK tokens, the prefix cache's grain)
to the same replica: the one that holds that chunk's keys and values, so that a conversation's turns, or the
requests sharing a long system prompt, prefill only what is new.

Scaling (Scaling): a fixed number of replicas, or Ray Serve's autoscaling between a least and a most, on the
requests each replica has, running or queued, against its batch's rows.

A replica that dies is replaced by Ray Serve. A request it had not begun answering is sent to another; one whose
answer had begun ends with an error event in its stream (OpenAI's shape, Anthropic's on /v1/messages), since
its client already holds part of the answer; the other replicas' requests never notice.

/health, /ready and /metrics answer for the replica the request reaches (the x-smollm2-replica header names it),
as each process of a fleet does. Ray passes arguments and answers between its processes with its own pickling:
what travels is this module's plain values and the bytes of HTTP requests and answers, never a file's content.
Ray is an optional extra (pip install 'smollm2[ray]'); only this module imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import os
import random
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.requests import Request as Connection
from starlette.responses import JSONResponse, StreamingResponse

from ..errors import SmolError
from ..generation.steps import PREFILL_CHUNK
from ..tokenizer import Tokenizer
from . import defaults
from .app import create_app, load_app

# A Ray cluster this process starts (run() without an address, the tests') is this machine's alone: this has Ray
# give its processes the loopback address, which they listen on, as it does on macOS and Windows, rather than the
# host's network address. Ray reads it once, as it is imported; set it to 1 to join a cluster by its GCS address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter
except ImportError:
    raise SmolError("replicas run under Ray Serve, which is not installed: pip install 'smollm2[ray]'") from None

REPLICA_GONE = RayActorError  # its process died (ActorDiedError) or cannot be reached (ActorUnavailableError)
RETRY_S = 30  # how long a request that no replica has begun answering waits for one to take it (Ray replaces them)
HEADER = "x-smollm2-replica"  # which replica answered


@dataclass(frozen=True)
class Recipe:
    """What each replica loads and serves: load_app's source and keywords (`smollm2 serve`'s: load, lora,
    speculative, threads, and create_app's), plain values that Ray hands to each replica. Its engine threads run
    `threads` CPU threads (default: 1), which is what Ray reserves it."""
    model: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def threads(self) -> int:
        return self.options.get("threads") or 1

    def build(self) -> FastAPI:
        """The single server's app, as `smollm2 serve` loads it; the caller runs its lifespan."""
        return load_app(self.model, **{**self.options, "threads": self.threads})


@dataclass(frozen=True)
class Scaling:
    """`replicas` of them; or, given a least or a most, Ray Serve's autoscaling between them, starting at
    `replicas`, which adds replicas while each has more than `target` requests (running or queued) and removes
    them while fewer. target: a replica's batch rows (create_app's max_batch_size): beyond them, requests queue."""
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target: int = 8

    def options(self) -> dict:
        """The replicas' deployment options: their number, or their autoscaling, and how many requests each is
        given at once: a batch's worth running and one queued to start as rows free; the rest wait in Ray's
        router, where a new replica can take them."""
        least = self.replicas if self.min_replicas is None else self.min_replicas
        most = max(self.replicas, least) if self.max_replicas is None else self.max_replicas
        if not 1 <= least <= self.replicas <= most:
            raise SmolError(f"replicas: need 1 <= --min-replicas ({least}) <= --replicas ({self.replicas}) <= "
                            f"--max-replicas ({most})")
        options = dict(max_ongoing_requests=2 * self.target)
        if self.min_replicas is None and self.max_replicas is None:
            return dict(options, num_replicas=self.replicas)
        return dict(options, autoscaling_config=dict(min_replicas=least, max_replicas=most,
                                                     initial_replicas=self.replicas,
                                                     target_ongoing_requests=self.target))


class PrefixRouter(RequestRouter):
    """Ray Serve's router for the replicas: a request with a key (Front's: its prompt's first chunk) goes to the
    replica its key hashes highest with (rendezvous hashing: a replica added or gone moves only the keys it wins),
    or, while that one has no room, to the one of the others with the fewest requests; one without a key, to the
    one with the fewest, of equals one at random."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # wait a little before asking again, if all full
        key = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if key is None or len(candidate_replicas) < 2:  # in random order: the first of equals wins
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        owner = max(candidate_replicas, key=lambda replica: hashlib.blake2b(
            f"{key}/{replica.replica_id.unique_id}".encode(), digest_size=8).digest())
        return [[owner], [replica for replica in candidate_replicas if replica is not owner]]


# Where each API's body keeps the text its prompt starts with, in the order the prompt has it: Anthropic's system,
# the Responses API's instructions, a completion's prompt; the messages or input items, each by role and content
# (a string, or parts with text).
TEXT_KEYS = ("model", "system", "instructions", "prompt", "messages", "input", "role", "content", "text")


def routing_key(body: bytes, tokenizer: Tokenizer) -> str | None:
    """A hash of the first PREFILL_CHUNK tokens of the request's text, taken as TEXT_KEYS finds it (the model's
    name first, since each model has its own cache), or None where it is shorter: a prompt reuses whole chunks
    only, so requests sharing a first chunk share what a replica's prefix cache holds. Not the chat template's
    exact tokens (that is the replica's work, and each API's own), which the hash need not be: it only has to
    agree between the requests of one conversation. Any body, even one the replica will refuse, gets a key or
    None, never an error: the replica answers it."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    budget = 16 * PREFILL_CHUNK  # characters: more than a chunk's tokens ever take; a huge body is not tokenized
    pieces, todo = [], [data]
    while todo and budget > 0:
        item = todo.pop()
        if isinstance(item, str):
            pieces.append(item[:budget])
            budget -= len(pieces[-1])
        elif isinstance(item, list):
            todo.extend(reversed(item))
        elif isinstance(item, dict):
            todo.extend(reversed([item[key] for key in TEXT_KEYS if key in item]))
    ids = tokenizer.encode("".join(pieces))[:PREFILL_CHUNK]
    if len(ids) < PREFILL_CHUNK:
        return None
    return hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest()


class Replica:
    """One engine: create_app's app, which each call drives in process as an ASGI server would."""

    async def __init__(self, recipe: Recipe):
        self.app = await asyncio.to_thread(recipe.build)  # seconds: meanwhile the replica answers Ray's checks
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # the schedulers' threads
        self.id = serve.get_replica_context().replica_id.unique_id
        # Ray Serve routes no request here before this returns: it waits for /ready's 200 (the warm-up step run).
        while await self.status("/ready") != 200:
            await asyncio.sleep(0.05)

    async def __del__(self):  # Ray Serve's graceful shutdown: the schedulers end their requests and stop
        await self.lifespan.__aexit__(None, None, None)

    async def status(self, path: str) -> int:
        async with contextlib.aclosing(self.forward(None, dict(method="GET", path=path))) as answer:
            return (await anext(answer))[0]

    async def forward(self, key: str | None, request: dict):
        """The app's answer to `request` (method, path, query, headers, body), as it goes: first (status,
        headers), then the body's pieces. key: the router's (PrefixRouter), not read here. Cancelled (the
        client went away), the app's own task is cancelled, which cancels the request's rows."""
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in request.get("headers", [])]
        scope = dict(type="http", asgi=dict(version="3.0"), http_version="1.1", method=request["method"],
                     scheme="http", path=request["path"], raw_path=request["path"].encode(), root_path="",
                     query_string=request.get("query", "").encode("latin-1"), headers=headers,
                     client=("127.0.0.1", 0), server=("127.0.0.1", 0))
        messages: asyncio.Queue = asyncio.Queue()
        body = [dict(type="http.request", body=request.get("body", b""), more_body=False)]

        async def receive():
            if body:
                return body.pop()
            await asyncio.Event().wait()  # the client never leaves here: our caller cancels the answer instead

        task = asyncio.create_task(self.app(scope, receive, messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield message["status"], [(name.decode("latin-1"), value.decode("latin-1"))
                                              for name, value in message.get("headers", [])] + [(HEADER, self.id)]
                elif message.get("body"):
                    yield message["body"]
            await task  # an exception the app let out (none should: every one is an error response)
        finally:
            task.cancel()


class Front:
    """The endpoint: each HTTP request, read whole (up to the replicas' body limit, whose 413 they answer), goes
    to a replica by its routing key, and its answer comes back as the replica sends it."""

    def __init__(self, replicas, tokenizer_source: str | None, max_body_bytes: int):
        self.replicas = replicas.options(stream=True)
        self.tokenizer = Tokenizer.from_pretrained(tokenizer_source)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, connection: Connection):
        pieces, size = [], 0
        async for piece in connection.stream():
            pieces.append(piece)
            size += len(piece)
            if size > self.max_body_bytes:
                break
        body = b"".join(pieces)
        key = routing_key(body, self.tokenizer) if len(body) <= self.max_body_bytes else None
        request = dict(method=connection.method, path=connection.url.path, query=connection.url.query,
                       headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in connection.headers.raw],
                       body=body)
        anthropic = connection.url.path.startswith("/v1/messages")
        deadline = asyncio.get_running_loop().time() + RETRY_S
        while True:
            answer = self.replicas.forward.remote(key, request)
            try:
                status, headers = await anext(answer)
                break
            except REPLICA_GONE:  # nothing of it was sent: another replica can answer it from the start
                if asyncio.get_running_loop().time() > deadline:
                    return JSONResponse(error(anthropic, "no replica could answer the request"), 503)
                await asyncio.sleep(0.5)
        response = StreamingResponse(rest(answer, anthropic), status)
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return response


async def rest(answer, anthropic: bool):
    """An answer's body after its start; where its replica dies on the way, an error event ends it. Closed
    early (the client went away), the replica's answer is cancelled, which frees its rows."""
    try:
        async for piece in answer:
            yield piece
    except REPLICA_GONE:
        message = "the replica answering this request stopped; send it again"
        if anthropic:
            yield f"event: error\ndata: {json.dumps(error(True, message))}\n\n".encode()
        else:
            yield f"data: {json.dumps(error(False, message))}\n\n".encode()
    finally:
        answer.cancel()  # nothing to do once it has ended


def error(anthropic: bool, message: str) -> dict:
    if anthropic:
        return {"type": "error", "error": {"type": "api_error", "message": message}}
    return {"error": dict(message=message, type="server_error", param=None, code="replica_unavailable")}


def application(recipe: Recipe, scaling: Scaling, routing: str = "prefix"):
    """The Ray Serve application: Front before `scaling`'s replicas of `recipe`. routing: "prefix" (PrefixRouter)
    or "random" (Ray Serve's own: two replicas at random, the one with fewer requests)."""
    if routing not in ("prefix", "random"):
        raise SmolError(f"routing must be prefix or random, not {routing!r}")
    router = {} if routing == "random" else dict(request_router_config=RequestRouterConfig(
        request_router_class=PrefixRouter))
    replicas = serve.deployment(Replica, name="Replica", ray_actor_options=dict(num_cpus=recipe.threads),
                                **scaling.options(), **router)
    front = serve.deployment(Front, name="Front", ray_actor_options=dict(num_cpus=0), max_ongoing_requests=4096)
    limit = recipe.options.get("max_body_bytes",
                               inspect.signature(create_app).parameters["max_body_bytes"].default)
    return front.bind(replicas.bind(recipe), recipe.model, limit)


def app(args: dict[str, str]):
    """For `serve run smollm2.server.replicas:app KEY=VALUE...` (Ray Serve's application builder): model=SRC,
    replicas=N, min_replicas=N, max_replicas=N, threads=N (each replica's), max_batch_size=N, kv_cache_dtype=
    fp32|bf16|int8, prefix_cache_dir=DIR, api_key=KEY, routing=prefix|random. For anything else, build a Recipe
    and call application()."""
    known = {"model", "replicas", "min_replicas", "max_replicas", "threads", "max_batch_size", "kv_cache_dtype",
             "prefix_cache_dir", "api_key", "routing"}
    if unknown := sorted(set(args) - known):
        raise SmolError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    def number(name: str, default: int | None) -> int | None:
        if name not in args:
            return default
        if not args[name].isdigit() or int(args[name]) < 1:
            raise SmolError(f"{name} must be a whole number of at least 1, not {args[name]!r}")
        return int(args[name])

    rows = number("max_batch_size", defaults.MAX_BATCH_SIZE)
    options = dict(max_batch_size=rows, threads=number("threads", 1),
                   kv_cache_dtype=args.get("kv_cache_dtype", defaults.SERVE_KV_CACHE_DTYPE),  # as `smollm2 serve`
                   prefix_cache_dir=args.get("prefix_cache_dir"), api_key=args.get("api_key"))
    recipe = Recipe(args.get("model"), options)
    scaling = Scaling(number("replicas", 1), number("min_replicas", None), number("max_replicas", None), rows)
    return application(recipe, scaling, args.get("routing", "prefix"))


def run(recipe: Recipe, scaling: Scaling, host: str, port: int, ray_address: str | None = None) -> None:
    """`smollm2 serve --replicas N`: serve on host:port until Ctrl-C, on a Ray cluster started here (this machine's
    CPUs, or as many as the most replicas reserve; on 127.0.0.1) and stopped after, or on the one at ray_address
    (ray.init's address), from which the application is removed after; where Ray Serve already runs there, its HTTP
    address stays what it is."""
    if recipe.options.get("load", {}).get("device", "cpu") != "cpu":
        raise SmolError("--replicas: replicas run on the CPU (--device cpu)")
    scaling.options()  # bad numbers fail before Ray starts
    if ray_address is None:
        most = max(scaling.replicas, scaling.max_replicas or 0) * recipe.threads
        ray.init(num_cpus=max(os.cpu_count() or 1, most), include_dashboard=False)
    else:
        ray.init(address=ray_address)
    try:
        serve.start(http_options=dict(host=host, port=port))
        serve.run(application(recipe, scaling), name="smollm2", route_prefix="/", blocking=True)
    finally:
        if ray_address is None:
            serve.shutdown()
        else:
            serve.delete("smollm2")  # the cluster's Serve, and what else it serves, go on
        ray.shutdown()
