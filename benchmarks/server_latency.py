"""What a server's users wait for: time to first token of a long chat's turns with the prefix cache on and off,
and the longest pause of running streams while a long prompt arrives.

    .venv/bin/python benchmarks/server_latency.py chat [--turns 5] [--rounds 2]
    .venv/bin/python benchmarks/server_latency.py long-prompt [--prompt-tokens 2000] [--streams 4]

`chat`: one chat of --turns turns, its whole history sent each turn (as chat clients do), each user message
~300 tokens; served with the prefix cache and without, in turns (rounds alternate, best per side), both servers
in this process on the same model. Prints each turn's prompt length and time to first token (streamed: the
first content chunk), side by side, and checks the answers are the same.

`long-prompt`: --streams greedy streams decode; once each has its first tokens, one more request brings a
--prompt-tokens prompt. Prints the longest gap between two tokens of the running streams while it is
prefilled, and its own time to first token. Run with PYTHONPATH pointing at another checkout's src to measure
that version (the script uses only create_app's long-standing arguments).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serving import Serving

NAME = "smollm2"


def stream_times(url: str, body: dict) -> tuple[str, list[float], float]:
    """POST a streamed request; its text, the arrival time of each content chunk, and when it was sent."""
    sent, times, text = time.perf_counter(), [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=dict(body, stream=True), timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            content = choices[0].get("delta", {}).get("content")
            if content:
                times.append(time.perf_counter())
                text.append(content)
    return "".join(text), times, sent


def user_message(turn: int) -> str:
    facts = " ".join(f"Fact {turn}.{i}: shipment {turn * 100 + i} left dock {i % 9} at {8 + i % 10}:{i % 6}0."
                     for i in range(18))
    return f"Here is part {turn + 1} of the log. {facts} Summarise part {turn + 1} in one sentence."


def chat(args) -> None:
    from smollm2 import Tokenizer, load
    from smollm2.server import create_app

    model, tokenizer = load(args.model), Tokenizer.from_pretrained(args.model)
    results = {True: [], False: []}  # prefix cache on/off -> per round, per turn: (prompt tokens, ttft, text)
    for _ in range(args.rounds):
        for cached in (True, False):
            app = create_app(model, tokenizer, model_name=NAME, prefix_cache_bytes=(1 << 30) if cached else 0)
            messages, turns = [], []
            with Serving(app) as url:
                for turn in range(args.turns):
                    messages.append({"role": "user", "content": user_message(turn)})
                    prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
                    text, times, sent = stream_times(url, dict(model=NAME, messages=messages, max_tokens=48,
                                                               temperature=0))
                    turns.append((prompt, times[0] - sent, text))
                    messages.append({"role": "assistant", "content": text})
            results[cached].append(turns)
    same = all(a[2] == b[2] for r_on, r_off in zip(results[True], results[False]) for a, b in zip(r_on, r_off))
    print(f"{'turn':>4} {'prompt tokens':>13} {'TTFT cache on':>14} {'TTFT cache off':>15} {'off/on':>7}")
    for turn in range(args.turns):
        on = min(r[turn][1] for r in results[True])
        off = min(r[turn][1] for r in results[False])
        print(f"{turn + 1:>4} {results[True][0][turn][0]:>13} {on:>13.3f}s {off:>14.3f}s {off / on:>6.2f}x")
    print(f"answers identical with and without the cache: {same}")


def long_prompt(args) -> None:
    from smollm2 import Tokenizer, load
    from smollm2.server import create_app

    model, tokenizer = load(args.model), Tokenizer.from_pretrained(args.model)
    filler = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    ids = tokenizer.encode(filler)[:args.prompt_tokens]
    long_text = tokenizer.decode(ids)
    worst = []
    for _ in range(args.rounds):
        with Serving(create_app(model, tokenizer, model_name=NAME, max_batch_size=args.streams + 1)) as url:
            with ThreadPoolExecutor(args.streams + 1) as pool:
                streams = [pool.submit(stream_times, url, dict(
                    model=NAME, messages=[{"role": "user", "content": f"Count from {i} to 500, one number a line."}],
                    max_tokens=args.stream_tokens, temperature=0)) for i in range(args.streams)]
                time.sleep(args.warmup)  # the streams are decoding
                long = stream_times(url, dict(model=NAME, messages=[{"role": "user", "content": long_text}],
                                              max_tokens=4, temperature=0))
                runs = [s.result() for s in streams]
        _, long_times, long_sent = long
        gaps = [b - a for _, times, _ in runs for a, b in zip(times, times[1:]) if b > long_sent and a < long_times[0]]
        worst.append((max(gaps), long_times[0] - long_sent, len(tokenizer.encode(long_text))))
    gap, ttft, n = min(worst)
    print(f"a {n}-token chat message arrives while {args.streams} streams decode (best of {args.rounds}):")
    print(f"  longest gap between two tokens of a running stream during its prefill: {gap:.3f}s")
    print(f"  its own time to first token: {ttft:.3f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    common.add_argument("--rounds", type=int, default=2)
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("chat", parents=[common])
    c.add_argument("--turns", type=int, default=5)
    c.set_defaults(run=chat)
    c = commands.add_parser("long-prompt", parents=[common])
    c.add_argument("--prompt-tokens", type=int, default=2000)
    c.add_argument("--streams", type=int, default=4)
    c.add_argument("--stream-tokens", type=int, default=400)
    c.add_argument("--warmup", type=float, default=2.0, help="seconds the streams decode before the long prompt")
    c.set_defaults(run=long_prompt)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
