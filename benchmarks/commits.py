"""Speed before and after a change: one benchmark run on two commits in turn, in one run, reported as ratios.

    .venv/bin/python benchmarks/commits.py --base REV [--rounds 3] [--at-least FIGURE=RATIO ...] -- ARGS...

ARGS is what follows `python` (e.g. `-m smollm2 bench --compare transformers --json`, or `benchmarks/batch.py
--json`); it must print one JSON object whose "results" are rows with a "system" and tok/s figures, as those
two do. The base side runs REV's code from a temporary git worktree (its src on PYTHONPATH), the other side
this working tree's, with this venv's Python and packages. The sides take turns, each round in the other
order, and each figure is the best of its rounds: these machines are noisy, so the ratio of two sides of one
run is the figure to read, not either side alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def figures(stdout: str) -> dict[str, float]:
    """The run's tok/s figures, by row and name: {"smollm2 decode_tok_s": 75.2, ...}."""
    result = json.loads(stdout.strip().splitlines()[-1])
    return {f"{row['system']} {name}": value for row in result["results"] for name, value in row.items()
            if name.endswith("tok_s")}


def run(checkout: Path, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    done = subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{checkout}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return figures(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--at-least", action="append", default=[], metavar="FIGURE=RATIO",
                        help="exit 1 where head/base of this figure (as printed, e.g. 'smollm2 prefill_tok_s') is "
                             "under RATIO; may be repeated")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then what to run with python")
    args = parser.parse_args()
    bars = {}
    for bar in args.at_least:
        name, _, ratio = bar.rpartition("=")
        try:
            bars[name] = float(ratio)
        except ValueError:
            parser.error(f"--at-least {bar!r}: not FIGURE=RATIO")
    command = args.args[1:] if args.args[:1] == ["--"] else args.args
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            best: dict[str, dict[str, float]] = {"base": {}, "head": {}}
            for r in range(args.rounds):
                sides = [("base", base), ("head", ROOT)]
                for side, checkout in sides if r % 2 == 0 else sides[::-1]:
                    for name, value in run(checkout, command).items():
                        best[side][name] = max(best[side].get(name, 0.0), value)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    print(f"{' '.join(command)}: best of {args.rounds} rounds, base {args.base} vs this tree")
    print(f"{'figure':<40}{'base':>10}{'head':>10}{'head/base':>11}")
    for name, value in best["head"].items():
        before = best["base"].get(name)
        ratio = value / before if before else float("nan")
        print(f"{name:<40}{before or float('nan'):>10.1f}{value:>10.1f}{ratio:>10.3f}x")
    missing = sorted(set(bars) - set(best["head"]))
    under = [f"{name} {value / best['base'][name]:.3f}x < {bars[name]}x" for name, value in best["head"].items()
             if name in bars and not value / best["base"].get(name, float("nan")) >= bars[name]]
    if missing or under:
        sys.exit("under the bars: " + "; ".join(under + [f"{name}: no such figure" for name in missing]))


if __name__ == "__main__":
    main()
