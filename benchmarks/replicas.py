"""Replicas under Ray Serve (smollm2.server.replicas): 1 replica against 2, and prefix routing against random.

    .venv/bin/python benchmarks/replicas.py [--clients 16] [--requests 32] [--max-tokens 48]
                                            [--conversations 8] [--turns 4] [--routing-replicas 2] [--no-speed]

One local Ray cluster of --cpus CPUs (default: 2); each replica serves the embedded model with 1 thread (one CPU).

Speed: --requests greedy chat questions, each asked once and answering --max-tokens tokens, --clients at a time,
to 1 replica and then to 2, the same load; the figure is generated tokens per second of wall time, and the ratio
2 replicas / 1. The client, Ray Serve's proxy and the front deployment run on the same CPUs as the replicas.

Prefix routing: on --routing-replicas replicas, --conversations chats at once, each of --turns turns in order
(each turn the whole history again, answers included), each chat with a system prompt of its own longer than one
prefill chunk (PREFILL_CHUNK tokens), as a conversation with an agent's long instructions: after a chat's first
turn, each later turn can find that chunk in the cache of the replica that computed it. Run twice on replicas
started afresh: routed by the prompt's first chunk (PrefixRouter) and by Ray Serve's own router (two replicas at
random, the one with fewer requests). The figure is the prefix cache's hit rate, hit tokens over the prompt tokens looked up, summed over the
replicas (each replica's /metrics, which the x-smollm2-replica header tells apart), and the time the chats took.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import time

import httpx

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as replicas.py: the cluster on 127.0.0.1
import ray  # noqa: E402
from ray import serve  # noqa: E402

from smollm2.server.replicas import HEADER, Recipe, Scaling, application  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
WORDS = ("river stone light market engine garden letter winter signal harbor ledger orbit thread valley "
         "canvas beacon meadow lantern circuit compass").split()
COUNTERS = ("smollm2_prefix_cache_queried_tokens_total", "smollm2_prefix_cache_hit_tokens_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


def started(replicas: int, routing: str, port: int, recipe: Recipe) -> str:
    serve.run(application(recipe, Scaling(replicas), routing), name="smollm2", route_prefix="/")
    return f"http://127.0.0.1:{port}"


async def speed(url: str, requests: int, clients: int, max_tokens: int, tag: str) -> float:
    """Generated tokens per second, --requests questions, --clients at a time."""
    gate = asyncio.Semaphore(clients)

    async def one(client, i):
        async with gate:
            body = dict(model=NAME, max_tokens=max_tokens, temperature=0, messages=[dict(
                role="user", content=f"Write a long story ({tag} {i}) about a {WORDS[i % len(WORDS)]}.")])
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, i) for i in range(requests))))
        return tokens / (time.perf_counter() - start)


async def conversations(url: str, count: int, turns: int) -> float:
    """The chats' wall time, in seconds."""
    rng = random.Random(0)

    async def chat(client, c):
        system = f"You are agent {c}. Your instructions: " + " ".join(rng.choice(WORDS) for _ in range(700))
        messages = [dict(role="system", content=system)]
        for t in range(turns):
            messages.append(dict(role="user", content=f"Question {t}: name a {WORDS[(c + t) % len(WORDS)]}."))
            r = await client.post("/v1/chat/completions", json=dict(model=NAME, messages=messages, max_tokens=16,
                                                                     temperature=0))
            r.raise_for_status()
            messages.append(r.json()["choices"][0]["message"])

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(chat(client, c) for c in range(count)))
        return time.perf_counter() - start


def prefix_counts(url: str, replicas: int) -> tuple[float, float]:
    """Queried and hit prompt tokens, summed over the replicas: /metrics until each replica has answered it."""
    seen = {}
    for _ in range(200):
        r = httpx.get(f"{url}/metrics", timeout=30)
        seen[r.headers[HEADER]] = [float(re.search(rf"^{name} (\S+)$", r.text, re.M).group(1)) for name in COUNTERS]
        if len(seen) == replicas:
            break
    assert len(seen) == replicas, f"only {len(seen)} of {replicas} replicas answered /metrics"
    return tuple(sum(counts[i] for counts in seen.values()) for i in range(2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpus", type=int, default=2, help="the Ray cluster's")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--routing-replicas", type=int, default=2, help="replicas for the routing runs (more than --cpus "
                                                                     "share the CPUs: their hit rates still count)")
    p.add_argument("--no-speed", action="store_true", help="the routing runs alone")
    args = p.parse_args()

    recipe = Recipe(options=dict(threads=1))  # create_app's defaults (the model's dtype in the KV cache), one thread
    cpus = max(args.cpus, args.routing_replicas)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, Ray cluster of {cpus}; load average before: "
          f"{os.getloadavg()[0]:.2f}")
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options=dict(host="127.0.0.1", port=port))
    try:
        rates = {}
        for replicas in () if args.no_speed else (1, 2):
            url = started(replicas, "prefix", port, recipe)
            asyncio.run(speed(url, 2 * replicas, 2 * replicas, 4, "warm-up"))
            rates[replicas] = asyncio.run(speed(url, args.requests, args.clients, args.max_tokens, "timed"))
            serve.delete("smollm2")
            print(f"{replicas} replica(s): {rates[replicas]:.1f} generated tokens/s "
                  f"({args.requests} requests, {args.clients} at a time, {args.max_tokens} tokens each)", flush=True)
        if rates:
            print(f"2 replicas / 1: {rates[2] / rates[1]:.2f}x")

        for routing in ("prefix", "random"):
            url = started(args.routing_replicas, routing, port, recipe)
            seconds = asyncio.run(conversations(url, args.conversations, args.turns))
            queried, hit = prefix_counts(url, args.routing_replicas)
            serve.delete("smollm2")
            print(f"{routing} routing, {args.routing_replicas} replicas: prefix cache hit rate {hit / queried:.1%} "
                  f"({hit:.0f} of {queried:.0f} prompt tokens), {args.conversations} chats of {args.turns} turns in "
                  f"{seconds:.1f} s", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
