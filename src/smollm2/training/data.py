"""Training data: pretraining text as memory-mapped token shards, chats for supervised fine-tuning, and pairs of
preferred and rejected answers for DPO.

`prepare` tokenizes text files into uint16 shards plus a manifest, committing whole sources at a time, so an
interrupted run resumes where it stopped. `TokenData`, `ChatData` and `PreferenceData` build each example from its
index alone, with generators seeded by (seed, index): any step of any run, on any rank, can be rebuilt from its
indices, which is what keeps resuming and torchrun exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import SmolError
from ..tokenizer import Tokenizer
from .loss import IGNORE

SPLITS = ("train", "val")
PIECE_CHARS = 16 * 1024  # the unit of the train/val split: a piece ends at the first line end past this size
BATCH_CHARS = 4 << 20  # text per encode_batch call: large enough to keep every core of the tokenizer busy
SHARD_TOKENS = 1 << 27  # a shard is committed once it holds this many tokens (or the run ends)
SHARD_NAME = re.compile(r"\d{5}\.(train|val)\.bin(\.tmp)?")


def prepare(sources: Sequence[str | Path], out: str | Path, tokenizer: Tokenizer, *, val_fraction: float = 0.01,
            progress: bool = True) -> dict:
    """Tokenize plain-text files (one document each) and JSONL files (one {"text": ...} document a line) into
    uint16 token shards in `out`, plus `out/manifest.json`; returns the manifest. Each document ends with EOS.
    Running it again with the same sources (and maybe more) skips the ones already done."""
    if not 0 <= val_fraction < 1:
        raise SmolError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer.vocab_size > 1 << 16:
        raise SmolError(f"{tokenizer.source}: a vocabulary of {tokenizer.vocab_size} tokens does not fit in "
                        "uint16 shards (at most 65536)")
    if tokenizer.eos_token_id is None:
        raise SmolError(f"{tokenizer.source}: the tokenizer has no eos token to end documents with")
    paths = list(dict.fromkeys(_check_file(s) for s in sources))
    if not paths:
        raise SmolError("prepare: no sources given")
    out = Path(out)
    manifest = _open_output(out, tokenizer)
    todo = _pending(paths, manifest, out)
    with tqdm(total=sum(p.stat().st_size for p in todo), unit="B", unit_scale=True, desc="prepare",
              disable=not progress) as bar:
        writer = None
        try:
            for n, path in enumerate(todo):
                writer = writer or _ShardWriter(out, manifest)
                _tokenize_source(path, writer, tokenizer, val_fraction, bar)
                if n == len(todo) - 1 or sum(writer.counts.values()) >= SHARD_TOKENS:
                    writer.commit()
                    writer = None
        except BaseException:
            if writer:  # a next run would remove them too; an error in the input should not wait for that
                writer.abandon()
            raise
    if not any(shard["tokens"] for shard in manifest["shards"]):
        raise SmolError(f"{', '.join(map(str, paths))}: no text to tokenize")
    return manifest


class _ShardWriter:
    """A train and a val shard filled from one or more sources. They count only once commit() has renamed them
    into place and then replaced the manifest that lists them; an interruption loses the uncommitted sources."""

    def __init__(self, out: Path, manifest: dict):
        self.out, self.manifest, self.sources = out, manifest, []
        self.stem = f"{len(manifest['sources']):05d}"  # the index of its first source: unique, in order
        self.files = {split: open(out / f"{self.stem}.{split}.bin.tmp", "wb")  # noqa: SIM115 (commit/abandon close)
                      for split in SPLITS}
        self.counts = dict.fromkeys(SPLITS, 0)

    def write(self, split: str, ids: np.ndarray) -> None:
        self.files[split].write(ids.tobytes())
        self.counts[split] += len(ids)

    def total(self, split: str) -> int:
        return self.counts[split] + sum(s["tokens"] for s in self.manifest["shards"] if s["split"] == split)

    def abandon(self) -> None:
        for file in self.files.values():
            file.close()
            os.unlink(file.name)

    def commit(self) -> None:
        for split, file in self.files.items():
            file.flush()
            os.fsync(file.fileno())
            file.close()
            name = f"{self.stem}.{split}.bin"
            if self.counts[split]:
                os.replace(file.name, self.out / name)
                self.manifest["shards"].append({"file": name, "tokens": self.counts[split], "split": split})
            else:
                os.unlink(file.name)
        self.manifest["sources"] += self.sources
        tmp = self.out / "manifest.json.tmp"
        with open(tmp, "w") as f:
            json.dump(self.manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / "manifest.json")


def _tokenize_source(path: Path, writer: _ShardWriter, tokenizer: Tokenizer, val_fraction: float, bar) -> None:
    stat = path.stat()  # before reading: a change made while we read shows up on the next run
    held = None  # the source's last piece waits: if a split is still empty when the source ends, it goes there
    for batch in _batches(_pieces(path, bar)):
        encodings = tokenizer.backend.encode_batch_fast([text for text, _ in batch])
        for (text, ends_document), encoding in zip(batch, encodings):
            if held:
                writer.write(_split_of(held[0], val_fraction), held[1])
            held = text, np.array(encoding.ids + [tokenizer.eos_token_id] * ends_document, np.uint16)
    if held:
        train, val = writer.total("train"), writer.total("val")
        split = "val" if val == 0 < train else "train" if train == 0 else _split_of(held[0], val_fraction)
        writer.write(split, held[1])
    writer.sources.append({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})


def _split_of(piece: str, val_fraction: float) -> str:
    # A stable hash of the text, so the same text lands in the same split on every run and every machine.
    digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "big") < val_fraction * 2**64 else "train"


def _pieces(path: Path, bar) -> Iterator[tuple[str, bool]]:
    """(piece of text, whether it ends its document). Read a line at a time, so no file sits whole in memory."""
    jsonl, piece, offset = path.suffix == ".jsonl", "", 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, number, offset)
            offset += len(raw)
            bar.update(len(raw))
            if jsonl and line.strip():
                text = _json_object(line, path, number).get("text")
                if not isinstance(text, str):
                    raise SmolError(f'{path}, line {number}: expected an object with a string "text"')
                yield from _cut(text)
            elif not jsonl:  # the whole file is one document, cut the same way _cut cuts a string
                if len(piece) >= PIECE_CHARS:
                    yield piece, False
                    piece = ""
                piece += line
    if piece:
        yield piece, True


def _cut(text: str) -> Iterator[tuple[str, bool]]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + PIECE_CHARS - 1) + 1 or len(text)
        yield text[start:end], end == len(text)
        start = end


def _batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _open_output(out: Path, tokenizer: Tokenizer) -> dict:
    """The manifest of the previous run in `out`, or a new one; removes what an interrupted run left behind."""
    if out.exists() and not out.is_dir():
        raise SmolError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    names = {p.name for p in out.iterdir()}
    if "manifest.json" in names:
        manifest = _read_manifest(out)
        if (manifest["vocab_size"], manifest["eos_id"]) != (tokenizer.vocab_size, tokenizer.eos_token_id):
            raise SmolError(f"{out}: prepared with another tokenizer (vocab_size {manifest['vocab_size']}, eos id "
                            f"{manifest['eos_id']}); use a new output directory")
    else:
        manifest = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_token_id, "sources": [], "shards": []}
    leftovers = names - {s["file"] for s in manifest["shards"]} - {"manifest.json"}
    strangers = sorted(n for n in leftovers if not SHARD_NAME.fullmatch(n) and n != "manifest.json.tmp")
    if strangers:
        raise SmolError(f"{out}: holds files that prepare did not write ({', '.join(strangers[:3])}"
                        f"{', ...' if len(strangers) > 3 else ''}); use an empty or new output directory")
    for name in leftovers:
        (out / name).unlink()
    return manifest


def _pending(paths: list[Path], manifest: dict, out: Path) -> list[Path]:
    """The sources still to do; refuses a directory prepared from other sources or from since-changed files."""
    done, wanted = {s["path"]: s for s in manifest["sources"]}, {str(p) for p in paths}
    others = [p for p in done if p not in wanted]
    if others:
        raise SmolError(f"{out}: holds data prepared from other sources ({others[0]}"
                        f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}); pass them too, "
                        "or use a new output directory")
    for path in paths:
        stat, record = path.stat(), done.get(str(path))
        if record and (record["size"], record["mtime_ns"]) != (stat.st_size, stat.st_mtime_ns):
            raise SmolError(f"{path}: changed since it was prepared into {out}; use a new output directory")
    return [p for p in paths if str(p) not in done]


def split_tokens(directory: str | Path, split: str) -> int:
    """How many tokens a prepared directory holds in `split`."""
    return sum(s["tokens"] for s in _read_manifest(Path(directory))["shards"] if s["split"] == split)


class TokenData:
    """Pretraining windows of seq_len + 1 tokens from a prepared directory, across document and shard ends."""

    def __init__(self, directory: str | Path, split: str, seq_len: int, seed: int = 0):
        if split not in SPLITS:
            raise SmolError(f"unknown split {split!r}; expected 'train' or 'val'")
        _check_sizes(seq_len, seed)
        directory = Path(directory)
        manifest = _read_manifest(directory)
        self.vocab_size, self.split, self.seq_len, self.seed = manifest["vocab_size"], split, seq_len, seed
        self.shards = []
        for shard in (s for s in manifest["shards"] if s["split"] == split):
            path = directory / shard["file"]
            if not path.is_file() or path.stat().st_size != 2 * shard["tokens"]:
                raise SmolError(f"{path}: missing or not the {shard['tokens']} tokens manifest.json says it holds")
            self.shards.append(np.memmap(path, dtype=np.uint16, mode="r"))
        self.begins = np.cumsum([0] + [len(s) for s in self.shards])  # where each shard starts in the split
        self.tokens = int(self.begins[-1])
        if self.tokens < seq_len + 1:
            raise SmolError(f"{directory}: the {split} split has {self.tokens} tokens, too few for one example of "
                            f"seq_len {seq_len} (needs {seq_len + 1}); lower the sequence length or add data")

    def __len__(self) -> int:
        return self.tokens // (self.seq_len + 1)

    def examples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(indices), seq_len) input ids and labels, the inputs shifted by one. Train example i is a window
        at a position drawn by a generator seeded with (seed, i); val example i is the i-th window in order."""
        rows = torch.from_numpy(np.stack([self._window(self._start(i)) for i in indices]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _start(self, i: int) -> int:
        if self.split == "val":
            if not 0 <= i < len(self):
                raise IndexError(f"val example {i} is out of range (the split has {len(self)})")
            return i * (self.seq_len + 1)
        return int(np.random.default_rng([self.seed, i]).integers(self.tokens - self.seq_len))

    def _window(self, start: int) -> np.ndarray:
        parts, needed = [], self.seq_len + 1
        while needed:  # a window may run on into the next shard
            k = int(np.searchsorted(self.begins, start, side="right")) - 1
            part = self.shards[k][start - self.begins[k]:][:needed]
            parts.append(part)
            start, needed = start + len(part), needed - len(part)
        return np.concatenate(parts)


class ChatData:
    """Supervised fine-tuning on a JSONL file of {"messages": [{"role", "content"}, ...]} chats: the model learns
    the assistant turns (their content and the end-of-turn token that closes them) and nothing else."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int = 0):
        _check_sizes(seq_len, seed)
        path = _check_file(path)
        if tokenizer.chat_template is None or tokenizer.eos_token is None:
            raise SmolError(f"{tokenizer.source}: fine-tuning on chats needs a chat template and an eos token")
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.chats = []  # (input ids, labels) of each chat
        for number, record in _json_lines(path):
            try:
                ids, learn = _tokenize_chat(record.get("messages"), tokenizer)
            except SmolError as e:
                raise SmolError(f"{path}, line {number}: {e}") from None
            if len(ids) - 1 > seq_len:  # truncating would silently drop the end of the answer
                raise SmolError(f"{path}, line {number}: this chat is {len(ids)} tokens, longer than seq_len "
                                f"{seq_len} + 1; raise the sequence length or shorten the chat")
            self.chats.append((ids[:-1], np.where(learn[1:], ids[1:], IGNORE)))
        if not self.chats:
            raise SmolError(f"{path}: no chats in this file")
        self.order = EpochOrder(len(self.chats), seed)

    def __len__(self) -> int:
        return len(self.chats)

    def examples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Example i is chat order[i] (see EpochOrder). Rows are right-padded to the longest in the call (labels
        -100 there)."""
        return _padded([self.chats[self.order[i]] for i in indices], self.pad_id)


class PreferenceData:
    """DPO on a JSONL file of preference pairs, each line either {"prompt": str, "chosen": str, "rejected": str} (a
    user message and two assistant answers to it) or {"chosen": [messages], "rejected": [messages]} (two chats that
    differ only in their last message, the assistant's answer). Both sides are rendered with the chat template;
    only the tokens of that last answer are scored (its content and the end-of-turn token, as ChatData learns).

    A pair whose longer side does not fit in seq_len + 1 tokens is dropped, and the count printed: cutting the
    prompt would score the answer against a context the model never sees, and cutting the answer would compare
    the two on different texts.

    `reference` holds each pair's (chosen, rejected) log-probabilities under the starting model, computed once
    (dpo.reference_logps) before training begins."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int = 0):
        _check_sizes(seq_len, seed)
        path = _check_file(path)
        if tokenizer.chat_template is None or tokenizer.eos_token is None:
            raise SmolError(f"{tokenizer.source}: preference pairs need a chat template and an eos token")
        self.seq_len, self.reference = seq_len, None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pairs = []  # ((inputs, labels) of the chosen side, the same of the rejected side)
        lines = 0
        for number, record in _json_lines(path):
            lines += 1
            try:
                sides = [_tokenize_chat(chat, tokenizer, last_turn_only=True) for chat in _preference_chats(record)]
            except SmolError as e:
                raise SmolError(f"{path}, line {number}: {e}") from None
            if max(len(ids) for ids, _ in sides) - 1 <= seq_len:
                self.pairs.append(tuple((ids[:-1], np.where(learn[1:], ids[1:], IGNORE)) for ids, learn in sides))
        if not lines:
            raise SmolError(f"{path}: no preference pairs in this file")
        if not self.pairs:
            raise SmolError(f"{path}: all {lines} pairs are longer than seq_len {seq_len} + 1 tokens; raise the "
                            "sequence length")
        if len(self.pairs) < lines:
            print(f"{path}: dropped {lines - len(self.pairs)} of {lines} pairs longer than seq_len {seq_len} + 1 "
                  "tokens", file=sys.stderr)
        self.order = EpochOrder(len(self.pairs), seed)

    def __len__(self) -> int:
        return len(self.pairs)

    def sides(self, pairs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(pairs), 2, T) input ids and labels of these pairs, in this order: [:, 0] chosen, [:, 1] rejected,
        right-padded to the longest side (labels -100 there)."""
        inputs, labels = _padded([side for k in pairs for side in self.pairs[k]], self.pad_id)
        return inputs.view(len(pairs), 2, -1), labels.view(len(pairs), 2, -1)

    def examples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Example i is pair order[i] (see EpochOrder): its sides (as sides()) and its (2,) reference
        log-probabilities."""
        if self.reference is None:
            raise SmolError("the reference log-probabilities are not computed yet (dpo.reference_logps)")
        pairs = [self.order[i] for i in indices]
        return *self.sides(pairs), self.reference[pairs]


class EpochOrder:
    """Example i is item perm_e[i % N], where perm_e is a permutation seeded with (seed, e = i // N), so every epoch
    is shuffled anew."""

    def __init__(self, items: int, seed: int):
        self.items, self.seed, self.epoch, self.permutation = items, seed, None, None

    def __getitem__(self, i: int) -> int:
        epoch, k = divmod(i, self.items)
        if self.epoch != epoch:  # consecutive calls almost always stay in one epoch
            self.epoch, self.permutation = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.items)
        return int(self.permutation[k])


def _padded(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) rows as two (len(rows), longest) tensors, right-padded (labels -100 there)."""
    width = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for row, (ids, targets) in enumerate(rows):
        inputs[row, :len(ids)], labels[row, :len(ids)] = torch.from_numpy(ids), torch.from_numpy(targets)
    return inputs, labels


def _preference_chats(record: dict) -> tuple[list[dict], list[dict]]:
    """The chosen and the rejected chat of a preference pair, checked."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if chosen is None or rejected is None:
        raise SmolError('expected "chosen" and "rejected" (and a "prompt", or chats as both)')
    if "prompt" in record:
        prompt = record["prompt"]
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise SmolError(f'"{name}" must be a string beside a "prompt", got {type(value).__name__}')
        chosen, rejected = ([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
                            for answer in (chosen, rejected))
    for name, chat in (("chosen", chosen), ("rejected", rejected)):
        if not (isinstance(chat, list) and chat and isinstance(chat[-1], dict)):
            raise SmolError(f'"{name}" must be a non-empty list of messages (or a string beside a "prompt")')
        last = chat[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            raise SmolError(f'"{name}" must end with an assistant message with a string "content"')
        if not last["content"].strip():
            raise SmolError(f'"{name}": the answer is empty')
    if chosen[:-1] != rejected[:-1]:
        at = next((k for k, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)) - 1)
        raise SmolError(f'"chosen" and "rejected" must share every message but the last; they differ at message {at}')
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise SmolError('"chosen" and "rejected" give the same answer')
    return chosen, rejected


def _tokenize_chat(messages: list[dict], tokenizer: Tokenizer,
                   last_turn_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The chat's token ids, and which of them belong to an assistant turn (the last message alone, if
    last_turn_only: in a preference pair the earlier turns are the prompt)."""
    text = tokenizer.render_chat(messages, add_generation_prompt=False)  # also checks the messages
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    starts, ends = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2).T
    learn = np.zeros(len(encoding.ids), dtype=bool)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    for k in turns[-1:] if last_turn_only else turns:
        # The turn's text is what rendering the chat up to it adds after the generation prompt.
        prompt, content = tokenizer.render_chat(messages[:k], add_generation_prompt=True), messages[k].get("content")
        if not isinstance(content, str):  # an assistant's tool calls alone: render_chat takes them, with no text
            raise SmolError(f"messages[{k}]: an assistant turn to learn needs its content as text")
        end = len(prompt) + len(content)
        if not (text.startswith(prompt) and text.startswith(content, len(prompt))
                and text.startswith(tokenizer.eos_token, end)):
            raise SmolError(f"messages[{k}]: the chat template does not write this assistant turn as the generation "
                            f"prompt, the content and {tokenizer.eos_token!r}, so it cannot be told apart to learn")
        # Only tokens wholly inside the turn: one that straddles its start (the template's newline merged with
        # content that begins with whitespace) is partly scaffolding, which the prompt holds at inference time.
        learn |= (starts >= len(prompt)) & (ends <= end + len(tokenizer.eos_token))
    if not learn.any():
        raise SmolError("no assistant message to learn from")
    return np.array(encoding.ids, dtype=np.int64), learn


def _check_file(source: str | Path) -> Path:
    path = Path(source)
    if path.is_dir():
        raise SmolError(f"{path}: is a directory; pass the files in it")
    if not path.is_file():
        raise SmolError(f"{path}: no such file")
    return path.resolve()


def _check_sizes(seq_len: int, seed: int) -> None:
    if not (isinstance(seq_len, int) and seq_len >= 1):
        raise SmolError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not (isinstance(seed, int) and seed >= 0):
        raise SmolError(f"seed must be a non-negative integer, got {seed!r}")


def _decode(raw: bytes, path: Path, number: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SmolError(f"{path}, line {number}: not UTF-8 (byte {offset + e.start} of the file)") from None


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """Each non-blank line of a JSONL file as (its number, its object), read a line at a time; a line that is not
    UTF-8 or not a JSON object is an error naming it."""
    with open(path, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            line, offset = _decode(raw, path, number, offset), offset + len(raw)
            if line.strip():
                yield number, _json_object(line, path, number)


def _json_object(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise SmolError(f"{path}, line {number}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise SmolError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
    return record


def _read_manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    if not path.is_file():
        raise SmolError(f"{directory}: no manifest.json here; make one with prepare")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SmolError(f"{path}: not valid JSON ({e})") from None
    if not (isinstance(manifest, dict) and {"vocab_size", "eos_id", "sources", "shards"} <= manifest.keys()
            and isinstance(manifest["shards"], list) and isinstance(manifest["sources"], list)):
        raise SmolError(f"{path}: not a manifest written by prepare")
    for i, shard in enumerate(manifest["shards"]):
        # A shard is a file prepare named in this directory: a path elsewhere (../, absolute) is never opened.
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                and SHARD_NAME.fullmatch(shard["file"]) and not shard["file"].endswith(".tmp")
                and shard.get("split") in ("train", "val") and type(shard.get("tokens")) is int
                and 0 <= shard["tokens"] < 2**40):
            raise SmolError(f"{path}: shards[{i}] is not a shard prepare writes (a file NNNNN.train.bin or "
                            "NNNNN.val.bin in this directory, its split and token count)")
    return manifest
