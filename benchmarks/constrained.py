"""Constrained decoding on the CPU: smollm2's grammars (llguidance) with the SmolLM2 tokenizer.

    PYTHONPATH=src .venv/bin/python benchmarks/constrained.py [--rounds 5] [--model-steps 32]

For each grammar (any JSON object, and a few JSON schemas):
  * compile: the time to turn the grammar into something a matcher runs on (a first compile, not the cache's:
    llguidance compiles lazily, so this is its grammar, its lexer's start and the first mask);
  * per token: replaying a fixed valid JSON answer (its tokens, then EOS), the time of Matcher.allowed() on a (V,)
    logits row and of accept(), mean and p99 in microseconds over every token of every round; and the same without
    applying the mask to the row (llguidance's bitmask, the bound on digits, the advance).
The CPUs may be shared: the model's step time shows how busy they were during the run.
For scale, the embedded model's own decode step (batch 1, fp32) is timed too, and stream() end to end.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from smollm2 import Tokenizer, load
from smollm2.generation import grammar as grammar_module
from smollm2.generation.grammar import Grammar

SCHEMAS = {
    "json_object": None,
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "admin": {"type": "boolean"}},
             "required": ["name", "age", "admin"]},
    "enum+array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["color", "tags"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                 "required": ["id", "email"]},
        "scores": {"type": "array", "items": {"type": "number"}}},
        "required": ["user", "scores"]},
    "bounded": {"type": "object", "properties": {  # maxLength and integer ranges: many more grammar states
        "city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "country", "population"]},
}
ANSWERS = {  # a valid answer for each grammar, as the model might write it
    "json_object": '{"city": "Paris", "population": 2148000, "landmarks": ["Eiffel Tower", "Louvre"], '
                   '"capital": true}',
    "flat": '{"name": "Alice Smith", "age": 42, "admin": false}',
    "enum+array": '{"color": "green", "tags": ["small", "fast", "cheap"]}',
    "nested": '{"user": {"id": 17, "email": "bob@example.com"}, "scores": [1.5, 2.25, 99]}',
    "bounded": '{"city": "São João", "country": "Brazil", "population": 11111111}',
}


def replay(grammar: Grammar, tokens: list[int], apply: bool) -> list[float]:
    """The time of each token's mask (applied to a (V,) logits row where `apply`) and accept(), in seconds."""
    matcher = grammar.matcher()
    logits = torch.randn(grammar.vocab_size)
    out = []
    for t in tokens:
        row = logits.clone()
        t0 = time.perf_counter()
        if apply:
            matcher.allowed(row)
        else:
            matcher._allowed(grammar.vocab_size)
        matcher.accept(t)
        out.append(time.perf_counter() - t0)
    assert matcher.finished
    return out


def us(xs) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"mean {statistics.fmean(xs) * 1e6:6.1f} us  p99 {p99 * 1e6:6.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = Tokenizer.from_pretrained()
    answers = {k: tok.encode(v) + [tok.eos_token_id] for k, v in ANSWERS.items()}

    t0 = time.perf_counter()
    Grammar.from_response_format({"type": "json_object"}, tok)
    print(f"tokenizer tables and a first grammar: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    every, bare = [], []
    for key, schema in SCHEMAS.items():
        response_format = ({"type": "json_object"} if schema is None else
                           {"type": "json_schema", "json_schema": {"name": key, "schema": schema}})
        grammar_module._compiled.clear()  # a first compile, not the cache's
        t0 = time.perf_counter()
        grammar = Grammar.from_response_format(response_format, tok)
        compile_ms = (time.perf_counter() - t0) * 1e3
        applied, masked = [], []
        for _ in range(args.rounds):
            applied += replay(grammar, answers[key], apply=True)
            masked += replay(grammar, answers[key], apply=False)
        every += applied
        bare += masked
        print(f"  {key:11s} compile {compile_ms:5.1f} ms {len(answers[key]):3d} tokens  allowed+accept {us(applied)}"
              f"  | mask+accept {us(masked)}")
    print(f"  {'all':11s} {'':25s}  allowed+accept {us(every)}  | mask+accept {us(bare)}")

    from smollm2.generation.steps import decode_step
    model = load()
    cache = model.new_cache(1, 128)
    ids = torch.tensor([tok.encode("Write JSON:")])
    with torch.inference_mode():
        model.hidden_states(ids, torch.arange(ids.shape[1]), cache.view(length=ids.shape[1]))
        pos, t, times = ids.shape[1], ids[:, -1:], []
        for i in range(args.model_steps):
            t0 = time.perf_counter()
            t = decode_step(model, t, torch.tensor([pos + i]), cache, None).argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    print(f"model decode step (batch 1, fp32, {torch.get_num_threads()} threads): {us(times[4:])}")
    end_to_end(model, tok, args.rounds)


STORY = {"type": "json_schema", "json_schema": {"name": "story", "schema": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                     "story": {"type": "string", "maxLength": 600}},
    "required": ["title", "story"]}}}


def end_to_end(model, tok: Tokenizer, rounds: int, tokens: int = 96) -> None:
    """smollm2's own generation (stream(), batch 1, greedy) with and without response_format, in turns: the
    time per generated token from the first to the last, best of `rounds` each."""
    from smollm2.generation import stream

    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon, as JSON."}])
    best = {}
    for _ in range(rounds):
        for name, response_format in (("plain", None), ("json_schema", STORY)):
            times = [time.perf_counter() for _ in stream(model, [prompt], tokens, eos_token_id=None, tokenizer=tok,
                                                          response_format=response_format)]
            per_token = (times[-1] - times[0]) / (len(times) - 1)
            best[name] = min(best.get(name, (per_token, len(times))), (per_token, len(times)))
    (plain, n), (constrained, m) = best["plain"], best["json_schema"]
    print(f"stream() end to end, per token: plain {plain * 1e3:.2f} ms ({n} tokens), under a JSON schema "
          f"{constrained * 1e3:.2f} ms ({m} tokens): +{(constrained - plain) * 1e3:.2f} ms, "
          f"{constrained / plain:.3f}x")


if __name__ == "__main__":
    main()
