"""Full fine-tuning against LoRA (and QLoRA) of the embedded SmolLM2-135M-Instruct on the same chats: training
tokens/s, what final/ weighs, and the greedy answer to a question about the taught fact.

    python benchmarks/lora.py [--steps 30] [--lora-r 16] [--qlora]

Each run is `smollm2 finetune` on the chats of finetune_fact.py (one process each, in turn); tokens/s is the
median of metrics.jsonl's per-step figures, the first step left out (it warms up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune_fact import ANSWERS, ASK, QUESTIONS

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def smollm2(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "smollm2", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--qlora", action="store_true", help="also LoRA over the int8 base")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smollm2-lora-"))
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for q in QUESTIONS for a in ANSWERS))
    common = ["--data", str(chats), "--steps", str(args.steps), "--warmup", "3", "--batch-size", "4", "--seq-len", "128"]
    lora = ["--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r), "--lora-targets", ALL]
    runs = {"full fine-tune": ["--lr", "1e-4"], f"LoRA r={args.lora_r}": ["--lr", "1e-3", *lora]}
    if args.qlora:
        runs[f"QLoRA r={args.lora_r}"] = ["--lr", "1e-3", *lora, "--quantize", "int8"]
    print(f"{'run':<16} {'tokens/s':>9} {'final/ weights':>15}  {'final loss':>10}  answer to {ASK[1]!r}")
    for i, (name, flags) in enumerate(runs.items()):
        out = work / f"run{i}"
        smollm2("finetune", *common, *flags, "--out", str(out))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        speed = statistics.median(r["tokens_per_s"] for r in records[1:])
        weights = next((out / "final").glob("*model.safetensors"))
        model = ["--adapter", str(out / "final")] if "--lora-r" in flags else ["--model", str(out / "final")]
        answer = smollm2("chat", *model, "-p", ASK[1], "--temperature", "0", "--max-new-tokens", "20")
        print(f"{name:<16} {speed:>9.0f} {weights.stat().st_size / 2**20:>11.1f} MiB  {records[-1]['loss']:>10.4f}  "
              f"{answer!r}")


if __name__ == "__main__":
    main()
