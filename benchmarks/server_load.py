"""Serving speed: `smollm2 serve` beside llama.cpp's llama-server, the same model file, threads and rows.

    .venv/bin/python benchmarks/llamacpp.py --build-server        # once: llama-server into the user's cache
    .venv/bin/python benchmarks/server_load.py [--clients 32] [--max-tokens 48] [--rounds 2]

Both servers run as processes of their own on free loopback ports, serving the embedded model (or --model, a
GGUF file) with --threads threads and --slots rows decoded together (llama-server's -np), each row holding
--max-seq-len tokens. A light client (httpx, in this process) asks greedy chat questions, each for
--max-tokens tokens, four ways: --sequential requests one at a time, and --clients requests at once; each
streamed and not. The systems take turns, mode by mode, for --rounds rounds (the order swapped each round), so
a busy machine slows both alike; the best round of each counts. The figure is generated tokens (the answers'
usage.completion_tokens) per second of wall time, and the ratio is smollm2 / llama-server; the run fails (exit 1)
where a ratio is under --at-least (1.0), a request failed or an answer fell short.

The answers differ between the two (different kernels); the check is that every request completes with
--max-tokens tokens: llama-server is asked to ignore its end-of-text token (its own extension), and smollm2 answers
questions that take longer. Every question is asked once (the round and mode are part of it), so neither server
answers from its prompt cache what it prefilled before, in an earlier round or mode. That smollm2's answers do not
change with batching is tests/test_same_request.py's concern.

--url measures one running server instead (any OpenAI-compatible one), --no-llama-server smollm2 alone.
--omp-wait-policy and --taskset run the smollm2 server under another OpenMP or CPU behaviour than the machine's
(idle OpenMP workers that sleep or spin; fewer cores than --threads), to see whether a gap depends on it.

A whole answer costs the server no more than a streamed one: the engine thread does the same work for both, and
the event loop less. Where whole answers measured slower (down to 0.63x the streamed ones), the first timed mode
had paid for the kernels' first measurements of a kind of prompt pass; the warm-up now meets those kinds, and
whole and streamed swap places each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from llamacpp import server_binary
from serving import free_port

TOPICS = ["the sea", "mountains", "bread", "the moon", "bees", "trains", "music", "winter", "rivers", "chess",
          "volcanoes", "coffee", "owls", "bridges", "rain", "libraries", "deserts", "bicycles", "clocks", "tea",
          "forests", "comets", "cats", "islands", "glass", "maps", "thunder", "gardens", "whales", "paper",
          "castles", "salt"]
MODES = [("one at a time", False), ("one at a time", True), ("concurrent", False), ("concurrent", True)]


@contextlib.contextmanager
def process(command: list[str], url: str, log_path: Path, env: dict | None = None, timeout: float = 300):
    """A server process (the Popen), once it answers GET /health with 200; stopped (SIGTERM, then SIGKILL) on
    leaving."""
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise SystemExit(f"{command[0]} exited ({server.returncode}); its log: {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not start in {timeout:g} s; its log: {log_path}")
            time.sleep(0.2)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def smollm2_command(args, port: int) -> list[str]:
    model = ["--model", args.model] if args.model else []
    pinned = ["taskset", "-c", args.taskset] if args.taskset else []
    return [*pinned, sys.executable, "-m", "smollm2", "serve", *model, "--port", str(port),
            "--threads", str(args.threads), "--max-batch-size", str(args.slots), "--max-seq-len", str(args.max_seq_len),
            "--max-waiting", str(args.clients)]


def llama_server_command(args, binary: Path, model: str, port: int) -> list[str]:
    # -c is the whole KV cache, shared out among the -np slots; --temp 0: greedy unless a request says otherwise
    return [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
            "-tb", str(args.threads), "-np", str(args.slots), "-c", str(args.slots * args.max_seq_len),
            "--temp", "0", "--no-webui"]


async def ask(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    """One greedy chat answer, streamed or not as the body says: (text, generated tokens)."""
    if not body["stream"]:
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        answer = r.json()
        return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
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


def bodies(args, model: str, count: int, stream: bool, tag: str) -> list[dict]:
    """Questions no server has seen (`tag` names the round and mode): none answers from its prompt cache."""
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    return [dict(model=model, temperature=0, max_tokens=args.max_tokens, stream=stream, **usage, ignore_eos=True,
                 messages=[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} ({tag}.{i})."}])
            for i in range(count)]


async def timed(client: httpx.AsyncClient, requests: list[dict], concurrent: bool) -> tuple[float, list]:
    """Seconds for all the requests, and their (text, tokens) answers (an exception for each that failed)."""
    start = time.perf_counter()
    if concurrent:
        answers = await asyncio.gather(*(ask(client, body) for body in requests), return_exceptions=True)
    else:
        answers = []
        for body in requests:
            try:
                answers.append(await ask(client, body))
            except Exception as e:  # noqa: BLE001 (counted as a failure, reported below)
                answers.append(e)
    return time.perf_counter() - start, answers


async def measure(args, urls: dict[str, str]) -> int:
    """Every mode, each system in turn; prints the table and returns 1 if a request failed or fell short."""
    best = {(system, mode): 0.0 for system in urls for mode in MODES}
    failures = []
    async with contextlib.AsyncExitStack() as stack:
        # No connection is reused: llama-server closes some kept alive (those idle for 5 s, while the other
        # system is timed, and now and then one just after a streamed answer), which fails the next request on it.
        limits = httpx.Limits(max_keepalive_connections=0)
        clients = {system: await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=None,
                                                                             limits=limits))
                   for system, url in urls.items()}
        models = {system: (await client.get("/v1/models")).json()["data"][0]["id"]
                  for system, client in clients.items()}
        # Warm-up, untimed: smollm2 times its kernels the first time a process meets a kind of prompt pass (rows
        # rounded up to a power of two; again in later processes while a choice is a close call): one request alone
        # and --clients at once meet the kinds the timed modes do. Without it the first timed mode paid for it.
        for system, client in clients.items():
            await timed(client, bodies(args, models[system], 1, False, "warm-up"), concurrent=False)
            await timed(client, bodies(args, models[system], args.clients, False, "warm-up"), concurrent=True)
        for round_ in range(args.rounds):
            # whole and streamed swap places each round too: neither is always the one that meets a shape first
            for name, stream in MODES if round_ % 2 == 0 else [(n, not s) for n, s in MODES]:
                concurrent = name == "concurrent"
                count = args.clients if concurrent else args.sequential
                order = list(clients) if round_ % 2 == 0 else list(clients)[::-1]
                for system in order:
                    tag = f"{round_}{name[0]}{'s' if stream else 'w'}"
                    seconds, answers = await timed(clients[system], bodies(args, models[system], count, stream, tag),
                                                   concurrent)
                    failed = [a for a in answers if isinstance(a, BaseException)]
                    failures += [f"{system}, {name}, {'streamed' if stream else 'whole'}: {a!r}" for a in failed]
                    tokens = sum(a[1] or 0 for a in answers if not isinstance(a, BaseException))
                    short = sum(1 for a in answers if not isinstance(a, BaseException) and a[1] != args.max_tokens)
                    if short:
                        failures.append(f"{system}, {name}: {short} answers shorter than {args.max_tokens} tokens")
                    rate = tokens / seconds
                    best[system, (name, stream)] = max(best[system, (name, stream)], rate)
                    print(f"round {round_ + 1}: {system:<13}{name:<15}{'streamed' if stream else 'whole':<10}"
                          f"{len(answers)} requests, {tokens} tokens in {seconds:6.2f} s: {rate:7.1f} tok/s",
                          file=sys.stderr, flush=True)

    print(f"{args.slots} rows, {args.threads} threads, {args.max_tokens} greedy tokens a request: "
          f"{args.sequential} one at a time, {args.clients} concurrent; generated tok/s, best of {args.rounds}")
    systems = list(urls)
    print(f"{'mode':<26}" + "".join(f"{system:>14}" for system in systems)
          + (f"{'ratio':>9}" if len(systems) == 2 else ""))
    for name, stream in MODES:
        rates = [best[system, (name, stream)] for system in systems]
        print(f"{name + (', streamed' if stream else ', whole'):<26}" + "".join(f"{r:>14.1f}" for r in rates)
              + (f"{ratio(best, systems, (name, stream)):>8.2f}x" if len(rates) == 2 else ""))
    if len(systems) == 2:
        failures += [f"{name}, {'streamed' if stream else 'whole'}: smollm2 at {rate:.2f}x llama-server's speed, "
                     f"under the --at-least {args.at_least}x required"
                     for name, stream in MODES if (rate := ratio(best, systems, (name, stream))) < args.at_least]
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{len(failures)} failures" if failures else f"all complete, {args.max_tokens} tokens each")
    return 1 if failures else 0


def ratio(best: dict, systems: list[str], mode: tuple[str, bool]) -> float:
    ours, theirs = (best[system, mode] for system in systems)
    return ours / theirs if theirs else float("inf")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="measure this running server alone (default: start both)")
    p.add_argument("--no-llama-server", action="store_true", help="start smollm2 alone")
    p.add_argument("--llama-server", type=Path, default=server_binary("native"),
                   help="the llama-server binary (default: the one llamacpp.py --build-server built)")
    p.add_argument("--model", help="a GGUF file both serve (default: the embedded model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-seq-len", type=int, default=1024, help="tokens a row holds")
    p.add_argument("--clients", type=int, default=32, help="requests at once")
    p.add_argument("--sequential", type=int, default=8, help="requests one at a time")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--at-least", type=float, default=1.0, metavar="RATIO",
                   help="fail (exit 1) where smollm2 serves slower than this times llama-server (default 1.0)")
    p.add_argument("--smollm2-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the smollm2 server alone (repeatable), OMP_WAIT_POLICY say")
    p.add_argument("--omp-wait-policy", choices=["active", "passive"],
                   help="OpenMP's wait policy for the smollm2 server alone (OMP_WAIT_POLICY): idle workers spin "
                        "or sleep")
    p.add_argument("--taskset", metavar="CPUS",
                   help="run the smollm2 server on these CPUs alone (taskset -c CPUS, as 0 or 0,1): fewer cores "
                        "than --threads oversubscribes them")
    args = p.parse_args()
    if args.url:
        return asyncio.run(measure(args, {"server": args.url}))
    if not args.no_llama_server and not args.llama_server.is_file():
        p.error(f"no llama-server at {args.llama_server}: build it (benchmarks/llamacpp.py --build-server), "
                "name it (--llama-server), or leave it out (--no-llama-server)")
    from smollm2.checkpoints import default_model_path

    model = args.model or str(default_model_path())
    logs = Path(tempfile.mkdtemp(prefix="server_load-"))  # kept: a server that fails tells why in its log
    print(f"the servers' logs: {logs}", file=sys.stderr)
    env = {**os.environ, **dict(setting.split("=", 1) for setting in args.smollm2_env)}
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    with contextlib.ExitStack() as stack:
        ours, theirs = free_port(), free_port()
        urls = {"smollm2": f"http://127.0.0.1:{ours}"}
        stack.enter_context(process(smollm2_command(args, ours), urls["smollm2"], logs / "smollm2.log", env))
        if not args.no_llama_server:
            urls["llama-server"] = f"http://127.0.0.1:{theirs}"
            stack.enter_context(process(llama_server_command(args, args.llama_server, model, theirs),
                                        urls["llama-server"], logs / "llama-server.log"))
        return asyncio.run(measure(args, urls))


if __name__ == "__main__":
    sys.exit(main())
