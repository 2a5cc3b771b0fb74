"""llama.cpp reads what `smollm2 export --to gguf` writes as it reads its own files: the embedded
SmolLM2-135M-Instruct exported at each type, against llama.cpp's own conversions of the embedded file.

    every type: every tensor of our file is byte for byte (name, type, bytes) that of llama.cpp's own conversion
          of the embedded file to that type (llama_model_quantize: to F32, then from that F32 file to f16, q8_0
          and q4_1), and so llama.cpp's perplexity on tests/data/english.txt is the same from both files
    f32:  llama.cpp's tokens for the test corpus, tricky strings and chats are ours; its logits from our F32 file
          equal those from its own F32 conversion within 1e-5 on a few chats, and its greedy answers to them are
          identical

Then the test suite's tiny random models, one per branch of the architecture (biases, untied embeddings,
head_dim, grouped/multi-query/multi-head attention), exported at f32: llama.cpp's logits from each equal ours
within 1e-3 (its KV cache holds F16).

Prints a table and exits non-zero if any check fails. llama-cpp-python is not a project dependency: this
borrows the one benchmarks/llamacpp.py builds (`benchmarks/llamacpp.py --build`, once), like that script:
    .venv/bin/python benchmarks/gguf_export.py [--tier native]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from llamacpp import CMAKE_ARGS, THREADS, site_packages, venv_dir  # the sibling benchmark's venv and settings

ROOT = Path(__file__).parents[1]
TRICKY = ["", "  leading and trailing  ", "many    spaces\tand\t\ttabs\n\n\n", "a\r\nb \u00a0c\u3000d",
          "naïve café, straße, ½ ² ³ ٣ ൬, 中文字符，日本語，한국어, العربية", "emoji 😀🎉👍🏽 🇫🇷 👨‍👩‍👧",
          "1234567 and 3.14 and 2024-01-31", "It's, I'm, we'll, they've, IT'S",
          "<|im_start|>user\nHi<|im_end|>\n", "text<|endoftext|>more<file_sep>", "a<|im_startx|>b <|im_end",
          "\u200b\ufeff\x7f�"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"]
LOGIT_TOLERANCE = 1e-5
TINY_TOLERANCE = 1e-3  # llama.cpp's F16 KV cache against our float32 one; logits reach ~1.3
TINY_IDS = [1, 504, 3458, 282, 4760, 314, 216, 1345]
ANSWER_TOKENS, WINDOW = 32, 512
FTYPES = {"f32": 0, "f16": 1, "q4_1": 3, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, ...


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def llama_quantize(source: Path, out: Path, type: str) -> None:
    """llama.cpp's own conversion of `source` to `type` (dequantizing first where the source is quantized)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = FTYPES[type], THREADS, True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not convert {source} to {type}")


def load(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=WINDOW, n_batch=WINDOW, n_threads=THREADS,
                           n_threads_batch=THREADS, logits_all=True, verbose=False)


def all_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def greedy(llm, ids: list[int]) -> list[int]:
    llm.reset()
    llm.eval(ids)
    answer = []
    for _ in range(ANSWER_TOKENS):
        answer.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(answer[-1:])
    return answer


def perplexity(llm, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token, in windows of WINDOW tokens (each from an
    empty context, as `smollm2 perplexity --stride` equal to the window)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW]
        if len(window) < 2:
            break
        logits = torch.from_numpy(all_logits(llm, window)).double()
        nll -= logits[:-1].log_softmax(-1).gather(-1, torch.tensor(window[1:])[:, None]).sum().item()
        count += len(window) - 1
    return math.exp(nll / count)


def same_tensors(ours: Path, theirs: Path) -> tuple[int, int]:
    """How many tensors the two files hold under the same name, of the same type, with the same bytes; and how
    many either holds."""
    mine, reference = ({t.name: t for t in GGUFReader(path).tensors} for path in (ours, theirs))
    same = sum(name in mine and mine[name].tensor_type == t.tensor_type and np.array_equal(mine[name].data, t.data)
               for name, t in reference.items())
    return same, len(mine.keys() | reference.keys())


def tiny_rows(tokenizer, tmp: Path) -> list[tuple]:
    from smollm2.checkpoints import save_gguf

    sys.path.append(str(ROOT / "tests"))
    from conftest import TINY, tiny_model

    rows = []
    for name, config in TINY.items():
        model, path = tiny_model(config), tmp / f"tiny-{name}.gguf"
        save_gguf(config, model.state_dict(), tokenizer.gguf_metadata(), path)
        with torch.inference_mode():
            ours = model(torch.tensor([TINY_IDS]))[0].numpy()
        llm = load(path)
        diff = float(np.abs(all_logits(llm, TINY_IDS) - ours).max())
        llm.close()
        rows.append(("f32", f"tiny {name}: max |logit diff|, llama.cpp vs smollm2", diff, TINY_TOLERANCE,
                     diff <= TINY_TOLERANCE))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", choices=list(CMAKE_ARGS), default="native", help="which llama.cpp build to borrow")
    p.add_argument("--types", default="f32,f16,q8_0,q4_1", help="comma-separated subset of f32,f16,q8_0,q4_1")
    args = p.parse_args()
    types = args.types.split(",")
    if unknown := set(types) - set(FTYPES):
        p.error(f"unknown types {sorted(unknown)}; choose from {list(FTYPES)}")
    venv = venv_dir(args.tier)
    if not (site_packages(venv) / "llama_cpp").is_dir():
        p.error(f"no llama.cpp built for {args.tier} in {venv}: run benchmarks/llamacpp.py --tier {args.tier} --build")
    sys.path.append(str(site_packages(venv)))  # last: the project's own packages stay first
    import llama_cpp

    from smollm2 import Tokenizer
    from smollm2.checkpoints import default_model_path
    from smollm2.cli import main as smollm2

    torch.set_num_threads(THREADS)
    original = default_model_path()
    tokenizer = Tokenizer.from_pretrained(original)
    english = (ROOT / "tests" / "data" / "english.txt").read_text()
    chats = [[{"role": "user", "content": question}] for question in CHATS]
    corpus = [english, *english.splitlines(), *TRICKY, *(tokenizer.render_chat(chat) for chat in chats)]
    chats = [tokenizer.apply_chat_template(chat) for chat in chats]
    rows = []  # (type, check, figure, limit, passed)
    with tempfile.TemporaryDirectory() as tmp:
        llama_f32 = Path(tmp) / "llama-f32.gguf"
        llama_quantize(original, llama_f32, "f32")
        for type in types:
            ours, theirs = Path(tmp) / f"ours-{type}.gguf", Path(tmp) / f"llama-{type}.gguf"
            start = time.perf_counter()
            if smollm2(["export", "--to", "gguf", "--type", type, "--out", str(ours)]) != 0:
                raise SystemExit(f"smollm2 export --type {type} failed")
            log(f"{type}: exported in {time.perf_counter() - start:.1f} s, {ours.stat().st_size / 2**20:.1f} MiB")
            if type != "f32":
                llama_quantize(llama_f32, theirs, type)
            reference = llama_f32 if type == "f32" else theirs
            same, total = same_tensors(ours, reference)
            rows.append((type, "tensors byte for byte llama.cpp's", f"{same}/{total}", "all", same == total))
            ours_llm, theirs_llm = load(ours), load(reference)
            if type == "f32":
                differ = sum(ours_llm.tokenize(text.encode(), add_bos=False, special=True) != tokenizer.encode(text)
                             for text in corpus)
                rows.append((type, f"llama.cpp's tokens = ours ({len(corpus)} texts), mismatches", differ, 0,
                             differ == 0))
                diff = max(float(np.abs(all_logits(ours_llm, ids) - all_logits(theirs_llm, ids)).max())
                           for ids in chats)
                rows.append((type, "max |logit diff| vs llama.cpp's F32, 3 chats", diff, LOGIT_TOLERANCE,
                             diff <= LOGIT_TOLERANCE))
                same = sum(greedy(ours_llm, ids) == greedy(theirs_llm, ids) for ids in chats)
                rows.append((type, f"greedy answers ({ANSWER_TOKENS} tokens) identical", f"{same}/{len(chats)}",
                             f"{len(chats)}/{len(chats)}", same == len(chats)))
            ids = tokenizer.encode(english)
            mine, ref = perplexity(ours_llm, ids), perplexity(theirs_llm, ids)
            rows.append((type, f"perplexity, ours vs llama.cpp's {type} ({len(ids)} tokens)",
                         f"{mine:.4f} vs {ref:.4f} ({mine / ref - 1:+.3%})", "equal", mine == ref))
            log(*rows[-1])
            ours_llm.close()
            theirs_llm.close()
        rows += tiny_rows(tokenizer, Path(tmp))

    print(f"smollm2 export --to gguf vs llama.cpp (llama-cpp-python {llama_cpp.__version__}, {args.tier} build), "
          f"{THREADS} threads; {original.name} as the source")
    print(f"{'type':<6}{'check':<58}{'figure':>34}{'limit':>10}  result")
    for type, check, figure, limit, passed in rows:
        figure = f"{figure:.3g}" if isinstance(figure, float) else figure
        result = "ok" if passed else "FAIL"
        print(f"{type:<6}{check:<58}{figure!s:>34}{limit!s:>10}  {result}")
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
