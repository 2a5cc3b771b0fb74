"""Speculative decoding by prompt lookup, beside plain decoding: batch 1, greedy, the embedded model.

    .venv/bin/python benchmarks/speculative.py [--new-tokens 128] [--rounds 3] [--threads 2]

Two sets of chat prompts: input-grounded ones (rewrite, correct, extract, summarise, edit code, reformat a given
text), where an answer may repeat long runs of its input, and open-ended ones, where it rarely does. Each prompt
is answered without speculation and with it, in turns (a noisy stretch of the machine falls on both), and the
best round of each counts. Prints each prompt's decode tok/s both ways, tokens per decoding pass, how many
guesses stood and the machine's load (1-minute average) while it ran, and checks that the tokens are identical;
first, what a pass of k positions costs in decoding steps (after a 400-token prompt, best of 30); after each set,
the speed-ups those costs give when its greedy answers are replayed, with prompt lookup and with the best guesses
a lookup could make (what bounds the set, whatever the passes cost). Exits 1 if the tokens differ anywhere, or
if a set's speed-up (total decode time without over total with) is under its bar: --grounded-at-least 2.0 and
--open-at-least 0.95.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from smollm2 import Tokenizer, load
from smollm2.generation import stream
from smollm2.generation.engine import PassCounts
from smollm2.generation.speculative import MAX_GUESS, MAX_PASS_TOKENS, PromptLookup
from smollm2.generation.steps import prefill_chunk, untouched_cache, verify_step

PARAGRAPH = ("The city council met on Tuesday evening to discuss the new budget. After a long debate, the members "
             "agreed to increase spending on public libraries by ten percent and to keep the parks budget at last "
             "year's level. The mayor said the decision reflected what residents had asked for at the spring "
             "meetings, and the council will vote on the final plan next month.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
TYPOS = ("The city councel met on Tuesday evening to discus the new budget. After a long debate, the members "
         "agreed to increese spending on public libraries by ten percent and to keep the parks budget at last "
         "year's level.")
STEPS = ("- Preheat the oven to 200 degrees.\n- Mix the flour, sugar and butter in a large bowl.\n- Add two eggs and "
         "stir until smooth.\n- Pour the batter into a greased tin.\n- Bake for 25 minutes, until golden.")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    f"Rewrite this text, replacing 'council' with 'committee' and changing nothing else:\n\n{PARAGRAPH}",
    f"Copy this text and put each sentence on its own line:\n\n{PARAGRAPH}",
    f"Quote the sentence about the mayor from this text, exactly:\n\n{PARAGRAPH}",
    f"Rename the function total_price to compute_total in this code and give the whole code back:\n\n{CODE}",
    f"Add a docstring to each function of this code and give the whole code back:\n\n{CODE}",
    f"Rewrite this code to use the name 'products' instead of 'items', giving the whole code:\n\n{CODE}",
    f"Summarise this text in two sentences, reusing its own words:\n\n{PARAGRAPH}",
    f"Correct the spelling mistakes in this text and give it back:\n\n{TYPOS}",
    f"Extract every sentence of this text that mentions money or spending, word for word:\n\n{PARAGRAPH}",
    f"Add type hints to this code and give the whole code back:\n\n{CODE}",
    f"Turn these steps into a numbered list:\n\n{STEPS}",
]
OPEN = [
    "Write a short poem about the sea.",
    "Tell me a story about a dragon who learns to cook.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
]


def answer(model, ids: list[int], new_tokens: int, speculative) -> tuple[list[int], float, float, PassCounts]:
    """Its tokens, seconds to the first token, seconds for the rest, and what the decoding passes did."""
    tokens, start, first = [], time.perf_counter(), None
    steps = stream(model, [ids], new_tokens, speculative=speculative)
    while True:
        try:
            (step,) = next(steps)
        except StopIteration as end:
            return tokens, first - start, time.perf_counter() - first, end.value
        first = first or time.perf_counter()
        tokens.append(step.token)


def row(text: str, tokens: int, alone_s: float, speculating_s: float, counts: PassCounts) -> str:
    """A prompt's line: its tokens, decoding speed without and with speculation (after the first token), their
    ratio, tokens per pass and guesses kept."""
    n = tokens - 1
    return (f"{text[:42].replace(chr(10), ' '):<44}{tokens:>7}{n / alone_s:>9.1f}{n / speculating_s:>9.1f}"
            f"{alone_s / speculating_s:>7.2f}x{counts.decoded / max(counts.passes, 1):>10.2f}"
            f"{f'{counts.kept}/{counts.guessed}':>10}")


@torch.inference_mode()
def pass_costs(model, positions=range(1, MAX_PASS_TOKENS + 1), prompt: int = 400, repeats: int = 30) -> dict:
    """Seconds of one pass of k positions after a prompt (best of `repeats`), for each k: the engine's own verify
    step, on random tokens (the arithmetic does not depend on them)."""
    cache = untouched_cache(model, 1, prompt + max(positions))
    ids = torch.randint(100, model.config.vocab_size, (1, prompt + max(positions)))
    for begin in range(0, prompt, 64):
        prefill_chunk(model, ids[:, begin:min(begin + 64, prompt)], cache, begin)
    costs = {}
    for k in positions:
        at, view = torch.arange(prompt, prompt + k)[None], cache.view(length=prompt + k)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            verify_step(model, ids[:, prompt:prompt + k], at, view)
            times.append(time.perf_counter() - start)
        costs[k] = min(times)
    return costs


def replayed(answers: list[tuple[list[int], list[int]]], costs: dict, guesser=None, context: int = 0) -> float:
    """Decode speed-up that passes costing `costs` (seconds by positions) would give over decoding steps, replaying
    greedy answers (prompt, tokens): with the engine's prompt lookup (guesser=None), or, knowing each answer, with
    the best guess a lookup of the last `context` tokens could make: the longest start of what comes next that
    follows one of their earlier occurrences (a bound on choosing among occurrences)."""
    seconds = tokens_timed = 0.0
    for prompt, tokens in answers:
        lookup, at = PromptLookup(), 1  # the first token comes from the prompt's prefill
        while at < len(tokens):
            if context:
                before = prompt + tokens[:at]
                tail, text = before[-context:], f" {' '.join(map(str, before))} "
                guess = []
                while (at + len(guess) < len(tokens) and len(guess) < MAX_GUESS
                       and f" {' '.join(map(str, tail + tokens[at:at + len(guess) + 1]))} " in text):
                    guess.append(tokens[at + len(guess)])
            else:
                guess = lookup.guess(prompt, tokens[:at], MAX_GUESS)
            kept = next((j for j, t in enumerate(guess) if at + j >= len(tokens) or tokens[at + j] != t), len(guess))
            if guess and not context:
                lookup.record(len(guess), kept)
            seconds += costs[len(guess) + 1]
            tokens_timed += min(kept + 1, len(tokens) - at)
            at += kept + 1
    return tokens_timed * costs[1] / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--grounded-at-least", type=float, default=2.0)
    p.add_argument("--open-at-least", type=float, default=0.95)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(None), Tokenizer.from_pretrained(None)
    answer(model, tokenizer.encode("Hello"), 8, "ngram")  # warm-up: the kernels' choices
    costs = pass_costs(model)
    print("a pass of k positions, in decoding steps: "
          + ", ".join(f"{k}: {cost / costs[1]:.2f}" for k, cost in costs.items()))
    failures = []
    print(f"batch 1, greedy, up to {args.new_tokens} new tokens, {args.threads} threads; decode tok/s, best of "
          f"{args.rounds} rounds taken in turns")
    print(f"{'prompt':<44}{'tokens':>7}{'plain':>9}{'ngram':>9}{'ratio':>8}{'tok/pass':>10}{'kept':>10}{'load':>6}")
    for name, prompts, bar in (("grounded", GROUNDED, args.grounded_at_least), ("open", OPEN, args.open_at_least)):
        totals, answers = {None: 0.0, "ngram": 0.0}, []
        for text in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            best, runs = {None: float("inf"), "ngram": float("inf")}, {}
            for round_ in range(args.rounds):
                for mode in (None, "ngram") if round_ % 2 == 0 else ("ngram", None):
                    tokens, _, decode_s, counts = answer(model, ids, args.new_tokens, mode)
                    best[mode] = min(best[mode], decode_s)
                    runs[mode] = tokens, counts
            (plain, _), (fast, counts) = runs[None], runs["ngram"]
            answers.append((ids, plain))
            if fast != plain:
                failures.append(f"{name}: {text[:40]!r}: tokens differ with speculation")
            totals[None], totals["ngram"] = totals[None] + best[None], totals["ngram"] + best["ngram"]
            print(f"{row(text, len(plain), best[None], best['ngram'], counts)}{os.getloadavg()[0]:>6.1f}")
        ratio = totals[None] / totals["ngram"]
        print(f"{name}: decode {ratio:.2f}x with prompt lookup (bar {bar:.2f}x), load {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs")
        print(f"  replayed at the passes' measured costs: prompt lookup {replayed(answers, costs):.2f}x; the best "
              f"choice among earlier occurrences of the last 2 tokens {replayed(answers, costs, context=2):.2f}x, "
              f"of the last token {replayed(answers, costs, context=1):.2f}x")
        if ratio < bar:
            failures.append(f"{name}: {ratio:.2f}x is under {bar:.2f}x")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
