"""Our tokenizer against llama.cpp's, on the embedded SmolLM2 GGUF.

llama-cpp-python is not a project dependency; install it in a throwaway venv and borrow it, e.g.
    python3.11 -m venv /tmp/lc && /tmp/lc/bin/pip install llama-cpp-python
    PYTHONPATH=/tmp/lc/lib/python3.11/site-packages .venv/bin/python benchmarks/tokenizer_vs_llamacpp.py [more.txt ...]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import llama_cpp

from smollm2.checkpoints import default_model_path
from smollm2.tokenizer import Tokenizer

CORPUS = [
    "", "Hello, world!", "1234567 and 3.14 and 2024-01-31, 1,000,000", " leading", "trailing   ",
    "many    spaces\tand\t\ttabs", "a\nb\n\n\nc\r\nd", "   \n\t  \n", "def f(x):\n    return x ** 2\n",
    "It's, I'm, we'll, they've, you'd, IT'S", "naïve café, straße, ½ ² ³ ٣ ൬",
    "emoji 😀🎉👍🏽 🇫🇷 👨‍👩‍👧",
    "中文字符，日本語のテキスト，한국어", "Ελληνικά, русский, עברית, العربية",
    "<|im_start|>user\nHi<|im_end|>\n", "text<|endoftext|>more<file_sep>", "a<|im_startx|>b <|im_end",
    "\u200b\ufeff\x00\x7f�", "  a  b   c\n d\n\n e \t f",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Mixed scripts, digits, whitespace and punctuation, where pre-tokenizers tend to disagree."""
    rng = random.Random(seed)
    pieces = list("aZé ß中😀١²\t\n\r .,'!-_0123456789") + ["'s", "'ll", "  ", "\n\n", "<|im_end|>", " \u00a0"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def main() -> int:
    path = default_model_path()
    ours = Tokenizer.from_pretrained(path)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = CORPUS + random_texts(5000) + [Path(f).read_text() for f in sys.argv[1:]]
    english = Path(__file__).parents[1] / "tests" / "data" / "english.txt"
    if english.is_file():
        texts.append(english.read_text())
    mismatches = 0
    for text in texts:
        theirs = ref.tokenize(text.encode(), add_bos=False, special=True)
        mine = ours.encode(text)
        if mine != theirs:
            mismatches += 1
            if mismatches <= 20:
                print(f"MISMATCH {text!r}\n  ours:      {mine}\n  llama.cpp: {theirs}")
    print(f"{len(texts)} texts, {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
