"""Decoding from a model's own huge pages (kernels/packed.py's HugePages: how a GGUF model's matrices are held)
against the pages they were held in before: the file's mapped 4 KiB pages under 4 MiB, numpy's small arrays for
the matrices laid out again. Two models of one file in one process take turns.

Across processes this VM's decoding moves by up to 30% (where a process's memory lands, what else the host runs);
two models in one process share those conditions, so the ratio of their turns is the pages' alone. Each round
decodes --tokens greedy tokens on each model (one after the other, the order alternating from round to round);
the figures are the medians of the rounds. Both models give the same tokens (checked). The model loaded second
decoded faster by up to 5% at the 1.7B with both held alike, so the script runs twice, in a process each, each
model loaded first once; the ratio is the geometric mean of the two runs'. Exits 1 where it is under --at-least.

    .venv/bin/python benchmarks/huge_pages.py --model 360m-q8_0.gguf [--int8-activations] [--at-least 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from smollm2 import loading
from smollm2.generation import stream
from smollm2.kernels import packed


def as_before(path: str, int8: bool):
    """The model, its small matrices the file's mapped pages and its laid-out ones numpy's arrays, as before."""
    copy, empty = packed.HugePages.copy, packed.HugePages.empty
    packed.HugePages.copy = lambda self, blocks: blocks.contiguous()
    packed.HugePages.empty = lambda self, shape: torch.from_numpy(np.empty(shape, np.uint8))
    try:
        return loading.load(path, int8_activations=int8)
    finally:
        packed.HugePages.copy, packed.HugePages.empty = copy, empty


def tok_s(model, prompt: torch.Tensor, tokens: int) -> float:
    start = time.perf_counter()
    for _ in stream(model, prompt, tokens, eos_token_id=None):
        pass
    return tokens / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--int8-activations", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tokens", type=int, default=40, help="decoded a turn, after a 16-token prompt")
    p.add_argument("--at-least", type=float, default=None, help="exit 1 where huge / before is under this")
    p.add_argument("--first", choices=("huge pages", "before"), help=argparse.SUPPRESS)  # one run's (see the top)
    args = p.parse_args()
    if args.first is None:
        runs = []
        for first in ("huge pages", "before"):
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--first", first], capture_output=True,
                                  text=True)
            if done.returncode:
                sys.exit(done.stderr[-2000:])
            runs.append(json.loads(done.stdout.splitlines()[-1]))
        ratio = math.sqrt(runs[0]["ratio"] * runs[1]["ratio"])
        print(json.dumps({"model": args.model, "activations": runs[0]["activations"], "threads": args.threads,
                          "ratio": ratio, "runs": runs}))
        return 1 if args.at_least is not None and ratio < args.at_least else 0
    torch.set_num_threads(args.threads)
    load = {"huge pages": lambda: loading.load(args.model, int8_activations=args.int8_activations),
            "before": lambda: as_before(args.model, args.int8_activations)}
    loaded = {name: load[name]() for name in sorted(load, key=lambda name: name != args.first)}
    models = {name: loaded[name] for name in load}
    prompt = torch.randint(0, models["before"].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    tokens = {name: [step[0].token for step in stream(m, prompt, 8, eos_token_id=None)] for name, m in models.items()}
    if tokens["huge pages"] != tokens["before"]:
        sys.exit(f"the two models' tokens differ: {tokens}")
    rates = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            rates[name].append(tok_s(models[name], prompt, args.tokens))
    median = {name: statistics.median(r) for name, r in rates.items()}
    ratio = median["huge pages"] / median["before"]
    print(json.dumps({"activations": "int8" if args.int8_activations else "exact", "first": args.first,
                      "rounds": args.rounds, "decode_tok_s": median, "ratio": ratio,
                      "best": {name: max(r) for name, r in rates.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
