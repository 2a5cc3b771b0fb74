"""Token shards (prepare, TokenData) and chat fine-tuning examples (ChatData), and their bad inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from smollm2.errors import SmolError
from smollm2.tokenizer import Tokenizer
from smollm2.training import data
from smollm2.training.data import ChatData, TokenData, prepare

DOCS = ["The quick brown fox jumps over the lazy dog.", "naïve café 🙂 1234567\n\nsecond paragraph\n",
        "def f(x):\n    return x ** 2\n", "Short one.", "  leading spaces and trailing ones  "]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained()


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def sources(tmp_path) -> list[Path]:
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "b.md").write_text(DOCS[1], encoding="utf-8")
    return [tmp_path / "a.txt", tmp_path / "b.md", write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in DOCS[2:]])]


def stream(directory: Path, split: str) -> np.ndarray:
    manifest = json.loads((directory / "manifest.json").read_text())
    return np.concatenate([np.fromfile(directory / s["file"], np.uint16)
                           for s in manifest["shards"] if s["split"] == split] or [np.zeros(0, np.uint16)])


def documents(ids: np.ndarray, eos: int) -> list[list[int]]:
    cuts = np.flatnonzero(ids == eos)
    return [ids[a + 1:b].tolist() for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def test_prepare_writes_every_document_once(tmp_path, sources, tokenizer):
    manifest = prepare(sources, tmp_path / "out", tokenizer, val_fraction=0.3, progress=False)
    assert (manifest["vocab_size"], manifest["eos_id"]) == (tokenizer.vocab_size, tokenizer.eos_token_id)
    assert [s["path"] for s in manifest["sources"]] == [str(p.resolve()) for p in sources]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    for shard in manifest["shards"]:
        assert (tmp_path / "out" / shard["file"]).stat().st_size == 2 * shard["tokens"]
    train, val = (stream(tmp_path / "out", split) for split in ("train", "val"))
    assert len(train) and len(val) and train[-1] == val[-1] == tokenizer.eos_token_id
    # encode_batch gives exactly what encode gives, and every document lands in one split, followed by EOS.
    found = documents(train, tokenizer.eos_token_id) + documents(val, tokenizer.eos_token_id)
    assert sorted(found) == sorted(tokenizer.encode(d) for d in DOCS)
    assert sorted(os.listdir(tmp_path / "out")) == sorted([s["file"] for s in manifest["shards"]] + ["manifest.json"])


def test_long_documents_are_cut_into_pieces_the_same_way_from_text_and_jsonl(tmp_path, tokenizer, english):
    text = english * 40  # about 3 pieces of 16 KiB
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    write_jsonl(tmp_path / "long.jsonl", [{"text": text}])
    for name in ("long.txt", "long.jsonl"):
        prepare([tmp_path / name], tmp_path / name.replace(".", "_"), tokenizer, val_fraction=0.5, progress=False)
    for split in ("train", "val"):
        assert np.array_equal(stream(tmp_path / "long_txt", split), stream(tmp_path / "long_jsonl", split))
    pieces = list(data._cut(text))
    assert "".join(p for p, _ in pieces) == text and len(pieces) > 2 and [e for _, e in pieces][-1]
    assert all(p.endswith("\n") and len(p) >= data.PIECE_CHARS for p, _ in pieces[:-1])
    total = sum(len(tokenizer.encode(p)) for p, _ in pieces) + 1
    assert len(stream(tmp_path / "long_txt", "train")) + len(stream(tmp_path / "long_txt", "val")) == total


@pytest.mark.parametrize("val_fraction", [0.0, 0.999999])
def test_neither_split_is_left_empty(tmp_path, sources, tokenizer, val_fraction):
    prepare(sources, tmp_path / "out", tokenizer, val_fraction=val_fraction, progress=False)
    assert len(stream(tmp_path / "out", "train")) and len(stream(tmp_path / "out", "val"))


def test_rerun_resumes_and_new_sources_append(tmp_path, sources, tokenizer):
    out = tmp_path / "out"
    first = prepare(sources[:2], out, tokenizer, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(sources[:2], out, tokenizer, progress=False) == first
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing rewritten
    more = prepare(sources, out, tokenizer, progress=False)
    assert more["shards"][:len(first["shards"])] == first["shards"] and len(more["sources"]) == 3
    assert all((out / name).stat().st_mtime_ns == t for name, t in stamps.items() if name != "manifest.json")


def test_an_interrupted_run_resumes_to_the_same_result(tmp_path, sources, tokenizer, monkeypatch):
    prepare(sources, tmp_path / "whole", tokenizer, val_fraction=0.3, progress=False)
    monkeypatch.setattr(data, "SHARD_TOKENS", 1)  # commit after every source
    real_pieces = data._pieces

    def interrupted(path, bar):
        if path.suffix == ".jsonl":
            yield next(real_pieces(path, bar))
            raise KeyboardInterrupt
        yield from real_pieces(path, bar)

    monkeypatch.setattr(data, "_pieces", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, out, tokenizer, val_fraction=0.3, progress=False)
    assert len(json.loads((out / "manifest.json").read_text())["sources"]) == 2
    # What a kill at a worse moment leaves: a shard being written, one renamed but not yet in the manifest.
    (out / "00002.train.bin.tmp").write_bytes(b"\0" * 6)
    (out / "00002.val.bin").write_bytes(b"\0" * 6)
    (out / "manifest.json.tmp").write_text("{")
    monkeypatch.setattr(data, "_pieces", real_pieces)
    manifest = prepare(sources, out, tokenizer, val_fraction=0.3, progress=False)
    assert sorted(os.listdir(out)) == sorted([s["file"] for s in manifest["shards"]] + ["manifest.json"])
    for split in ("train", "val"):
        assert np.array_equal(stream(out, split), stream(tmp_path / "whole", split))


def test_token_data_windows(tmp_path, tokenizer, english, monkeypatch):
    monkeypatch.setattr(data, "SHARD_TOKENS", 1)  # one shard per source, so windows cross shard ends
    paths = []
    for i in range(4):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(english[i * 300:(i + 1) * 300] + "\n" + english[-(i + 1) * 300:], encoding="utf-8")
    prepare(paths, tmp_path / "out", tokenizer, val_fraction=0.5, progress=False)
    train_ids = torch.from_numpy(stream(tmp_path / "out", "train").astype(np.int64))
    val_ids = stream(tmp_path / "out", "val")
    assert len(json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]) > 2

    train = TokenData(tmp_path / "out", "train", seq_len=16, seed=3)
    assert train.vocab_size == tokenizer.vocab_size and len(train) == len(train_ids) // 17
    inputs, labels = train.examples(range(40))
    assert inputs.shape == labels.shape == (40, 16) and inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    for row, last in zip(inputs, labels[:, -1]):  # every window is a piece of the train stream
        window = torch.cat([row, last[None]])
        assert any(torch.equal(train_ids[s:s + 17], window) for s in range(len(train_ids) - 16))
    # Example i depends on (seed, i) alone: not on the other indices of the call, nor on the instance.
    again = TokenData(tmp_path / "out", "train", seq_len=16, seed=3).examples([39, 7, 7])
    assert torch.equal(again[0], inputs[[39, 7, 7]]) and torch.equal(again[1], labels[[39, 7, 7]])
    assert not torch.equal(TokenData(tmp_path / "out", "train", seq_len=16, seed=4).examples(range(40))[0], inputs)

    val = TokenData(tmp_path / "out", "val", seq_len=16)
    inputs, labels = val.examples(range(len(val)))
    rebuilt = torch.cat([inputs, labels[:, -1:]], dim=1).flatten()
    assert torch.equal(rebuilt, torch.from_numpy(val_ids[:len(val) * 17].astype(np.int64)))
    with pytest.raises(IndexError):
        val.examples([len(val)])


def test_token_data_bad_inputs(tmp_path, sources, tokenizer):
    out = tmp_path / "out"
    prepare(sources, out, tokenizer, progress=False)
    with pytest.raises(SmolError, match="unknown split 'test'"):
        TokenData(out, "test", 8)
    with pytest.raises(SmolError, match=f"{tmp_path}: no manifest.json"):
        TokenData(tmp_path, "train", 8)
    (tmp_path / "manifest.json").write_text('{"shards": []}')
    with pytest.raises(SmolError, match="manifest.json: not a manifest written by prepare"):
        TokenData(tmp_path, "train", 8)
    with pytest.raises(SmolError, match=r"the val split has \d+ tokens, too few for one example of seq_len 4096"):
        TokenData(out, "val", 4096)
    with pytest.raises(SmolError, match="seq_len must be a positive integer"):
        TokenData(out, "train", 0)
    shard = next(s["file"] for s in json.loads((out / "manifest.json").read_text())["shards"] if s["split"] == "train")
    with open(out / shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(SmolError, match=f"{shard}: missing or not the"):
        TokenData(out, "train", 2)


@pytest.mark.parametrize("file", ["../elsewhere.bin", "/etc/hostname", "sub/00000.train.bin", "00000.train.bin.tmp", 7])
def test_a_manifest_names_only_shards_in_its_directory(tmp_path, sources, tokenizer, file):
    out = tmp_path / "out"
    manifest = prepare(sources, out, tokenizer, progress=False)
    manifest["shards"][0]["file"] = file
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SmolError, match=r"shards\[0\] is not a shard prepare writes"):
        TokenData(out, "train", 2)


def test_prepare_bad_inputs(tmp_path, sources, tokenizer):
    def fails(match, srcs, out=tmp_path / "out", tok=tokenizer):
        with pytest.raises(SmolError, match=match):
            prepare(srcs, out, tok, progress=False)

    fails(f"{tmp_path / 'nope.txt'}: no such file", [tmp_path / "nope.txt"])
    fails(f"{tmp_path}: is a directory", [tmp_path])
    fails("vocabulary of 100000 tokens does not fit", sources, tok=SimpleNamespace(vocab_size=100_000, source="big"))
    (tmp_path / "empty.txt").write_text("")
    fails("empty.txt, .*empty.jsonl: no text to tokenize",
          [tmp_path / "empty.txt", write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])], out=tmp_path / "none")
    (tmp_path / "latin1.txt").write_bytes(b"line one\nline two\ncaf\xe9\n")
    fails(r"latin1.txt, line 3: not UTF-8 \(byte 21 of the file\)", [tmp_path / "latin1.txt"])
    for record, match in [("{oops", "not valid JSON"), ("[1, 2]", "expected a JSON object, got list"),
                          ('{"txt": "a"}', 'expected an object with a string "text"'),
                          ('{"text": 3}', 'expected an object with a string "text"')]:
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n' + record + "\n")
        fails(f"bad.jsonl, line 3: {match}", [tmp_path / "bad.jsonl"])

    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
    prepare(sources[:1], tmp_path / "out", tokenizer, progress=False)
    fails("holds data prepared from other sources", sources[1:])
    sources[0].write_text("changed")
    fails("a.txt: changed since it was prepared", sources)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    fails(r"foreign: holds files that prepare did not write \(notes.txt\)", sources, out=tmp_path / "foreign")
    fails("a.txt: exists and is not a directory", sources[1:], out=sources[0])


CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4, of course 🙂\n\nAnything else?  "}],
    [{"role": "user", "content": "Say café"}, {"role": "assistant", "content": "café"}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d\n"}, {"role": "user", "content": "e"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}],
    [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}],
]


def learned_text(chats: ChatData, tokenizer: Tokenizer, i: int) -> str:
    return tokenizer.decode([label for label in chats.examples([i])[1][0].tolist() if label != -100])


def test_chat_data_learns_exactly_the_assistant_turns(tmp_path, tokenizer):
    chats = ChatData(write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS]), tokenizer, seq_len=128)
    assert len(chats) == len(CHATS)
    rendered = [tokenizer.apply_chat_template(m, add_generation_prompt=False) for m in CHATS]
    inputs, labels = chats.examples(range(len(CHATS)))
    assert inputs.shape == labels.shape == (len(CHATS), max(map(len, rendered)) - 1)
    for row, row_labels in zip(inputs.tolist(), labels.tolist()):
        k = next(k for k, ids in enumerate(rendered) if row[:len(ids) - 1] == ids[:-1])
        ids, n = rendered[k], len(rendered[k]) - 1
        assert row[n:] == [tokenizer.eos_token_id] * (len(row) - n) and row_labels[n:] == [-100] * (len(row) - n)
        assert all(label in (-100, ids[j + 1]) for j, label in enumerate(row_labels[:n]))
        expected = "".join(m["content"] + "<|im_end|>" for m in CHATS[k] if m["role"] == "assistant")
        assert tokenizer.decode([label for label in row_labels if label != -100]) == expected


def test_chat_data_does_not_learn_a_token_that_is_partly_template(tmp_path, tokenizer):
    # "assistant\n" + "  Four" tokenizes as "\n " + " Four": the first of those is half scaffolding.
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "  Four"}]
    chats = ChatData(write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat}]), tokenizer, seq_len=128)
    assert learned_text(chats, tokenizer, 0) == " Four<|im_end|>"


def test_chat_data_reshuffles_every_epoch_deterministically(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    chats, twin = ChatData(path, tokenizer, seq_len=128, seed=1), ChatData(path, tokenizer, seq_len=128, seed=1)
    order = [chats.order[i] for i in range(3 * len(CHATS))]
    epochs = [order[e * len(CHATS):(e + 1) * len(CHATS)] for e in range(3)]
    assert all(sorted(epoch) == list(range(len(CHATS))) for epoch in epochs) and epochs[0] != epochs[1]
    assert [twin.order[i] for i in reversed(range(3 * len(CHATS)))] == order[::-1]
    assert torch.equal(chats.examples([7, 2])[1], twin.examples([7, 2])[1])
    assert order != [ChatData(path, tokenizer, seq_len=128, seed=2).order[i] for i in range(3 * len(CHATS))]


def test_chat_data_bad_inputs(tmp_path, tokenizer):
    good = json.dumps({"messages": CHATS[1]})
    for record, match in [("[]", "expected a JSON object"), ('{"text": "hi"}', "messages must be a list"),
                          ('{"messages": [{"role": "user"}]}', r"messages\[0\]: 'content' must be a string"),
                          ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
                          (json.dumps({"messages": CHATS[0]}), "this chat is \\d+ tokens, longer than seq_len 40")]:
        (tmp_path / "chats.jsonl").write_text(f"{good}\n{good}\n{record}\n")
        with pytest.raises(SmolError, match=f"chats.jsonl, line 3: {match}"):
            ChatData(tmp_path / "chats.jsonl", tokenizer, seq_len=40)
    (tmp_path / "bytes.jsonl").write_bytes(good.encode() + b"\n\xff\n")
    with pytest.raises(SmolError, match="bytes.jsonl, line 2: not UTF-8"):
        ChatData(tmp_path / "bytes.jsonl", tokenizer, seq_len=40)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(SmolError, match="blank.jsonl: no chats"):
        ChatData(tmp_path / "blank.jsonl", tokenizer, seq_len=40)
    with pytest.raises(SmolError, match="missing.jsonl: no such file"):
        ChatData(tmp_path / "missing.jsonl", tokenizer, seq_len=40)
