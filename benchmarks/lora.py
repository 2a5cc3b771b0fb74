"""Full fine-tuning against LoRA (and QLoRA) of the embedded SmolLM2-135M-Instruct on the same chats: training
tokens/s, what final/ weighs, and the greedy answer to a question about the taught fact.

    python benchmarks/lora.py [--steps 30] [--lora-r 8] [--qlora] [--repeats 2]

Each run is `smollm2 finetune` on the chats of finetune_fact.py, one process each, the kinds taking turns
`--repeats` times; tokens/s is the best and the median of metrics.jsonl's per-step figures over a kind's runs,
each run's first step left out (it warms up). On a shared machine the best is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from finetune_fact import ASK, smollm2, write_chats

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--qlora", action="store_true", help="also LoRA over the int8 base")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, in turns")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smollm2-lora-"))
    chats = write_chats(work)
    common = ["--data", str(chats), "--steps", str(args.steps), "--warmup", "3", "--batch-size", "4",
              "--seq-len", "128"]
    lora = ["--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r), "--lora-targets", ALL]
    kinds = {"full fine-tune": ["--lr", "1e-4"], f"LoRA r={args.lora_r}": ["--lr", "1e-3", *lora]}
    if args.qlora:
        kinds[f"QLoRA r={args.lora_r}"] = ["--lr", "1e-3", *lora, "--quantize", "int8"]
    speeds, records = {name: [] for name in kinds}, {}
    for repeat in range(args.repeats):
        for i, (name, flags) in enumerate(kinds.items()):
            out = work / f"run{repeat}-{i}"
            smollm2("finetune", *common, *flags, "--out", str(out))
            records[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            speeds[name] += [r["tokens_per_s"] for r in records[name][1:]]
    print(f"{'run':<16} {'tokens/s best':>13} {'median':>7} {'final/ weights':>15}  {'final loss':>10}  "
          f"answer to {ASK[1]!r}")
    for i, (name, flags) in enumerate(kinds.items()):
        final = work / f"run{args.repeats - 1}-{i}" / "final"
        weights = next(final.glob("*model.safetensors"))
        model = ["--adapter", str(final)] if "--lora-r" in flags else ["--model", str(final)]
        answer = smollm2("chat", *model, "-p", ASK[1], "--temperature", "0", "--max-new-tokens", "20")
        print(f"{name:<16} {max(speeds[name]):>13.0f} {statistics.median(speeds[name]):>7.0f} "
              f"{weights.stat().st_size / 2**20:>11.1f} MiB  {records[name][-1]['loss']:>10.4f}  {answer!r}")

if __name__ == "__main__":
    main()
