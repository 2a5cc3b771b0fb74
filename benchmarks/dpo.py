"""DPO with LoRA on the embedded SmolLM2-135M-Instruct: held-out preference accuracy before and after.

    python benchmarks/dpo.py [--preference friendly|correct] [--steps 30] [--lora-r 8] [--lr 1e-3]

Writes synthetic preference pairs to an addition question, 60 to train on and 20 held out with other numbers:
friendly, both answers right, the chosen one ending with a friendly sign-off; correct, the chosen answer right and
the rejected one off by 1 to 10. Then runs `smollm2 dpo` with a LoRA adapter on every linear layer, and reports,
on the held-out pairs: the share of pairs whose chosen answer the model finds likelier than the rejected one, for
the base model and with the adapter, and the reward accuracy and validation loss from metrics.jsonl (before
training every reward is 0, so the reward accuracy is 0 and the loss log 2).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from smollm2 import SmolLM2, Tokenizer, load
from smollm2.training.data import PreferenceData
from smollm2.training.dpo import sequence_logps

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def pairs(path: Path, preference: str, n: int, low: int, high: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(low, high), rng.randint(low, high)
            answer = f"{a} plus {b} equals {a + b}."
            if preference == "friendly":
                chosen, rejected = f"{answer} Happy to help!", answer
            else:
                chosen, rejected = answer, f"{a} plus {b} equals {a + b + rng.choice([-1, 1]) * rng.randint(1, 10)}."
            f.write(json.dumps({"prompt": f"What is {a} plus {b}?", "chosen": chosen, "rejected": rejected}) + "\n")
    return path


@torch.no_grad()
def preference_accuracy(model: SmolLM2, data: PreferenceData) -> float:
    inputs, labels = data.sides(range(len(data)))
    logps = sequence_logps(model.eval(), inputs.flatten(0, 1), labels.flatten(0, 1)).view(-1, 2)
    return (logps[:, 0] > logps[:, 1]).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preference", choices=("friendly", "correct"), default="friendly")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smollm2-dpo-"))
    train = pairs(work / "train.jsonl", args.preference, 60, 0, 99, seed=0)
    held_out = pairs(work / "held_out.jsonl", args.preference, 20, 100, 999, seed=1)
    out = work / "run"
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "smollm2", "dpo", "--data", str(train), "--val-data", str(held_out),
                    "--out", str(out), "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", "3",
                    "--batch-size", "4", "--seq-len", "128", "--beta", str(args.beta), "--eval-every",
                    str(args.steps), "--eval-batches", "5", "--lora-r", str(args.lora_r), "--lora-alpha",
                    str(2 * args.lora_r), "--lora-targets", ALL], check=True, capture_output=True)
    seconds = time.perf_counter() - began
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    data = PreferenceData(held_out, Tokenizer.from_pretrained(), seq_len=128)
    before = preference_accuracy(load(kernels=False), data)
    after = preference_accuracy(load(adapter=out / "final", kernels=False), data)
    print(f"{args.preference} pairs, embedded SmolLM2-135M-Instruct, LoRA r={args.lora_r} on every linear layer, "
          f"{args.steps} steps of 4 pairs, lr {args.lr}, beta {args.beta}: {seconds:.0f} s (the reference pass "
          f"included), {statistics.median(r['tokens_per_s'] for r in records[1:]):.0f} tokens/s median")
    print(f"held-out pairs ({len(data)}): chosen answer likelier {before:.0%} before, {after:.0%} after; "
          f"reward accuracy 0% before, {records[-1]['val_reward_accuracy']:.0%} after; "
          f"val loss {math.log(2):.4f} before, {records[-1]['val_loss']:.4f} after; "
          f"reward margin {records[-1]['val_reward_margin']:.2f}")
    print("train loss by step:", " ".join(f"{r['loss']:.3f}" for r in records))


if __name__ == "__main__":
    main()
