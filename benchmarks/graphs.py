"""How long an attribution graph of the embedded model takes: a 16-token prompt, 30 random JumpReLU transcoders of
4096 features (about 12,000 active), the default settings of graphs.attribute.

    .venv/bin/python benchmarks/graphs.py [--threads 2] [--at-most 60]

Exits 1 past --at-most seconds (issue: under a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from smollm2 import graphs, load
from smollm2.sae import SAE

PROMPT = [504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 8820, 314, 8671, 30, 378, 3458]  # 16 tokens


def transcoder(layer: int, width: int, features: int = 4096) -> SAE:
    """Block `layer`'s random transcoder, reading ln2's normalized input, thresholds from 2.3 up."""
    generator = torch.Generator().manual_seed(layer)

    def random(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator)

    return SAE(f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out", "jumprelu", True,
               random(width, features, scale=width ** -0.5), random(features, scale=0.1),
               random(features, width, scale=0.1), random(width, scale=0.01), 2.3 + 0.3 * random(features).abs(),
               None, None, False, False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--at-most", type=float, default=60.0, help="seconds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load()
    transcoders = [transcoder(layer, model.config.hidden_size) for layer in range(model.config.num_hidden_layers)]
    begin = time.perf_counter()
    graph = graphs.attribute(model, transcoders, PROMPT)
    seconds = time.perf_counter() - begin
    print(f"{seconds:.1f} s for a {len(PROMPT)}-token graph on {args.threads} threads: {graph.active_features} active "
          f"features, {len(graph.features)} nodes")
    if seconds > args.at_most:
        print(f"slower than {args.at_most:g} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
