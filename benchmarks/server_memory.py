"""The resident memory of `smollm2 serve` under load: 32 concurrent chat requests with long prompts.

    .venv/bin/python benchmarks/server_memory.py [--clients 32] [--prompt-tokens 1500] [--max-tokens 200]
                                                [--at-most-gb 1.5] [--up-at-most-gb 0.5] [-- SERVE_ARGS...]

Starts the server on the embedded model (SERVE_ARGS are passed on, --kv-cache-dtype say), reads its resident
memory (VmRSS) once it is up, sends --clients chat requests at once, each a different text of about
--prompt-tokens tokens to summarise and --max-tokens greedy tokens to answer, and reads it again once they have
all been answered, then after a second wave (memory a server keeps after its load, not only its peak, is what
grows it). Exits 1 if the memory once up is over --up-at-most-gb (its weights held as the file's blocks, with
the runtime), or after the load over --at-most-gb. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
from pathlib import Path

import httpx
from server_load import process
from serving import free_port

WORDS = ("river mountain library budget council garden winter engine letter market station harbor village "
         "museum forest bridge theatre school hospital festival").split()


def resident_gb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 2**20


def text(i: int, words: int) -> str:
    """A different text for each request (no prefix in common past the template), of about `words` words."""
    return " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{'.' if j % 11 == 10 else ''}" for j in range(words))


async def wave(client: httpx.AsyncClient, model: str, args, start: int) -> None:
    async def ask(i: int):
        r = await client.post("/v1/chat/completions", json=dict(
            model=model, max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "user", "content": f"Summarise this text:\n\n{text(i, args.prompt_tokens)}"}]))
        r.raise_for_status()
    await asyncio.gather(*(ask(start + i) for i in range(args.clients)))


async def measure(args, url: str, pid: int) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        up = resident_gb(pid)
        print(f"up: {up:.2f} GB")
        after = 0.0
        for n in range(2):
            await wave(client, model, args, n * args.clients)
            after = resident_gb(pid)
            print(f"after wave {n + 1} of {args.clients} requests ({args.prompt_tokens}-word prompts, "
                  f"{args.max_tokens} tokens each): {after:.2f} GB")
    return up, after


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1500, help="words of each prompt's text (about as many "
                                                                   "tokens)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--at-most-gb", type=float, default=1.5)
    p.add_argument("--up-at-most-gb", type=float, default=0.5)
    p.add_argument("serve_args", nargs="*", help="after --: more arguments for smollm2 serve")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "smollm2", "serve", "--port", str(port), "--max-waiting", str(args.clients),
               *args.serve_args]
    log = Path(tempfile.mkdtemp(prefix="server_memory-")) / "smollm2.log"
    with process(command, url, log) as server:
        up, after = asyncio.run(measure(args, url, server.pid))
    print(f"{up:.2f} GB once up, bar {args.up_at_most_gb} GB: {'ok' if up <= args.up_at_most_gb else 'OVER'}")
    print(f"{after:.2f} GB after the load, bar {args.at_most_gb} GB: {'ok' if after <= args.at_most_gb else 'OVER'}")
    return 0 if up <= args.up_at_most_gb and after <= args.at_most_gb else 1


if __name__ == "__main__":
    sys.exit(main())
