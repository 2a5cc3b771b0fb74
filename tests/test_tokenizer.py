"""The tokenizer against transformers' own tokenizer built from the same GGUF file, and its bad inputs."""

from __future__ import annotations

import json
import random
import time

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from smollm2.errors import SmolError
from smollm2.tokenizer import BoundedSandbox, Tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "1234567 and 3.14 and 2024-01-31, 1,000,000 or 0.5e-10",
    " leading space",
    "trailing spaces   ",
    "many    spaces  and\ttabs\t\there",
    "line one\nline two\n\n\nline five\r\nwindows",
    "   \n\t  \n",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "if (a != b && c >= 0) { return arr[i]; }",
    "It's, I'm, we'll, they've, you'd, she's, they're",
    "naïve café, Ünïcödé, straße",
    "emoji 😀🎉👍🏽 and flags 🇫🇷, family 👨‍👩‍👧",
    "中文字符，日本語のテキスト，한국어 텍스트",
    "Ελληνικά, русский текст, עברית, العربية",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><file_sep><jupyter_code>",
    "<|im_start|><|im_start|>",
    "a<|im_startx|>b <|im_end",
    "\u200b zero width, \ufeff bom, \x00 nul, \x7f del",
    "�replacement char",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello 123!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "Tell me about 中文.\n\nThanks"}],
]


@pytest.fixture(scope="module")
def tok(embedded_path) -> Tokenizer:
    return Tokenizer.from_pretrained(embedded_path)


@pytest.fixture(scope="module")
def hf_tok(embedded_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_path.parent), gguf_file=embedded_path.name)


@pytest.fixture(scope="module")
def corpus(english) -> list[str]:
    return CORPUS + [english]


def hf_chat(hf_tok, messages, add_generation_prompt=True) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_attributes(tok, hf_tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token_id == hf_tok.eos_token_id and tok.bos_token_id == hf_tok.bos_token_id
    assert tok.vocab_size == len(hf_tok) == 49152
    assert "<|im_start|>" in tok.chat_template


def test_default_source_is_embedded(tok):
    assert Tokenizer.from_pretrained().encode("Hello 42") == tok.encode("Hello 42")


def test_encode_matches_transformers(tok, hf_tok, corpus):
    for text in corpus:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True), text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.encode("") == []
    assert tok.encode("7") == tok.encode("7")[:1]  # no BOS: SmolLM2's GGUF says add_bos_token = False


# Token ids llama.cpp gives (llama-cpp-python, vocab_only, special=True) for the embedded GGUF, where
# transformers disagrees: its GGUF loader ignores tokenizer.ggml.pre = 'smollm', so it never splits digits
# off first; SmolLM2's tokenizer.json (Digits) and llama.cpp (\p{N}) do. See benchmarks/tokenizer_vs_llamacpp.py.
LLAMA_CPP = {
    "x ² ½": [104, 216, 19133, 216, 16738],
    "a  2": [81, 256, 34],
    "x \xa09": [104, 3351, 250, 41],
    "Room  101, ١٢٣ and 3.14": [42122, 256, 33, 32, 33, 28, 216, 164, 111, 164, 112, 164, 113, 284, 216, 35, 30,
                                 33, 36],
}


def test_digits_are_split(tok, hf_tok):
    digits = [tok.decode([i]) for i in tok.encode("1234567 3.14")]
    assert digits == ["1", "2", "3", "4", "5", "6", "7", " ", "3", ".", "1", "4"]
    for text, ids in LLAMA_CPP.items():
        assert tok.encode(text) == ids, text
        assert hf_tok.encode(text) != ids and hf_tok.decode(hf_tok.encode(text)) == text
def test_decode_round_trip(tok, hf_tok, corpus):
    for text in corpus:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def stream(tok, ids, skip=False) -> tuple[list[str], str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    return [decoder.step(i) for i in ids], decoder.finish()


def test_stream_holds_back_split_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) == 3  # four UTF-8 bytes over three byte-level tokens
    assert stream(tok, ids) == (["", "", "😀"], "")
    steps, rest = stream(tok, ids[:2])  # cut mid-character: nothing until the end, then U+FFFD as in decode()
    assert steps == ["", ""] and rest == tok.decode(ids[:2]) == "\ufffd"


def test_stream_equals_decode(tok, corpus):
    for text in corpus:
        ids = tok.encode(text)
        steps, rest = stream(tok, ids)
        assert all("\ufffd" not in s for s in steps) or "\ufffd" in text
        assert "".join(steps) == text and rest == ""
    rng = random.Random(0)  # arbitrary ids: lone bytes, broken sequences, special tokens
    for _ in range(500):
        ids = [rng.choice([rng.randrange(tok.vocab_size), rng.randrange(17), rng.randrange(17, 300)])
               for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            steps, rest = stream(tok, ids, skip)
            assert "".join(steps) + rest == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages):
    assert tok.apply_chat_template(messages) == hf_chat(hf_tok, messages)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == hf_chat(hf_tok, messages, False)
    text = tok.render_chat(messages)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def write_hf_dir(tok, path, template=True):
    path.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_end|>"}
    if template:
        config["chat_template"] = tok.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_hf_directory(tok, corpus, tmp_path):
    hf = Tokenizer.from_pretrained(write_hf_dir(tok, tmp_path / "tok"))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.vocab_size) == (1, 2, 2, 49152)
    for text in corpus:
        assert hf.encode(text) == tok.encode(text), text
    assert hf.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


def test_transformers_saved_directory(tok, hf_tok, corpus, tmp_path):
    hf_tok.save_pretrained(tmp_path)  # transformers 5: the template goes to chat_template.jinja
    assert (tmp_path / "chat_template.jinja").is_file()
    hf = Tokenizer.from_pretrained(tmp_path)
    for text in corpus:
        assert hf.encode(text) == tok.encode(text), text
    assert hf.apply_chat_template(CONVERSATIONS[0]) == tok.apply_chat_template(CONVERSATIONS[0])


def test_hub_id_from_local_cache(tok, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--SomeOrg--tiny-tok"
    write_hf_dir(tok, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # huggingface_hub reads these variables once, at import; its functions look at the constants.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = Tokenizer.from_pretrained("SomeOrg/tiny-tok")
    assert hub.encode("Hello 2024 <|im_end|>") == tok.encode("Hello 2024 <|im_end|>")
    with pytest.raises(SmolError, match="SomeOrg/missing"):
        Tokenizer.from_pretrained("SomeOrg/missing")


def tiny_gguf(path, model="gpt2", pre="smollm", add_bos=True, template=None, tokens=None, embedding_rows=None):
    """A tokenizer-only GGUF: the 256 byte tokens, one merge and two control tokens (or these tokens), and an
    embedding matrix of that many rows when asked."""
    tokens = tokens or ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["hi"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(template)
    if embedding_rows:
        writer.add_tensor("token_embd.weight", np.zeros((embedding_rows, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_add_bos_token(tmp_path):
    tiny = Tokenizer.from_pretrained(tiny_gguf(tmp_path / "t.gguf"))
    hi = tiny.backend.token_to_id("hi")
    assert tiny.encode("hi</s>") == [0, hi, 1]
    assert tiny.decode(tiny.encode("hi 1</s>"), skip_special_tokens=True) == "hi 1"
    assert tiny.pad_token_id is None and tiny.chat_template is None
    with pytest.raises(SmolError, match="no chat template"):
        tiny.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("field, value", [("model", "llama"), ("pre", "qwen2")])
def test_unsupported_gguf_tokenizer(tmp_path, field, value):
    path = tiny_gguf(tmp_path / "t.gguf", **{field: value})
    with pytest.raises(SmolError, match=f"t.gguf: unsupported .*'{value}'"):
        Tokenizer.from_pretrained(path)


def test_corrupt_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf(tmp_path / "t.gguf").read_bytes()[:1000])  # cut inside the token list
    for path in (garbage, truncated):
        with pytest.raises(SmolError, match=path.name):
            Tokenizer.from_pretrained(path)


def test_gguf_without_tokenizer(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SmolError, match="bare.gguf: no tokenizer"):
        Tokenizer.from_pretrained(path)


def test_bad_directories(tok, tmp_path):
    with pytest.raises(SmolError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(SmolError, match="tokenizer.json: not a valid tokenizer"):
        Tokenizer.from_pretrained(tmp_path)
    write_hf_dir(tok, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(SmolError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(SmolError, match="'<nope>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    for src in (tmp_path / "notes.txt", tmp_path / "absent"):
        with pytest.raises(SmolError, match=src.name):
            Tokenizer.from_pretrained(src)


def test_no_chat_template(tok, tmp_path):
    bare = Tokenizer.from_pretrained(write_hf_dir(tok, tmp_path, template=False))
    assert bare.chat_template is None
    with pytest.raises(SmolError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    ([("user", "hi")], r"messages\[0\] must be a dict"),
    ([{"role": "user"}], r"messages\[0\]: 'content' must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": 1, "content": "x"}], r"messages\[1\]: 'role' must be a string"),
    ([{"role": "user", "content": ["a", "b"]}], "'content' must be a string"),
])
def test_malformed_messages(tok, messages, match):
    with pytest.raises(SmolError, match=match):
        tok.apply_chat_template(messages)


def test_template_errors(tok, embedded_path):
    raising = Tokenizer(tok.backend, "x", chat_template="{{ raise_exception('only users may speak') }}")
    with pytest.raises(SmolError, match="x: chat template failed: only users may speak"):
        raising.render_chat([])
    broken = Tokenizer(tok.backend, "y", chat_template="{% for %}")
    with pytest.raises(SmolError, match="y: chat template failed"):
        broken.render_chat([])
    escape = Tokenizer(tok.backend, "z", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(SmolError, match="z: chat template failed"):  # the sandbox refuses
        escape.render_chat([])


def test_bad_ids_and_text(tok):
    with pytest.raises(SmolError, match="49152 is outside the vocabulary"):
        tok.decode([1, 49152])
    with pytest.raises(SmolError, match="-1 is outside"):
        tok.stream_decoder().step(-1)
    with pytest.raises(SmolError, match="takes a string"):
        tok.encode(b"bytes")


# Untrusted tokenizer files and chat templates: one error naming the file and key

def test_tokenizer_config_values_of_the_wrong_type(tok, tmp_path):
    write_hf_dir(tok, tmp_path)
    for key, value in [("bos_token", 1), ("pad_token", {"content": ["x"]}), ("chat_template", [1, 2]),
                       ("chat_template", 42)]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", key: value}))
        with pytest.raises(SmolError, match=f"tokenizer_config.json: {key} must be"):
            Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ '\xff\xfe' }}")
    with pytest.raises(SmolError, match="chat_template.jinja: cannot read the chat template"):
        Tokenizer.from_pretrained(tmp_path)


def test_gguf_tokens_of_the_wrong_type_or_count(tmp_path):
    with pytest.raises(SmolError, match="ints.gguf: tokenizer.ggml.tokens must be a list of strings"):
        Tokenizer.from_pretrained(tiny_gguf(tmp_path / "ints.gguf", tokens=list(range(300))))
    short = tiny_gguf(tmp_path / "short.gguf", embedding_rows=300)  # 259 tokens
    with pytest.raises(SmolError, match="short.gguf: tokenizer.ggml.tokens lists 259 tokens, but token_embd"):
        Tokenizer.from_pretrained(short)
    assert Tokenizer.from_pretrained(tiny_gguf(tmp_path / "fits.gguf", embedding_rows=259)).vocab_size == 259


@pytest.mark.parametrize("template, reason", [
    ("{{ range(10**9)|length }}", "1000000000"),
    ("{{ range(-999999, 999999)|length }}", "range of 1999998 numbers"),
    ("{{ 'x'|center(10**10) }}", "an argument of 10000000000"),
    ("{{ 'x'.ljust(10**10) }}", "an argument of 10000000000"),
    ("{{ '{:>9999999999}'.format(1) }}", "a format with a width"),
    ("{{ '%9999999999d' % 1 }}", "a format with a width"),
    ("{{ ('x' * 999999)|replace('x', 'xx') }}", "longer than"),
    ("{{ 'x' * 10**10 }}", "longer than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output longer than"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "took more than"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ("{{ 1 + 'a' }}", "unsupported operand"),
])
def test_template_cost_is_bounded(tok, monkeypatch, template, reason):
    # A short deadline keeps the loops' case quick; recursion, which Python stops by depth, gets more, else on a
    # loaded machine the deadline stops it first (it did, at a load of 5 on 2 cores).
    seconds = 1.5 if reason == "recursion" else 0.2
    monkeypatch.setattr(BoundedSandbox, "SECONDS", seconds)
    hostile = Tokenizer(tok.backend, "dir", chat_template=template, template_source="dir/chat_template.jinja")
    start = time.perf_counter()
    with pytest.raises(SmolError, match=f"dir/chat_template.jinja: chat template failed: .*{reason}"):
        hostile.render_chat([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < seconds + 1.8


def test_token_bytes_join_into_the_text():
    tok = Tokenizer.from_pretrained()
    text = "Hello wörld 😀 <|im_end|> 12\n\tx"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert [tok.token_text(i) for i in tok.encode("😀")][0].endswith("\ufffd")  # a piece of a character
    with pytest.raises(SmolError):
        tok.token_bytes(tok.vocab_size)
