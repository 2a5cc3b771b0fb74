"""Aggregate decode throughput against batch size, every batch size timed in one process, taking turns.

    .venv/bin/python benchmarks/batch.py [--model SRC] [--dtype fp32|bf16] [--batch-sizes 1,4,8,16]
                                         [--prompt-tokens 128] [--new-tokens 128] [--rounds 3]

Loads the model once (default: the embedded one), then runs `smollm2 bench`'s protocol (a random prompt per row,
greedy, no EOS stop) at each batch size in turn, `--rounds` times, keeping each size's best decode figure: the
rounds interleave the sizes, so a noisy stretch of the machine does not fall on one size alone. Prints decode
tok/s summed over the rows and its ratio to batch 1.

In fp32 the embedded model's weights stream as its file's Q4_1 blocks, which makes batch 1 ~2.7x faster than
float32 weights would, while batch 16 is bound by float32 arithmetic either way. For float32 weights, save
the model and load that copy:
    .venv/bin/python -c "import smollm2; smollm2.save(smollm2.load(), 'f32')"
    .venv/bin/python benchmarks/batch.py --model f32
"""

from __future__ import annotations

import argparse

import torch

from smollm2 import kernels, load
from smollm2.bench import bench_ours, random_prompt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint: HF directory, hub id or GGUF (default: embedded)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    model = load(args.model, dtype=DTYPES[args.dtype])
    prompts = {b: random_prompt(model.config.vocab_size, b, args.prompt_tokens, "cpu") for b in sizes}
    best = dict.fromkeys(sizes, 0.0)
    for _ in range(args.rounds):
        for b in sizes:
            speed = bench_ours(model, prompts[b], args.new_tokens, repeats=1)
            best[b] = max(best[b], speed.decode_tok_s)
    print(f"{args.dtype}, weights read: {kernels.weight_format(model)}, {torch.get_num_threads()} "
          f"threads, pp{args.prompt_tokens}/tg{args.new_tokens}, best of {args.rounds} rounds")
    print(f"{'batch':>5}{'decode tok/s':>15}{'vs batch 1':>12}")
    for b in sizes:
        print(f"{b:>5}{best[b]:>15.1f}{best[b] / best[sizes[0]]:>11.2f}x")


if __name__ == "__main__":
    main()
