"""What a restart costs a long prompt with and without the prefix cache on disk (`smollm2 serve --prefix-cache-dir`).

    .venv/bin/python benchmarks/prefix_cache_disk.py [--model SRC] [--prompt-tokens 1500] [--prompts 3] [--threads 2]

Starts `smollm2 serve` with an empty cache folder and sends --prompts prompts of --prompt-tokens tokens (token ids,
max_tokens 1, greedy, with log-probabilities): each is prefilled cold and written to disk. Then starts a second
server on the same folder (a restart: nothing in memory) and sends the same prompts, which it reads from disk.
Each server first answers another prompt of the same length, untimed, so that neither side pays for a first
call's costs. Prints each prompt's time (the whole request) cold and from disk, the prompt tokens each server
prefilled for them (/metrics), and whether the answers and log-probabilities are the same; exits 1 if any
differs or the median speed-up is under 5x.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args, directory: str):
    """`smollm2 serve` on 127.0.0.1 with its prefix cache in `directory`; yields an httpx client once /ready."""
    port = free_port()
    command = [sys.executable, "-m", "smollm2", "serve", "--port", str(port), "--threads", str(args.threads),
               "--prefix-cache-dir", directory]
    process = subprocess.Popen(command + (["--model", args.model] if args.model else []),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            deadline = time.monotonic() + 600
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/ready").status_code == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    sys.exit("the server did not start")
                time.sleep(0.2)
            yield client
    finally:
        process.terminate()
        process.wait(timeout=60)


def prefilled(client: httpx.Client) -> float:
    return next(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
                if line.startswith("smollm2_prefilled_tokens_total "))


def answer(client: httpx.Client, prompt: list[int]) -> tuple[float, dict, float]:
    """The request's time, its choice (token, log-probabilities) and the prompt tokens prefilled for it."""
    before, name = prefilled(client), client.get("/v1/models").json()["data"][0]["id"]
    sent = time.perf_counter()
    r = client.post("/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=1, temperature=0, logprobs=2))
    took = time.perf_counter() - sent
    r.raise_for_status()
    return took, r.json()["choices"][0], prefilled(client) - before


def prompts(args) -> list[list[int]]:
    """--prompts + 2 prompts of --prompt-tokens tokens (the last two: each server's untimed first)."""
    from smollm2 import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model)
    out = []
    for k in range(args.prompts + 2):
        text = " ".join(f"Log {k}.{i}: shipment {k * 1000 + i} left dock {i % 9} at {8 + i % 10}:{i % 6}0 with "
                        f"{3 + i % 11} crates." for i in range(args.prompt_tokens // 8))
        ids = tokenizer.encode(text)[:args.prompt_tokens]
        assert len(ids) == args.prompt_tokens, "make the text longer"
        out.append(ids)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as smollm2 serve's (default: the embedded model)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    *timed, first_cold, first_disk = prompts(args)
    with tempfile.TemporaryDirectory() as directory:
        runs = {}
        for side, first in (("cold", first_cold), ("disk", first_disk)):
            with server(args, directory) as client:
                answer(client, first)
                runs[side] = [answer(client, prompt) for prompt in timed]
    same = all(cold[1] == disk[1] for cold, disk in zip(runs["cold"], runs["disk"]))
    print(f"{args.prompt_tokens}-token prompts, {args.threads} threads, serve's defaults (bf16 KV cache)")
    print("prompt | cold s | tokens prefilled | from disk s | tokens prefilled | speed-up")
    for k, (cold, disk) in enumerate(zip(runs["cold"], runs["disk"])):
        print(f"{k} | {cold[0]:.3f} | {cold[2]:.0f} | {disk[0]:.3f} | {disk[2]:.0f} | {cold[0] / disk[0]:.1f}x")
    speedup = statistics.median(cold[0] / disk[0] for cold, disk in zip(runs["cold"], runs["disk"]))
    print(f"median speed-up {speedup:.1f}x; answers and log-probabilities {'the same' if same else 'DIFFER'}")
    if not same or speedup < 5:
        sys.exit(1)


if __name__ == "__main__":
    main()
