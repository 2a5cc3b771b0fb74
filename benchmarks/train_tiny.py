"""Pretrain the tiny config on a text, and time a plain transformers training loop on the same batches.

    python benchmarks/train_tiny.py TEXT [--steps 150] [--seq-len 256] [--batch-size 16]

TEXT: any plain text; a public-domain one is the Jargon File (Debian: apt-get install jargon-text, then
zcat /usr/share/doc/jargon-text/jargon.txt.gz > jargon.txt). The script prepares it, reports the unigram
entropy of its tokens (the loss of a model that ignores context), runs `smollm2.training.train`, then trains
transformers' LlamaForCausalLM of the same config from the same initial weights on the same batches with
the same optimizer and schedule (logits, then F.cross_entropy), and prints both tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from smollm2 import PRESETS, SmolLM2, Tokenizer
from smollm2.training import TrainConfig, train
from smollm2.training.data import TokenData, prepare
from smollm2.training.loop import learning_rate, param_groups


def unigram_entropy(directory: Path, manifest: dict) -> float:
    """Entropy (nats) of the train tokens' frequencies."""
    counts = sum(np.bincount(np.fromfile(directory / s["file"], dtype=np.uint16), minlength=manifest["vocab_size"])
                 for s in manifest["shards"] if s["split"] == "train")
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def transformers_loop(initial_state: dict, data: TokenData, c: TrainConfig,
                      steps: int) -> tuple[list[float], list[float]]:
    """(losses, tokens/s per step) of a plain loop over LlamaForCausalLM: what one writes without smollm2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny"].to_hf()))
    model.load_state_dict(initial_state, strict=False)  # the tied lm_head is the embedding
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.lr, betas=(0.9, 0.95), eps=1e-8)
    losses, speeds = [], []
    for step in range(steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(c, step)
        inputs, labels = data.examples(range(step * c.batch_size, (step + 1) * c.batch_size))
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        speeds.append(inputs.numel() / (time.perf_counter() - began))
    return losses, speeds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--transformers-steps", type=int, default=12, help="steps timed of the transformers loop")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="smollm2-train-"))
    manifest = prepare([args.text], work / "data", Tokenizer.from_pretrained(), val_fraction=0.05)
    entropy = unigram_entropy(work / "data", manifest)
    c = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                    min_lr=args.lr / 10, warmup=10, eval_every=max(1, args.steps // 5), eval_batches=8,
                    save_every=args.steps, keep=1)
    data = TokenData(work / "data", "train", c.seq_len)
    torch.manual_seed(c.seed)
    model = SmolLM2(PRESETS["tiny"])
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    hf_losses, hf_speeds = transformers_loop(initial, data, c, args.transformers_steps)
    started = time.perf_counter()
    train(model, Tokenizer.from_pretrained(), data, TokenData(work / "data", "val", c.seq_len), c, work / "run")
    minutes = (time.perf_counter() - started) / 60
    _, hf_speeds_after = transformers_loop(initial, data, c, args.transformers_steps)

    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = statistics.median(r["tokens_per_s"] for r in records[2:])
    theirs = max(statistics.median(s[2:]) for s in (hf_speeds, hf_speeds_after))  # the better of two runs
    same = max(abs(a - r["loss"]) for a, r in zip(hf_losses, records))
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    print(f"data: {args.text}, {sum(s['tokens'] for s in manifest['shards'])} tokens; unigram entropy "
          f"{entropy:.3f} nats")
    print("validation loss: " + ", ".join(f"step {s}: {v:.3f}" for s, v in vals))
    print(f"final validation loss {vals[-1][1]:.3f} = unigram entropy - {entropy - vals[-1][1]:.3f} nats, "
          f"after {minutes:.1f} min of training")
    print(f"first {len(hf_losses)} losses, smollm2 vs transformers on the same batches: max difference {same:.2e}")
    print(f"train tokens/s (median per step, {torch.get_num_threads()} threads): smollm2 {ours:.0f}, "
          f"transformers {theirs:.0f}, ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
