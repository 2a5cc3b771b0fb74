"""Peak resident memory of a long generation against what it must hold: the weights and the KV cache.

    .venv/bin/python benchmarks/memory.py [--dtype fp32|bf16] [--tokens 2048] [--quantize int8]

Loads the embedded model, then generates until prompt + new tokens = --tokens (greedy, no EOS stop), and
prints the process's resident memory: before loading (the Python and torch runtime), after loading, and at
its peak during generation; then (peak - runtime) / (weights + KV cache), and what loading added against the
file's size (an fp32 model holds its quantized matrices as the file's blocks alone: ~1.2x the file; tests/
test_weights.py bounds it, with a runtime measured on a tiny model). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from smollm2 import load
from smollm2.bench import peak_memory_mb, reset_peak_memory
from smollm2.checkpoints import default_model_path
from smollm2.generation import stream
from smollm2.kernels.held import HeldWeight
from smollm2.quantize import quantize_int8

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resident_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 2**10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--quantize", choices=("int8",))
    args = parser.parse_args()

    runtime = resident_mb()
    model = load(None, dtype=DTYPES[args.dtype])
    if args.quantize:
        quantize_int8(model)
    loaded = resident_mb()
    c = model.config
    weights = sum(t.packed.data.nbytes if isinstance(t, HeldWeight) else t.numel() * t.element_size()
                  for t in model.state_dict().values()) / 2**20
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * args.tokens * DTYPES[args.dtype].itemsize
    kv /= 2**20

    prompt = [1, 504, 3458, 282]
    reset_peak_memory("cpu")
    start = time.perf_counter()
    for _ in stream(model, prompt, args.tokens - len(prompt), eos_token_id=None):
        pass
    seconds = time.perf_counter() - start
    peak = peak_memory_mb("cpu")
    print(f"{args.dtype}{' int8' if args.quantize else ''}, {args.tokens} tokens in {seconds:.0f} s")
    print(f"resident MiB: runtime {runtime:.0f}, loaded {loaded:.0f}, peak {peak:.0f}")
    print(f"weights {weights:.0f} + KV cache {kv:.0f} = {weights + kv:.0f} MiB; "
          f"(peak - runtime) / (weights + KV) = {(peak - runtime) / (weights + kv):.2f}")
    file = default_model_path().stat().st_size / 2**20
    print(f"the file {file:.0f} MiB: loading added {loaded - runtime:.0f} MiB = {(loaded - runtime) / file:.2f}x it "
          "(its blocks, and its tokenizer's metadata as Python values)")


if __name__ == "__main__":
    main()
