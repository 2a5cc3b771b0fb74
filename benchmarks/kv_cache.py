"""What a smaller KV cache costs in quality: the embedded model's perplexity on a text with its keys and values
stored in fp32, bf16 and int8 (smollm2.kv_cache.KVCache), and how often each one's greedy next token (the top
logit at every position of the text) is fp32's.

    .venv/bin/python benchmarks/kv_cache.py [--file tests/data/english.txt] [--window 1024] [--at-most 0.5]

Exits 1 unless a bf16 cache's perplexity is within --at-most percent of an fp32 cache's; int8's is stated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from smollm2 import Tokenizer, evaluate, load

TEXT = Path(__file__).parent.parent / "tests" / "data" / "english.txt"


@torch.inference_mode()
def greedy_tokens(model, ids: list[int], kv_cache_dtype: str) -> torch.Tensor:
    """The top token after each position of ids, attention reading a cache of kv_cache_dtype."""
    cache = model.new_cache(1, len(ids), kv_cache_dtype)
    return model.logits(model.hidden_states(torch.tensor([ids]), cache=cache))[0].argmax(-1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, default=TEXT)
    p.add_argument("--window", type=int, default=1024, help="tokens a window scores (half of it the stride)")
    p.add_argument("--at-most", type=float, default=0.5, help="bf16's perplexity above fp32's, in percent")
    args = p.parse_args()
    model = load(None)
    ids = Tokenizer.from_pretrained(None).encode(args.file.read_text())
    window = min(args.window, len(ids))
    first = ids[:window]  # top-1 agreement over one window
    fp32_tokens = greedy_tokens(model, first, "fp32")
    results = {}
    for kv in ("fp32", "bf16", "int8"):
        ppl = evaluate.perplexity(model, ids, window, window // 2, kv_cache_dtype=kv).perplexity
        agree = (greedy_tokens(model, first, kv) == fp32_tokens).float().mean().item()
        results[kv] = ppl
        print(f"{kv:5} cache: perplexity {ppl:.4f} ({100 * (ppl / results['fp32'] - 1):+.3f}% vs fp32), "
              f"top-1 agreement with fp32 {100 * agree:.1f}% of {len(first)} positions")
    change = 100 * abs(results["bf16"] / results["fp32"] - 1)
    print(f"{args.file.name}, {len(ids)} tokens: bf16 within {change:.3f}% of fp32, bar {args.at_most}%: "
          f"{'ok' if change <= args.at_most else 'OVER'}")
    return 0 if change <= args.at_most else 1


if __name__ == "__main__":
    sys.exit(main())
