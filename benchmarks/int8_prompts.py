"""A prompt's products in int8 mode: multiplied in integers (where kernels.c's int8_prompts says so) against the
exact float32 ones, in one process, taking turns, so that this VM's moods fall on both alike.

The file is loaded twice: in int8 mode (its matrices laid out again where this CPU's int8 tile wants them) and
exactly (the file's blocks), as a user would load it either way. Each round prefills a --prompt-tokens prompt
(and decodes one token) on each side, the order alternating; the figures are the medians of the rounds' prefill
rates. Exits 1 where the ratio is under --at-least. Run it with SMOLLM2_MARCH for a tier's code (x86-64-v3:
AVX2's eights_block).

    SMOLLM2_MARCH=x86-64-v3 .venv/bin/python benchmarks/int8_prompts.py --model 1.7b-q4_0.gguf [--at-least 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from smollm2 import loading
from smollm2.bench import ours, random_prompt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--at-least", type=float, default=None, help="exit 1 where int8 / exact prefill is under this")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompt = None
    runs = {}
    for exact in (False, True):
        model = loading.load(args.model, int8_activations=not exact)
        prompt = random_prompt(model.config.vocab_size, 1, args.prompt_tokens, "cpu") if prompt is None else prompt
        runs[exact] = ours(model, prompt, 1)
        runs[exact](lambda: None), runs[exact](lambda: None)  # each side's kinds measured and warm first
    rates = {False: [], True: []}
    for r in range(args.rounds):
        for exact in ((False, True) if r % 2 == 0 else (True, False)):
            start = time.perf_counter()
            runs[exact](lambda: None)
            rates[exact].append(args.prompt_tokens / (time.perf_counter() - start))
    int8, exact = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{args.model}: prefill tok/s, int8 prompts {int8:.1f}, exact prompts {exact:.1f}: {int8 / exact:.3f}x")
    return 1 if args.at_least is not None and int8 / exact < args.at_least else 0


if __name__ == "__main__":
    sys.exit(main())
