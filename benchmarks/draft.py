"""Draft-model speculation beside the target alone: batch 1, greedy, a fine-tuned target drafted by its base.

    .venv/bin/python benchmarks/draft.py [--adapter DIR] [--steps 10] [--new-tokens 128] [--rounds 3] [--threads 2]

The target: the embedded SmolLM2-135M-Instruct with a LoRA adapter (r 8 on every linear layer of every block)
merged, in fp32: a fine-tune whose answers differ from its base's, and whose block weights the CPU kernels read as
float32, the adapter having changed them all. Without --adapter, the adapter is trained first (`smollm2 finetune`,
--steps steps at a learning rate of 2e-4 on the chats of finetune_fact.py: a light fine-tune, as most are of their
base). The draft: the embedded model itself, its weights streamed from its Q4_1 blocks, about a sixth of the bytes
a step.

Each prompt (speculative.py's open-ended and input-grounded ones) is answered by the target alone and with the
draft, in turns, and the best round of each counts. Prints each prompt's decode tok/s both ways, tokens per
decoding pass and the guesses kept (the acceptance rate), and whether the target's answer differs from the
draft's own; checks that the tokens with the draft are the target's alone; exits 1 if they differ anywhere, or if
the speed-up (total decode time alone over total with the draft) is under --at-least (1.5).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from finetune_fact import smollm2, write_chats
from lora import ALL
from speculative import GROUNDED, OPEN, answer, row

from smollm2 import Tokenizer, load
from smollm2.generation import stream


def train_adapter(steps: int) -> Path:
    work = Path(tempfile.mkdtemp(prefix="smollm2-draft-"))
    smollm2("finetune", "--data", str(write_chats(work)), "--out", str(work / "run"), "--steps", str(steps),
            "--lr", "2e-4", "--warmup", "3", "--batch-size", "4", "--seq-len", "128", "--lora-r", "8",
            "--lora-alpha", "16", "--lora-targets", ALL)
    return work / "run" / "final"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", help="a LoRA adapter directory (default: train one)")
    p.add_argument("--steps", type=int, default=10, help="fine-tuning steps, without --adapter")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--at-least", type=float, default=1.5)
    args = p.parse_args()
    adapter = args.adapter or train_adapter(args.steps)
    torch.set_num_threads(args.threads)
    target, draft = load(None, adapter=adapter), load(None)
    tokenizer = Tokenizer.from_pretrained(None)
    answer(target, tokenizer.encode("Hello"), 8, draft)  # warm-up: the kernels' choices, both models'
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; batch 1, greedy, "
          f"up to {args.new_tokens} new tokens, {args.threads} threads; decode tok/s, best of {args.rounds} rounds "
          f"in turns")
    print(f"{'prompt':<44}{'tokens':>7}{'alone':>9}{'draft':>9}{'ratio':>8}{'tok/pass':>10}{'kept':>10}  differs")
    failures, totals, passes, decoded, guessed, kept, differ = [], [0.0, 0.0], 0, 0, 0, 0, 0
    for text in OPEN + GROUNDED:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        best, runs = [float("inf")] * 2, [None, None]
        for round_ in range(args.rounds):
            for i in (0, 1) if round_ % 2 == 0 else (1, 0):
                tokens, _, decode_s, counts = answer(target, ids, args.new_tokens, (None, draft)[i])
                best[i], runs[i] = min(best[i], decode_s), (tokens, counts)
        (alone, _), (fast, counts) = runs
        if fast != alone:
            failures.append(f"{text[:40]!r}: tokens differ with the draft")
        base = [step.token for (step,) in stream(draft, [ids], args.new_tokens)]
        differ += base != alone
        passes, decoded = passes + counts.passes, decoded + counts.decoded
        guessed, kept = guessed + counts.guessed, kept + counts.kept
        totals = [totals[0] + best[0], totals[1] + best[1]]
        print(f"{row(text, len(alone), best[0], best[1], counts)}  {'yes' if base != alone else 'no'}", flush=True)
    ratio = totals[0] / totals[1]
    print(f"decode {ratio:.2f}x with the draft (bar {args.at_least:.2f}x); acceptance {kept / max(guessed, 1):.1%} "
          f"({kept}/{guessed}), {decoded / max(passes, 1):.2f} tokens per pass; the target's answer differs from "
          f"the draft's on {differ} of {len(OPEN + GROUNDED)} prompts")
    if ratio < args.at_least:
        failures.append(f"{ratio:.2f}x is under {args.at_least:.2f}x")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
