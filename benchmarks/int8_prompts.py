"""A prompt's products in int8 mode: multiplied in integers (where kernels.c's int8_prompts says so) against the
exact float32 ones, in one process, taking turns, so that this VM's moods fall on both alike.

ops.linear asks the kernels' int8_prompts whether a prompt's many rows of a weight type go to the integer
products; here it is asked through a stand-in that says no on the exact side's turns. Each round prefills a
--prompt-tokens prompt (and decodes one token) on each side, the order alternating; the figures are the medians
of the rounds' prefill rates. Exits 1 where the ratio is under --at-least. Run it with SMOLLM2_MARCH for a tier's
code (x86-64-v3: AVX2's held_rows).

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
from smollm2.kernels import ops


class Exact:
    """The compiled kernels, but int8_prompts answers no while `on`."""

    def __init__(self, lib):
        self.lib, self.on = lib, False

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def int8_prompts(self, **kwargs):
        return 0 if self.on else self.lib.int8_prompts(**kwargs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--at-least", type=float, default=None, help="exit 1 where int8 / exact prefill is under this")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = loading.load(args.model, int8_activations=True)
    stand_in = Exact(ops.compiled())
    ops.compiled = lambda: stand_in
    run = ours(model, random_prompt(model.config.vocab_size, 1, args.prompt_tokens, "cpu"), 1)
    rates = {False: [], True: []}
    for exact in (False, True):  # each side's kinds measured and warm before the timed rounds
        stand_in.on = exact
        run(lambda: None), run(lambda: None)
    for r in range(args.rounds):
        for exact in ((False, True) if r % 2 == 0 else (True, False)):
            stand_in.on = exact
            start = time.perf_counter()
            run(lambda: None)
            rates[exact].append(args.prompt_tokens / (time.perf_counter() - start))
    int8, exact = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{args.model}: prefill tok/s, int8 prompts {int8:.1f}, exact prompts {exact:.1f}: {int8 / exact:.3f}x")
    return 1 if args.at_least is not None and int8 / exact < args.at_least else 0


if __name__ == "__main__":
    sys.exit(main())
