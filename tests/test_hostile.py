"""Hostile input, fuzzed: every mutated checkpoint, config, template, flag or request ends in success or in one
clean error (a one-line SmolError, one stderr line and a non-zero exit, or a 4xx JSON body), never another
exception, a hang or a huge allocation.

Each class is seeded with random.Random(0), so a failure names an input that reproduces. Counts per class are
printed (visible with -s) and recorded with record_property.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time

from conftest import tiny_model
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType as Q
from gguf_files import gguf_metadata, gguf_tensors, write_fields
from tokenizers import pre_tokenizers

from smollm2 import PRESETS, SmolError, SmolLM2, Tokenizer
from smollm2.cli import main
from smollm2.server import create_app

SLOW = 2.0  # seconds: a case slower than this would be a hang or an allocation the loaders should have refused


class Tally:
    """Outcomes of one class: ok, clean error, or unclean (with the input that caused it)."""

    def __init__(self, name: str):
        self.name, self.ok, self.clean, self.unclean = name, 0, 0, []

    def run(self, case, attempt) -> None:
        """attempt() returns True (success) or False (clean error), or raises (unclean)."""
        key = repr(case)
        start = time.perf_counter()
        try:
            clean = not attempt()
        except Exception as e:  # anything but the clean outcomes is what this test looks for
            self.unclean.append(f"{key[:500]}: {type(e).__name__}: {str(e)[:300]}")
            return
        seconds = time.perf_counter() - start
        if seconds > SLOW:
            self.unclean.append(f"{key[:500]}: took {seconds:.1f} s")
        elif clean:
            self.clean += 1
        else:
            self.ok += 1

    def finish(self, record_property) -> None:
        cases = self.ok + self.clean + len(self.unclean)
        line = f"{self.name}: {cases} cases, {self.ok} ok, {self.clean} clean errors, {len(self.unclean)} unclean"
        print(line)
        record_property(self.name, line)
        assert not self.unclean, "\n".join(self.unclean)


def loads_cleanly(load) -> bool:
    """True if load() succeeds, False if it raises a one-line SmolError; anything else propagates."""
    try:
        load()
    except SmolError as e:
        assert str(e).strip() and "\n" not in str(e), f"not one line: {str(e)!r}"
        return False
    return True


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
GGUF_KEYS = ["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
             "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
             "llama.rope.dimension_count", "llama.attention.key_length", "tokenizer.ggml.tokens",
             "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
             "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"]


def gguf_fields() -> dict:
    fields = gguf_metadata(GGUF_CONFIG)
    fields.update({"tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.pre": ("str", "smollm"),
                   "tokenizer.ggml.tokens": ("arr", TOKENS),
                   "tokenizer.ggml.token_type": ("arr", [3, 3] + [1] * (len(TOKENS) - 2)),
                   "tokenizer.ggml.merges": ("arr", ["h i"]),
                   "tokenizer.chat_template": ("str", "{% for m in messages %}{{ m['content'] }}{% endfor %}")})
    return fields


def test_hostile_gguf_metadata(tmp_path, record_property):
    rng, tally = random.Random(0), Tally("gguf metadata")
    tensors = gguf_tensors(tiny_model(GGUF_CONFIG), Q.F32)
    path = tmp_path / "hostile.gguf"
    write_fields(path, gguf_fields(), tensors)
    # The unmutated file loads: otherwise every case below would be a clean error for the wrong reason.
    assert loads_cleanly(lambda: SmolLM2.from_pretrained(path))
    assert loads_cleanly(lambda: Tokenizer.from_pretrained(path))
    for _ in range(80):
        fields = gguf_fields()
        case = {}
        for key in rng.sample(GGUF_KEYS, rng.randint(1, 3)):
            case[key] = rng.choice(GGUF_HOSTILE + [("arr", list(range(300))), ("arr", TOKENS[:100])])
        fields.update(case)
        write_fields(path, fields, tensors)
        tally.run(("model", case), lambda: loads_cleanly(lambda: SmolLM2.from_pretrained(path)))
        tally.run(("tokenizer", case), lambda: loads_cleanly(lambda: Tokenizer.from_pretrained(path)))
    tally.finish(record_property)


# 2. HF directory config.json

HF_KEYS = ["hidden_size", "num_hidden_layers", "max_position_embeddings", "rope_theta", "rms_norm_eps",
           "rope_scaling", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
           "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "initializer_range"]


def test_hostile_config_json(tmp_path, tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("config.json")
    directory = tmp_path / "model"
    shutil.copytree(tiny_dir, directory)
    good = json.loads((directory / "config.json").read_text())
    for _ in range(80):
        case = {key: rng.choice(JSON_HOSTILE + [{"type": "linear", "factor": 2.0}, [2, "x"]])
                for key in rng.sample(HF_KEYS, rng.randint(1, 3))}
        # JSON has no inf or NaN, but Python's json writes them and reads them back, as transformers' files may.
        (directory / "config.json").write_text(json.dumps({**good, **case}))
        tally.run(case, lambda: loads_cleanly(lambda: SmolLM2.from_pretrained(directory)))
    tally.finish(record_property)


# 3. Chat templates and tokenizer_config.json

HOSTILE_TEMPLATES = [
    "{% for i in range(10**12) %}x{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ ('x' * 10**5) * 10**5 }}",
    "{% for i in range(10**4) %}{% for j in range(10**4) %}ab{% endfor %}{% endfor %}",
    "{{ x | no_such_filter }}",
    "{% for m in messages %}{{ m.content }",
    "{% if %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception('no') }}",
    "{{ 2 ** 10**8 }}",
    "{{ '%999999999d' | format(1) }}",
    "{{ 'x' | center(10**10) }}",
    "{{ messages | tojson(indent=10**9) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ [1] * 10**10 }}",
    "{{ range(10**9) | list }}",
    "{{ 1 / 0 }}",
    "{{ messages[10**9] }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}{{ eos_token }}",
]
TOKEN_VALUES = ["<|im_start|>", "<|im_end|>", "<no such token>", 1, 1.5, ["<|im_end|>"], {"content": 2},
                {"content": "<|im_end|>"}, None, True]
TEMPLATE_VALUES = [1, ["x"], [{"name": "default", "template": "{{ 1 }}"}], [{"name": 1}], {"a": 1}, None, True]


def test_hostile_chat_templates(tmp_path, tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("chat templates")
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_dir, directory)
    good = json.loads((directory / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "Hi"}]

    def render():
        tokenizer = Tokenizer.from_pretrained(directory)
        tokenizer.render_chat(messages)
        tokenizer.apply_chat_template(messages)
        return True

    for _ in range(80):
        case = {}
        if rng.random() < 0.7:
            template = rng.choice(HOSTILE_TEMPLATES)
            if rng.random() < 0.3:  # two hostile pieces together, each within the limits alone
                template += rng.choice(HOSTILE_TEMPLATES)
            case["chat_template"] = template
        else:
            case["chat_template"] = rng.choice(TEMPLATE_VALUES)
        for key in rng.sample(["bos_token", "eos_token", "pad_token"], rng.randint(0, 2)):
            case[key] = rng.choice(TOKEN_VALUES)
        (directory / "tokenizer_config.json").write_text(json.dumps({**good, **case}))
        tally.run(case, lambda: loads_cleanly(render))
    tally.finish(record_property)


# 4. CLI arguments

CLI_VALUES = ["-1", "0", "1", "2", "1.5", "-0.5", "nan", "inf", "-inf", "1e9", "2147483648", str(2**64),
              "abc", "", " ", "0x10", "1_000", "\u0661", "99999999999999999999999999"]


def test_hostile_cli_arguments(tmp_path, tiny_dir, capsys, record_property):
    rng, tally = random.Random(0), Tally("cli arguments")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    model = ["--model", str(tiny_dir)]
    # Each command's flags, and arguments that keep a run that parses cheap: two new tokens, and a serve
    # that stops at --compile (refused by serve) instead of listening.
    commands = {
        "generate": (["--threads", "--seed", "--temperature", "--top-k", "--top-p", "--max-new-tokens", "--min-p",
                      "--repetition-penalty"], ["generate", *model, "--max-new-tokens", "2", "Hello"]),
        "perplexity": (["--threads", "--context", "--stride"], ["perplexity", *model, str(text)]),
        "serve": (["--threads", "--port", "--max-batch-size"], ["serve", *model, "--compile"]),
    }

    def run(argv):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's errors, as `python -m smollm2` exits with them
            code = e.code
        captured = capsys.readouterr()
        if code == 0:
            return True
        lines = captured.err.strip().splitlines()
        assert code and len(lines) == 1 and lines[0].strip() and "Traceback" not in captured.err, (code, captured.err)
        return False

    for _ in range(60):
        command = rng.choice(list(commands))
        flags, base = commands[command]
        mutated = []
        for flag in rng.sample(flags, rng.randint(1, 2)):
            mutated += [flag, rng.choice(CLI_VALUES)]
        # Flags after the prompt still parse; a later --max-new-tokens overrides the cheap default, so bound it.
        if "--max-new-tokens" in mutated:
            value = mutated[mutated.index("--max-new-tokens") + 1]
            if value.lstrip("-").isdigit() and int(value) > 64:
                mutated[mutated.index("--max-new-tokens") + 1] = "-" + value
        argv = base + mutated
        tally.run(argv, lambda: run(argv))
    tally.finish(record_property)


# 5. Server requests

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
MESSAGES = [[], "hi", [{"role": "user"}], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 1}],
            [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "a\udfffb"}], [None], [[1]],
            [{"role": "user", "content": ["hi"]}], [{"role": "user", "content": None}], {"role": "user"},
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user", "content": [{}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
            [{"role": "user", "content": "x" * 10**6}], [{"role": "user", "content": "hi", "extra": 1}]]


def test_hostile_server_requests(tiny_dir, record_property):
    rng, tally = random.Random(0), Tally("server requests")
    model, tokenizer = SmolLM2.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)

    def post(client, path, body):
        # json= cannot carry lone surrogates, NaN or infinity as a client might send them: encode by hand.
        content = json.dumps(body).encode("utf-8", "surrogatepass")
        r = client.post(path, content=content, headers={"Content-Type": "application/json"})
        if r.status_code == 200:
            return True
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "message" in r.json()["error"], r.text
        return False

    # A short window keeps requests whose max_tokens is left out (or huge but allowed) short.
    with TestClient(create_app(model, tokenizer, model_name="tiny", max_seq_len=64)) as client:
        # The unmutated requests succeed: otherwise every case below would be refused for the wrong reason.
        assert post(client, "/v1/completions", dict(model="tiny", max_tokens=2, temperature=0, prompt="Hello"))
        assert post(client, "/v1/chat/completions",
                    dict(model="tiny", max_tokens=2, temperature=0, messages=[{"role": "user", "content": "Hi"}]))
        for _ in range(80):
            chat = rng.random() < 0.5
            body = dict(model="tiny", max_tokens=2, temperature=0)
            body.update(dict(messages=[{"role": "user", "content": "Hi"}]) if chat else dict(prompt="Hello"))
            for field in rng.sample(list(SERVER_FIELDS), rng.randint(1, 3)):
                body[field] = rng.choice(SERVER_FIELDS[field])
            if rng.random() < 0.4:
                if chat:
                    body["messages"] = rng.choice(MESSAGES)
                else:
                    body["prompt"] = rng.choice(["", "\ud800", 1, None, ["Hi"], "x" * 10**6])
            path = "/v1/chat/completions" if chat else "/v1/completions"
            tally.run((path, body), lambda: post(client, path, body))
        assert client.get("/health").json()["status"] == "ok"  # and the server is still up
    tally.finish(record_property)
