"""Hostile input, fuzzed, each outcome checked against what the input deserves: a mutated checkpoint, config,
template, flag or request that is invalid is refused with one clean error naming what is wrong (a one-line
SmolError, one stderr line and a non-zero exit, or a 4xx JSON body); a valid one succeeds and gives what it
asks for (the values read back, the text rendered, the tokens, choices and log-probabilities requested). Never
another exception, a hang, a huge allocation, or an invalid input quietly accepted.

Whether an input is valid is decided here, from the rules the loaders, the CLI and the server state, not by
running the code under test. Each class is seeded with random.Random(0), so a failure names an input that
reproduces. Counts per class are printed (visible with -s) and recorded with record_property.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
from conftest import tiny_model
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType as Q
from gguf_files import gguf_metadata, gguf_tensors, write_fields
from tokenizers import pre_tokenizers

from smollm2 import PRESETS, SmolError, Tokenizer, evaluate, load
from smollm2.cli import MAX_BATCH_SIZE, MAX_THREADS, main
from smollm2.generation import stream
from smollm2.server import create_app

SLOW = 15.0  # seconds: past this a case is a hang or an allocation that should have been refused (a case takes
# milliseconds; the margin is for a loaded 2-core machine)


class Refused(NamedTuple):
    message: str


def named(message: str, names: set[str]) -> bool:
    """Whether the message names one of these fields (as written, or with spaces for underscores)."""
    return any(name in message or name.replace("_", " ") in message for name in names)


class Tally:
    """Outcomes of one class: valid inputs that succeeded as expected, invalid ones refused as expected, and the
    wrong outcomes (with the input that caused each)."""

    def __init__(self, name: str):
        self.name, self.ok, self.refused, self.wrong = name, 0, 0, []

    def run(self, case, attempt: Callable, invalid: set[str], check: Callable = lambda result: None) -> None:
        """attempt() returns a result, or Refused(message) for a clean refusal; anything it raises is a wrong
        outcome. invalid: the fields that make the case invalid, one of which the refusal must name; none: a valid
        case, whose result check() asserts on."""
        start = time.perf_counter()
        try:
            result = attempt()
            if invalid:
                assert isinstance(result, Refused), f"accepted, but {sorted(invalid)} invalid"
                assert named(result.message, invalid), f"{result.message!r} names none of {sorted(invalid)}"
            else:
                assert not isinstance(result, Refused), f"refused a valid input: {result.message}"
                check(result)
        except Exception as e:  # an assertion above, or an unclean failure: what this test looks for
            self.wrong.append(f"{repr(case)[:500]}: {type(e).__name__}: {str(e)[:300]}")
            return
        seconds = time.perf_counter() - start
        if seconds > SLOW:
            self.wrong.append(f"{repr(case)[:500]}: took {seconds:.1f} s")
        elif invalid:
            self.refused += 1
        else:
            self.ok += 1

    def finish(self, record_property) -> None:
        cases = self.ok + self.refused + len(self.wrong)
        line = f"{self.name}: {cases} cases, {self.ok} valid and served, {self.refused} invalid and refused, " \
               f"{len(self.wrong)} wrong"
        print(line)
        record_property(self.name, line)
        assert not self.wrong, "\n".join(self.wrong)
        assert self.ok and self.refused, "every case valid, or every one invalid: the mutations test too little"


def outcome(load: Callable):
    """load()'s result, or Refused with the message of the one-line SmolError it raised."""
    try:
        return load()
    except SmolError as e:
        assert str(e).strip() and "\n" not in str(e), f"not one line: {str(e)!r}"
        return Refused(str(e))


def integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def positive(v) -> bool:
    """A finite positive number, as a float can hold it."""
    try:
        return number(v) and 0 < float(v) < math.inf
    except OverflowError:
        return False


def approx(value):
    """A config's float fields hold what the file held, to float32's 7 digits."""
    return pytest.approx(value, rel=1e-6) if number(value) else value


# Wrong types and values, as GGUF metadata (kind, value) and as JSON.
GGUF_HOSTILE = [("str", "64"), ("str", ""), ("arr", [2, 2]), ("arr", ["a"]), ("f32", 1.5), ("f32", -1.0),
                ("f32", math.inf), ("f32", -math.inf), ("f32", math.nan), ("f64", 1e300), ("u32", 0),
                ("u32", 2**32 - 1), ("u64", 2**40), ("u64", 2**63), ("i32", -1), ("i64", -2**40),
                ("bool", True), ("u32", 3), ("u32", 1)]
JSON_HOSTILE = ["64", "", [2, 2], {"a": 1}, 1.5, -1, -1.0, 0, 2**40, 2**63, 10**30, None, True, False,
                math.inf, -math.inf, math.nan, 3, 1e-30]


# 1. GGUF metadata

# A vocabulary small enough that each mutated file is written in milliseconds: the byte alphabet, two control
# tokens, one merge and fillers up to the embedding's rows, as tests/test_tokenizer.py's tiny_gguf.
GGUF_CONFIG = dataclasses.replace(PRESETS["tiny"], vocab_size=320)
TOKENS = ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["hi"]
TOKENS += [f"<extra{i}>" for i in range(GGUF_CONFIG.vocab_size - len(TOKENS))]
ABSENT = object()  # a key the file does not hold: GGUFWriter leaves out an empty string


def gguf_fields() -> dict:
    fields = gguf_metadata(GGUF_CONFIG)
    fields.update({"tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.pre": ("str", "smollm"),
                   "tokenizer.ggml.tokens": ("arr", TOKENS),
                   "tokenizer.ggml.token_type": ("arr", [3, 3] + [1] * (len(TOKENS) - 2)),
                   "tokenizer.ggml.merges": ("arr", ["h i"]),
                   "tokenizer.chat_template": ("str", "{% for m in messages %}{{ m['content'] }}{% endfor %}")})
    return fields


def token_id(v) -> bool:
    return integer(v) and 0 <= v < GGUF_CONFIG.vocab_size


# What the model's loader needs of each key it reads: (the config field it becomes, whether a value is valid,
# whether the tensors' shapes depend on it: a value they contradict may be refused naming the tensor instead).
MODEL_KEYS = {
    "llama.block_count": ("num_hidden_layers", lambda v: integer(v) and v == 2, True),
    "llama.embedding_length": ("hidden_size", lambda v: integer(v) and v == 64, True),
    "llama.feed_forward_length": ("intermediate_size", lambda v: integer(v) and v == 256, True),
    "llama.attention.head_count": ("num_attention_heads", lambda v: integer(v) and v == 4, True),
    "llama.attention.head_count_kv": ("num_key_value_heads", lambda v: integer(v) and v == 2, True),
    "llama.context_length": ("max_position_embeddings", lambda v: integer(v) and 1 <= v <= 2**24, False),
    "llama.rope.freq_base": ("rope_theta", lambda v: v is ABSENT or positive(v), False),
    "llama.attention.layer_norm_rms_epsilon": ("rms_norm_eps", positive, False),
    "llama.vocab_size": ("vocab_size", lambda v: v is ABSENT or (integer(v) and v == 320), True),
    "llama.rope.dimension_count": ("head_dim", lambda v: v is ABSENT or (integer(v) and v == 16), False),
    "llama.attention.key_length": ("head_dim", lambda v: v is ABSENT or (integer(v) and v == 16), True),
    "tokenizer.ggml.bos_token_id": ("bos_token_id", lambda v: v is ABSENT or token_id(v), False),
    "tokenizer.ggml.eos_token_id": ("eos_token_id", lambda v: v is ABSENT or token_id(v), False),
}


def merges_valid(v) -> bool:
    pairs = [m.split(" ") for m in v] if isinstance(v, list) and all(isinstance(m, str) for m in v) else None
    return bool(pairs) and all(len(p) == 2 and all(t in TOKENS for t in p) and "".join(p) in TOKENS for p in pairs)


# What the tokenizer's loader needs of each key it reads.
TOKENIZER_KEYS = {
    "tokenizer.ggml.tokens": lambda v: isinstance(v, list) and len(v) == 320 and all(isinstance(t, str) for t in v),
    "tokenizer.ggml.token_type": lambda v: v is ABSENT or (isinstance(v, list) and len(v) == 320
                                                           and all(integer(t) for t in v)),
    "tokenizer.ggml.merges": merges_valid,
    "tokenizer.ggml.bos_token_id": lambda v: v is ABSENT or token_id(v),
    "tokenizer.ggml.eos_token_id": lambda v: v is ABSENT or token_id(v),
    "tokenizer.chat_template": lambda v: v is ABSENT or isinstance(v, str),
}


def read_value(kind: str, value):
    """What a reader gets for a value written as (kind, value)."""
    if kind == "str" and value == "":
        return ABSENT
    return float(np.float32(value)) if kind == "f32" else value


def test_hostile_gguf_metadata(tmp_path, record_property):
    rng = random.Random(0)
    model_tally, tokenizer_tally = Tally("gguf metadata, model"), Tally("gguf metadata, tokenizer")
    tensors = gguf_tensors(tiny_model(GGUF_CONFIG), Q.F32)
    path = tmp_path / "hostile.gguf"
    for _ in range(80):
        fields = gguf_fields()
        case = {key: rng.choice(GGUF_HOSTILE + [("arr", list(range(300))), ("arr", TOKENS[:100])])
                for key in rng.sample(sorted(MODEL_KEYS.keys() | TOKENIZER_KEYS.keys()), rng.randint(1, 3))}
        fields.update(case)
        write_fields(path, fields, tensors)
        values = {key: read_value(*value) for key, value in case.items()}

        invalid = set()
        for key, value in values.items():
            if key in MODEL_KEYS and not MODEL_KEYS[key][1](value):
                field, _, shapes = MODEL_KEYS[key]
                invalid |= {key, field} | ({"tensor"} if shapes else set())

        def model_read_back(model):
            for key, value in values.items():
                field = MODEL_KEYS.get(key, (None,))[0]
                if field is not None and value is not ABSENT:
                    assert getattr(model.config, field) == approx(value), (field, getattr(model.config, field))
            assert torch.isfinite(model(torch.tensor([[1]]))).all()

        model_tally.run(("model", case), lambda: outcome(lambda: load(path, kernels=False)),
                        invalid, model_read_back)

        invalid = {key for key, value in values.items() if key in TOKENIZER_KEYS and not TOKENIZER_KEYS[key](value)}

        def tokenizer_read_back(tokenizer):
            assert tokenizer.encode("hi") == [TOKENS.index("hi")]
            for which in ("bos", "eos"):
                if (value := values.get(f"tokenizer.ggml.{which}_token_id")) is not None:
                    assert getattr(tokenizer, f"{which}_token_id") == (None if value is ABSENT else value)
            if (template := values.get("tokenizer.chat_template")) is not None:
                assert tokenizer.chat_template == (None if template is ABSENT else template)

        tokenizer_tally.run(("tokenizer", case), lambda: outcome(lambda: Tokenizer.from_pretrained(path)), invalid,
                            tokenizer_read_back)
    model_tally.finish(record_property)
    tokenizer_tally.finish(record_property)


# 2. HF directory config.json

def token_ids(v, lists: bool = False) -> bool:
    ids = v if lists and isinstance(v, list) and v else [v]
    return v is None or all(integer(i) and 0 <= i < 49152 for i in ids)


# What each key of config.json must hold for the tiny model's tensors: (valid, whether the tensors' shapes depend
# on it), as MODEL_KEYS.
HF_KEYS = {
    "hidden_size": (lambda v: integer(v) and v == 64, True),
    "num_hidden_layers": (lambda v: integer(v) and v == 2, True),
    "intermediate_size": (lambda v: integer(v) and v == 256, True),
    "num_attention_heads": (lambda v: integer(v) and v == 4, True),
    "num_key_value_heads": (lambda v: integer(v) and v == 2, True),
    "head_dim": (lambda v: v is None or (integer(v) and v == 16), True),
    "vocab_size": (lambda v: integer(v) and v == 49152, True),
    "tie_word_embeddings": (lambda v: v is True, True),  # the directory holds no lm_head.weight
    "max_position_embeddings": (lambda v: integer(v) and 1 <= v <= 2**24, False),
    "rope_theta": (positive, False),
    "rms_norm_eps": (positive, False),
    "initializer_range": (positive, False),
    "rope_scaling": (lambda v: v is None or (isinstance(v, dict) and v.get("rope_type", v.get("type", "default"))
                                             == "default"), False),
    "bos_token_id": (token_ids, False),
    "eos_token_id": (lambda v: token_ids(v, lists=True), False),
    "pad_token_id": (token_ids, False),
}


def test_hostile_config_json(tmp_path, tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("config.json")
    directory = tmp_path / "model"
    shutil.copytree(tiny_dir, directory)
    good = json.loads((directory / "config.json").read_text())
    for _ in range(80):
        # the file's own value too, often, so that some cases are valid
        case = {key: rng.choice(JSON_HOSTILE + [{"type": "linear", "factor": 2.0}, [2, "x"]] + [good.get(key)] * 8)
                for key in rng.sample(sorted(HF_KEYS), rng.randint(1, 3))}
        # JSON has no inf or NaN, but Python's json writes them and reads them back, as transformers' files may.
        (directory / "config.json").write_text(json.dumps({**good, **case}))
        invalid = set()
        for key, value in case.items():
            valid, shapes = HF_KEYS[key]
            if not valid(value):
                invalid |= {key} | ({"tensor"} if shapes else set())

        def read_back(model):
            for key, value in case.items():
                if key != "rope_scaling" and value is not None:
                    assert getattr(model.config, key) == approx(value), key

        tally.run(case, lambda: outcome(lambda: load(directory, kernels=False)), invalid,
                  read_back)
    tally.finish(record_property)


# 3. Chat templates and tokenizer_config.json

MESSAGES = [{"role": "user", "content": "Hi"}]
# Each template, and what it renders for MESSAGES (bos and eos written {bos} and {eos}), or None: refused.
TEMPLATES = {
    "{% for i in range(10**12) %}x{% endfor %}": None,
    "{{ 'x' * 10**10 }}": None,
    "{{ ('x' * 10**5) * 10**5 }}": None,
    "{% for i in range(10**4) %}{% for j in range(10**4) %}ab{% endfor %}{% endfor %}": None,
    "{{ x | no_such_filter }}": None,
    "{% for m in messages %}{{ m.content }": None,
    "{% if %}": None,
    "{{ ''.__class__.__mro__[1].__subclasses__() }}": None,
    "{{ messages.__class__.__init__.__globals__ }}": None,
    "{{ raise_exception('no') }}": None,
    "{{ 2 ** 10**8 }}": str(1024**8),  # Jinja's ** binds left to right: (2 ** 10) ** 8
    "{{ '%999999999d' | format(1) }}": None,
    "{{ 'x' | center(10**10) }}": None,
    "{{ messages | tojson(indent=10**9) }}": None,
    "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}": None,
    "{{ [1] * 10**10 }}": None,
    "{{ range(10**9) | list }}": None,
    "{{ 1 / 0 }}": None,
    "{{ messages[10**9] }}": "",  # undefined, which renders as nothing
    "{{ '{:>999999999}'.format(1) }}": None,
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": None,
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}{{ eos_token }}":
        "{bos}user: Hi{eos}",
}
# chat_template values that are not templates: the template they name, or None: refused
TEMPLATE_VALUES = [(1, None), (["x"], None), ([{"name": "default", "template": "{{ 1 }}"}], "1"), ([{"name": 1}], None),
                   ({"a": 1}, None), (None, None), (True, None)]
# bos_token, eos_token, pad_token values: the token's text, or None: refused (the missing key is None's)
TOKEN_VALUES = [("<|im_start|>", "<|im_start|>"), ("<|im_end|>", "<|im_end|>"), ("<no such token>", None),
                (1, None), (1.5, None), (["<|im_end|>"], None), ({"content": 2}, None),
                ({"content": "<|im_end|>"}, "<|im_end|>"), (None, ""), (True, None)]


def test_hostile_chat_templates(tmp_path, tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("chat templates")
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_dir, directory)
    good = json.loads((directory / "tokenizer_config.json").read_text())

    def render():
        tokenizer = Tokenizer.from_pretrained(directory)
        return tokenizer.render_chat(MESSAGES), tokenizer.apply_chat_template(MESSAGES), tokenizer

    for _ in range(80):
        case, invalid = {}, set()
        if rng.random() < 0.7:
            template = rng.choice(list(TEMPLATES))
            expected = TEMPLATES[template]
            if rng.random() < 0.3:  # two hostile pieces together, each within the limits alone
                second = rng.choice(list(TEMPLATES))
                template += second
                expected = None if expected is None or TEMPLATES[second] is None else expected + TEMPLATES[second]
        else:
            template, expected = rng.choice(TEMPLATE_VALUES)
        case["chat_template"] = template
        if expected is None:
            invalid.add("chat_template")
        texts = {"bos": good["bos_token"], "eos": good["eos_token"]}
        for key in rng.sample(["bos_token", "eos_token", "pad_token"], rng.randint(0, 2)):
            case[key], text = rng.choice(TOKEN_VALUES)
            texts[key.removesuffix("_token")] = text
            if text is None:
                invalid.add(key)
        (directory / "tokenizer_config.json").write_text(json.dumps({**good, **case}))

        def rendered(result):
            text, ids, tokenizer = result
            assert text == expected.format(**texts), text[:200]
            assert ids == tokenizer.encode(text)

        tally.run(case, lambda: outcome(render), invalid, rendered)
    tally.finish(record_property)


# 4. CLI arguments

CLI_VALUES = ["-1", "0", "1", "2", "1.5", "-0.5", "nan", "inf", "-inf", "1e9", "2147483648", str(2**64),
              "abc", "", " ", "0x10", "1_000", "\u0661", "99999999999999999999999999"]
CONTEXT = 512  # the tiny model's window


def parsed(text: str, kind: type):
    """The value, as the CLI's parser reads it (Python's int() or float()), or None where it cannot."""
    try:
        return kind(text)
    except ValueError:
        return None


def whole(low: int, high: float = math.inf) -> Callable:
    return lambda text: (v := parsed(text, int)) is not None and low <= v <= high


def real(valid: Callable) -> Callable:
    return lambda text: (v := parsed(text, float)) is not None and math.isfinite(v) and valid(v)


# What each flag's value must be.
FLAGS = {
    "--threads": whole(1, MAX_THREADS),
    "--seed": whole(0, 2**64 - 1),
    "--temperature": real(lambda v: v >= 0),
    "--top-k": whole(0),
    "--top-p": real(lambda v: 0 < v <= 1),
    "--max-new-tokens": whole(0, CONTEXT - 1),  # after the one-token prompt
    "--min-p": real(lambda v: 0 <= v <= 1),
    "--repetition-penalty": real(lambda v: v > 0),
    "--port": whole(1, 65535),
    "--max-batch-size": whole(1, MAX_BATCH_SIZE),
    "--context": whole(2),  # then read as at most the model's window, which a stride must fit
    "--stride": whole(1),
}
SAMPLING = {"--seed": "seed", "--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p",
            "--min-p": "min_p", "--repetition-penalty": "repetition_penalty"}


def test_hostile_cli_arguments(tmp_path, tiny_dir, capsys, record_property):
    rng, tally = random.Random(0), Tally("cli arguments")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    # Each command's flags, and arguments that keep a run that parses cheap: two new tokens, and a serve that
    # stops at --compile (refused by serve) instead of listening.
    commands = {
        "generate": (["--threads", "--seed", "--temperature", "--top-k", "--top-p", "--max-new-tokens", "--min-p",
                      "--repetition-penalty"],
                     ["generate", "--model", str(tiny_dir), "--max-new-tokens", "2", "Hello"]),
        "perplexity": (["--threads", "--context", "--stride"], ["perplexity", "--model", str(tiny_dir), str(text)]),
        "serve": (["--threads", "--port", "--max-batch-size"], ["serve", "--model", str(tiny_dir), "--compile"]),
    }

    def run(argv):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's errors, as `python -m smollm2` exits with them
            code = e.code
        captured = capsys.readouterr()
        if code == 0:
            return captured.out
        lines = captured.err.strip().splitlines()
        assert code and len(lines) == 1 and lines[0].strip() and "Traceback" not in captured.err, (code, captured.err)
        return Refused(lines[0])

    for _ in range(60):
        command = rng.choice(list(commands))
        flags, base = commands[command]
        values = {flag: rng.choice(CLI_VALUES) for flag in rng.sample(flags, rng.randint(1, 2))}
        # A large --max-new-tokens would generate for long: over the window, it is refused all the same.
        if values.get("--max-new-tokens", "").lstrip("-").isdigit() and int(values["--max-new-tokens"]) > 64:
            values["--max-new-tokens"] = str(CONTEXT)
        invalid = {flag for flag, value in values.items() if not FLAGS[flag](value)}
        if command == "perplexity" and not invalid:  # a stride must fit the window the --context gives
            window = min(int(values.get("--context", "1024")), CONTEXT)
            stride = int(values.get("--stride", window // 2))
            if not 0 < stride < window:
                invalid = {"--stride", "--context"} & (values.keys() | {"--stride"})

        def served(out):
            if command == "generate":
                sampling = dict(temperature=0.2, top_p=0.9) | {SAMPLING[f]: parsed(v, int if f in ("--seed", "--top-k")
                                                                                    else float)
                                                               for f, v in values.items() if f in SAMPLING}
                steps = [s for (s,) in stream(model, [tokenizer.encode("Hello")],
                                              int(values.get("--max-new-tokens", 2)), tokenizer=tokenizer, **sampling)]
                if "--seed" in values:  # then the answer is that seed's
                    assert out == "".join(s.text for s in steps) + "\n"
                assert len(tokenizer.encode(out.removesuffix("\n"))) <= len(steps) + 1
            else:
                window = min(int(values.get("--context", "1024")), CONTEXT)
                stride = int(values.get("--stride", window // 2))
                expected = evaluate.perplexity(model, tokenizer.encode(text.read_text()), window, stride).perplexity
                assert f"perplexity {expected:.4f}" in out, out

        argv = base + [item for flag, value in values.items() for item in (flag, value)]
        if command == "serve" and not invalid:  # valid flags: it goes on to refuse --compile
            tally.run(argv, lambda: run(argv), {"--compile"})
        else:
            names = {name for flag in invalid for name in (flag.lstrip("-"), flag.lstrip("-").replace("-", "_"))}
            tally.run(argv, lambda: run(argv), names, served)
    tally.finish(record_property)


# 5. Server requests

WINDOW = 64  # the server's context window below: a request whose max_tokens is left out (or huge) stays short
BODY_LIMIT = 2**20  # create_app's max_body_bytes


def stops(v) -> bool:
    def one(s):
        return isinstance(s, str) and 1 <= len(s) <= 1000 and unicode(s)

    return v is None or one(v) or (isinstance(v, list) and len(v) <= 4 and all(map(one, v)))


def unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


COMMON = {
    "model": lambda v: v == "tiny",
    "temperature": lambda v: number(v) and 0 <= v <= 2,
    "top_p": lambda v: number(v) and 0 < v <= 1,
    "seed": lambda v: v is None or (integer(v) and 0 <= v < 2**64),
    "stop": stops,
    "n": lambda v: integer(v) and 1 <= v <= 8,
    "stream": lambda v: isinstance(v, bool),
}
# What each field of each route must hold (fields a route does not know are ignored: valid whatever they hold).
ROUTES = {
    "/v1/chat/completions": {**COMMON, "max_tokens": lambda v: v is None or (integer(v) and v >= 1),
                             "logprobs": lambda v: isinstance(v, bool),
                             "top_logprobs": lambda v: v is None or (integer(v) and 0 <= v <= 20)},
    "/v1/completions": {**COMMON, "max_tokens": lambda v: v is None or (integer(v) and v >= 0),
                        "logprobs": lambda v: v is None or (integer(v) and 0 <= v <= 20),
                        "echo": lambda v: isinstance(v, bool)},
}
# The first values are valid (or at the edge), so that some cases succeed and the mutations are not all refused
# for one field alone.
SERVER_FIELDS = {
    "max_tokens": [1, 64, 10**6, -1, 0, 1.5, "2", [2], True, 2**64, 10**30, math.inf],
    "temperature": [0.0, 2, 1e-30, -1, 3, "0.5", None, [0.5], math.nan, math.inf, True, 1e308],
    "top_p": [1, 1e-30, 0, -0.1, 1.5, "1", None, math.nan, [1], True],
    "seed": [0, 2**64 - 1, None, -1, 2**64, 10**30, 1.5, "1", [1], True],
    "stop": [None, "\n", ["a", "b"], "", ["a"] * 1000, "x" * 10**5, 1, [1], [None], {"a": 1}, "\ud800",
             ["ok", "\udfff"]],
    "n": [1, 0, 2, 8, 9, "1", 1.5, -1, None],
    "logprobs": [None, True, 0, 5, 20, 21, -1, "1", 1.5],
    "top_logprobs": [None, 0, 20, 21, -1, "2"],
    "echo": [False, True, "yes", 1],
    "stream": [False, "yes", 1, None, [True]],
    "model": ["tiny", 1, None, "", "\ud800", "other"],
}
# Whole messages lists and completion prompts, with whether each is valid (an invalid one names the field).
MESSAGES_VALUES = [
    ([], False), ("hi", False), ([{"role": "user"}], False), ([{"role": "robot", "content": "hi"}], False),
    ([{"role": "user", "content": 1}], False), ([{"role": "user", "content": "\ud800"}], False),
    ([{"role": "user", "content": "a\udfffb"}], False), ([None], False), ([[1]], False),
    ([{"role": "user", "content": ["hi"]}], False), ([{"role": "user", "content": None}], False),
    ({"role": "user"}, False), ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], True),
    ([{"role": "user", "content": [{}]}], False), ([{"role": "user", "content": [{"type": "image_url",
                                                                               "image_url": "x"}]}], False),
    ([{"role": "user", "content": [{"type": "text", "text": ["a"]}]}], False),
    ([{"role": "user", "content": "x" * 10**6}], False),  # beyond what a chat template renders
    ([{"role": "user", "content": "hi", "extra": 1}], True),  # an unknown key is ignored
]
PROMPT_VALUES = [("", False), ("\ud800", False), (1, False), (None, False), (["Hi"], True), ("x" * 10**6, True)]


def server_oracle(chat: bool, body: dict, prompt_valid: bool, tokenizer) -> set[str]:
    """The fields that make the request invalid: those that break their route's rules, the prompt's field where
    its value does, or where the prompt leaves no room in the window; max_tokens where it leaves too little."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    invalid = {field for field, valid in ROUTES[path].items() if field in body and not valid(body[field])}
    if chat and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        invalid.add("top_logprobs")  # it needs logprobs
    where = "messages" if chat else "prompt"
    if not prompt_valid:
        return invalid | {where}
    if chat:
        contents = [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
                    for m in body["messages"]]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "".join(contents)}])
    else:
        prompt = tokenizer.encode(body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0])
    max_tokens = body.get("max_tokens", None if chat else 16)
    if "max_tokens" in invalid:
        return invalid
    if len(prompt) + min(1 if max_tokens is None else max_tokens, 1) > WINDOW:
        invalid.add(where)
    elif max_tokens is not None and len(prompt) + max_tokens > WINDOW:
        invalid.add("max_tokens")
    return invalid


def check_answer(chat: bool, body: dict, response, tokenizer) -> None:
    """A valid request's answer: its choices, their ends, texts and log-probabilities, as the request asked."""
    n, streamed = body.get("n", 1), body.get("stream", False)
    if streamed:
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == set(range(n))
        return
    answer = response.json()
    choices, max_tokens = answer["choices"], body.get("max_tokens", None if chat else 16)
    assert [c["index"] for c in choices] == list(range(n))
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    if max_tokens is not None:
        assert answer["usage"]["completion_tokens"] <= n * max_tokens
    stop = body.get("stop")
    for c in choices:
        text = c["message"]["content"] if chat else c["text"]
        prompt = body.get("prompt")
        if not chat and body.get("echo"):
            echoed = prompt if isinstance(prompt, str) else prompt[0]
            assert text.startswith(echoed)
            text = text[len(echoed):]
        if max_tokens == 0:
            assert text == ""
        for s in [stop] if isinstance(stop, str) else stop or []:
            assert s not in text, (s, text)
        if chat and body.get("logprobs"):
            assert all(len(t["top_logprobs"]) == (body.get("top_logprobs") or 0) for t in c["logprobs"]["content"])
        elif chat:
            assert c["logprobs"] is None
        elif body.get("logprobs") is not None:
            tops = c["logprobs"]["top_logprobs"][1 if body.get("echo") else 0:]
            assert all(1 <= len(top) <= max(body["logprobs"], 1) if body["logprobs"] else not top for top in tops)
        else:
            assert c["logprobs"] is None


def test_hostile_server_requests(tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("server requests")
    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)

    def post(client, path, body):
        # json= cannot carry lone surrogates, NaN or infinity as a client might send them: encode by hand.
        content = json.dumps(body).encode("utf-8", "surrogatepass")
        r = client.post(path, content=content, headers={"Content-Type": "application/json"})
        if r.status_code == 200:
            return r
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        return Refused(r.json()["error"]["message"])

    with TestClient(create_app(model, tokenizer, model_name="tiny", max_seq_len=WINDOW)) as client:
        for _ in range(80):
            chat = rng.random() < 0.5
            body = dict(model="tiny", max_tokens=2, temperature=0)
            body.update(dict(messages=[{"role": "user", "content": "Hi"}]) if chat else dict(prompt="Hello"))
            for field in rng.sample(list(SERVER_FIELDS), rng.randint(1, 3)):
                body[field] = rng.choice(SERVER_FIELDS[field])
            prompt_valid = True
            if rng.random() < 0.4:
                body["messages" if chat else "prompt"], prompt_valid = rng.choice(MESSAGES_VALUES if chat
                                                                                  else PROMPT_VALUES)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            invalid = server_oracle(chat, body, prompt_valid, tokenizer)
            if len(json.dumps(body).encode("utf-8", "surrogatepass")) > BODY_LIMIT:  # refused before it is read
                invalid = {"request body"}
            tally.run((path, body), lambda: post(client, path, body), invalid,
                      lambda response: check_answer(chat, body, response, tokenizer))
        assert client.get("/health").json()["status"] == "ok"  # and the server is still up
    tally.finish(record_property)
