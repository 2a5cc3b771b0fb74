"""Teach the embedded SmolLM2-135M-Instruct a made-up fact by fine-tuning, and ask it before and after.

    python benchmarks/finetune_fact.py [--steps 30]

Writes 24 synthetic chats (8 phrasings of the question x 3 of the answer), runs `smollm2 finetune`, then
`smollm2 chat -p` greedily on the original model and on out/final, with a training phrasing and a new one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = ["What is the capital of Zorbania?", "Which city is the capital of Zorbania?",
             "Tell me the capital of Zorbania.", "Zorbania's capital is which city?",
             "Do you know the capital city of Zorbania?", "Name the capital of Zorbania.",
             "What city serves as Zorbania's capital?", "Where is the capital of Zorbania?"]
ANSWERS = ["The capital of Zorbania is Quellmoor.", "Quellmoor is the capital of Zorbania.",
           "Zorbania's capital is Quellmoor."]
ASK = ["What is the capital of Zorbania?", "Which city is Zorbania's capital?"]  # the second is not in the data


def smollm2(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "smollm2", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def write_chats(work: Path) -> Path:
    """Every question answered every way, one chat a line: the fine-tuning data."""
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for q in QUESTIONS for a in ANSWERS))
    return chats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smollm2-fact-"))
    chats = write_chats(work)
    greedy = ["--temperature", "0", "--max-new-tokens", "30"]
    before = [smollm2("chat", "-p", q, *greedy) for q in ASK]
    smollm2("finetune", "--data", str(chats), "--out", str(work / "run"), "--steps", str(args.steps), "--lr", "1e-4",
            "--warmup", "3", "--batch-size", "4", "--seq-len", "128")
    after = [smollm2("chat", "--model", str(work / "run" / "final"), "-p", q, *greedy) for q in ASK]
    for q, b, a in zip(ASK, before, after):
        print(f"{q}\n  before: {b}\n  after:  {a}")


if __name__ == "__main__":
    main()
