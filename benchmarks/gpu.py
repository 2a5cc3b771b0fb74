"""The CUDA check in one command: bf16 decoding of SmolLM2-135M on the GPU beside transformers eager, then the
tests that need a GPU.

    python benchmarks/gpu.py [--size 135M|360M|1.7B] [--batch-sizes 1,16] [--repeats 3] [--skip-tests]

The model has SmolLM2's shape (--size) with random weights, saved as a HF directory in a temporary folder: the
real weights are a 98 MB file that need not travel to a GPU machine, and speed does not depend on their
values (the benchmark never stops at EOS). Each batch size runs `smollm2 bench --device cuda --dtype bf16
--compare transformers` (pp512/tg128; ours with CUDA graphs, transformers eager, each in its own process),
then pytest runs the CUDA tests. Needs torch with CUDA, transformers, safetensors and gguf; the repository's
src/ on PYTHONPATH or the package installed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from smollm2 import PRESETS, SmolLM2, cli, save


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=[name for name in PRESETS if name != "tiny"], default="135M")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu.py: no CUDA device is available", file=sys.stderr)
        return 1
    print(f"SmolLM2-{args.size} (random weights) on {torch.cuda.get_device_name()}, torch {torch.__version__}",
          flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        save(SmolLM2(PRESETS[args.size]), folder)
        for batch_size in args.batch_sizes.split(","):
            print(f"\nbatch size {batch_size}", flush=True)
            failed |= cli.main(["bench", "--model", folder, "--device", "cuda", "--dtype", "bf16", "--compare",
                                "transformers", "--batch-size", batch_size, "--repeats", str(args.repeats)])
    if not args.skip_tests:
        tests = Path(__file__).resolve().parent.parent / "tests"
        failed |= subprocess.call([sys.executable, "-m", "pytest", "-q", str(tests / "test_fast_paths.py"), "-k",
                                   "cuda"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
