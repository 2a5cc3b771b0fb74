"""Constrained decoding on the CPU: xgrammar against llguidance, with the SmolLM2 tokenizer.

    PYTHONPATH=src .venv/bin/python benchmarks/constrained.py [--rounds 5] [--model-steps 32]

For each library and each grammar (any JSON object, and a few JSON schemas):
  * compile: the time to turn the grammar into something a matcher runs on (first compile, not cached);
  * per token: replaying a fixed valid JSON answer (its tokens, then EOS), the time to compute the allowed-token
    bitmask and to advance the matcher by the token, mean and p99 in microseconds over every token of every round.
The bitmask is then applied to a (V,) logits row the same way for both libraries, timed once as `apply`.
The CPUs may be shared: the model's step time shows how busy they were during the run.
For scale, the embedded model's own decode step (batch 1, fp32) is timed too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from smollm2 import SmolLM2, Tokenizer

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


def schema_text(schema) -> str:
    return json.dumps({"type": "object"} if schema is None else schema)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import xgrammar as xgr
        self.xgr = xgr
        backend = tok.backend.to_str()
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
        vocab = [tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=[tok.eos_token_id], add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def replay(self, compiled, tokens, bitmask: torch.Tensor) -> list[float]:
        m = self.xgr.GrammarMatcher(compiled)
        out = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            ok = m.accept_token(t)
            out.append(time.perf_counter() - t0)
            assert ok, (self.name, t)
        assert m.is_terminated()
        return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import llguidance
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=tok.eos_token_id)
        self.vocab_size = vocab_size

    def compile(self, schema):
        # llguidance compiles lazily, as tokens come: a matcher's construction is the compile.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text(schema))
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return grammar

    def replay(self, grammar, tokens, bitmask: torch.Tensor) -> list[float]:
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        ptr, nbytes = bitmask.data_ptr(), bitmask.numel() * 4
        out = []
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(ptr, nbytes)
            ok = m.consume_token(t)
            out.append(time.perf_counter() - t0)
            assert ok, (self.name, t, m.get_error())
        assert m.is_stopped() or m.is_accepting()
        return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The one apply both libraries' bitmasks (the same layout) can share: xgrammar's C++ CPU kernel, which
    smollm2.generation.grammar uses too."""
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits[None], bitmask[None])


def us(xs) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"mean {statistics.fmean(xs) * 1e6:7.1f} us  p99 {p99 * 1e6:7.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = Tokenizer.from_pretrained()
    V = 49152  # the model's logits width
    answers = {k: tok.encode(v) + [tok.eos_token_id] for k, v in ANSWERS.items()}
    bitmask = torch.zeros((V + 31) // 32, dtype=torch.int32)

    for lib_cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = lib_cls(tok, V)
        print(f"\n{lib.name}: tokenizer setup {(time.perf_counter() - t0) * 1e3:.0f} ms")
        every = []
        for key, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            compile_ms = (time.perf_counter() - t0) * 1e3
            times = []
            for _ in range(args.rounds):
                times += lib.replay(compiled, answers[key], bitmask)
            every += times
            print(f"  {key:12s} compile {compile_ms:7.1f} ms  {len(answers[key]):3d} tokens  per token: {us(times)}")
        print(f"  {'all':12s} {'':29s}per token: {us(every)}")

    logits = torch.randn(V)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        apply_bitmask(logits.clone(), bitmask)
        times.append(time.perf_counter() - t0)
    print(f"\napply (clone + xgrammar CPU kernel on a ({V},) row): {us(times)}")

    from smollm2.generation.steps import decode_step
    model = SmolLM2.from_pretrained()
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
