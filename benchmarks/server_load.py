"""Load test for `smollm2 serve`: many concurrent streaming clients against one server.

    .venv/bin/python benchmarks/server_load.py [--clients 32] [--max-tokens 64] [--url http://127.0.0.1:8000]

Without --url it starts a server in this process (the embedded model, or --model) with --max-batch-size slots.
Every client asks its own greedy chat question. The script first serves them one at a time (the baseline), then
all at once, streamed; it checks that every client completes and that every answer equals its served-alone one,
and prints the aggregate generated tokens/s of both runs and their ratio: what continuous batching buys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
from serving import Serving

TOPICS = ["the sea", "mountains", "bread", "the moon", "bees", "trains", "music", "winter", "rivers", "chess",
          "volcanoes", "coffee", "owls", "bridges", "rain", "libraries", "deserts", "bicycles", "clocks", "tea",
          "forests", "comets", "cats", "islands", "glass", "maps", "thunder", "gardens", "whales", "paper",
          "castles", "salt"]


def serving(args) -> Serving:
    """The model served in a background thread on a free port (a `with` gives its base URL)."""
    from smollm2 import SmolLM2, Tokenizer
    from smollm2.server import create_app

    return Serving(create_app(SmolLM2.from_pretrained(args.model), Tokenizer.from_pretrained(args.model),
                              model_name="model", max_batch_size=args.max_batch_size or args.clients,
                              max_waiting=args.clients, max_seq_len=args.max_seq_len))


async def ask(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    """One streamed greedy chat answer: (text, generated tokens)."""
    text, tokens = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text), tokens


async def run(args, url: str) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [dict(model=model, temperature=0, max_tokens=args.max_tokens, stream=True,
                       stream_options={"include_usage": True},
                       messages=[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} ({i})."}])
                  for i in range(args.clients)]

        start = time.perf_counter()
        alone = [await ask(client, body) for body in bodies]
        alone_s = time.perf_counter() - start

        start = time.perf_counter()
        results = await asyncio.gather(*(ask(client, body) for body in bodies), return_exceptions=True)
        together_s = time.perf_counter() - start

    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    differ = [i for i, r in enumerate(results) if i not in failed and r != alone[i]]
    tokens = sum(n for _, n in alone)
    alone_rate, together_rate = tokens / alone_s, tokens / together_s
    print(f"{args.clients} clients x up to {args.max_tokens} tokens, {tokens} generated tokens in all")
    print(f"one at a time: {alone_s:7.2f} s, {alone_rate:8.1f} tokens/s")
    print(f"concurrent:    {together_s:7.2f} s, {together_rate:8.1f} tokens/s")
    print(f"speed-up:      {together_rate / alone_rate:7.2f}x")
    for i in failed:
        print(f"client {i} failed: {results[i]!r}", file=sys.stderr)
    for i in differ:
        print(f"client {i}: concurrent answer differs from its served-alone one", file=sys.stderr)
    print("all complete, all equal to served alone" if not failed and not differ else
          f"{len(failed)} failed, {len(differ)} differ")
    return 1 if failed or differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one in this process)")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", help="what the started server loads (default: the embedded model)")
    p.add_argument("--max-batch-size", type=int, help="slots of the started server (default: --clients)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="context per slot of the started server")
    args = p.parse_args()
    if args.url:
        return asyncio.run(run(args, args.url))
    with serving(args) as url:
        return asyncio.run(run(args, url))


if __name__ == "__main__":
    sys.exit(main())
