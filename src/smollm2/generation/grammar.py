"""Structured output: OpenAI's `response_format` as a grammar that masks each step's logits; beside its
json_object and json_schema, guided choice and regex as vLLM offers them, as two more types:
{"type": "choice", "choices": ["yes", "no"]} (the answer is one of the strings) and
{"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"} (the answer matches the pattern, whole).

    grammar = Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": {...}}}, tokenizer)
    matcher = grammar.matcher()            # one per sequence: it holds where in the JSON the sequence is
    row = matcher.allowed(logits[i])       # -inf on every token the grammar forbids next (in place)
    token = sample(row)
    matcher.accept(token)                  # SmolError if the grammar forbids it
    if matcher.finished: ...               # EOS was accepted: the answer is complete

Once the JSON value is complete the grammar allows EOS alone, so a sequence under a grammar ends with EOS
(or runs out of tokens first, and its JSON is cut short, as any answer cut by max_tokens is). A JSON answer is
compact (", " and ": ", no other whitespace) and its numbers are bounded as llama.cpp's schema converter bounds
them: at most 16 digits before the point, after it, and in the exponent. Free whitespace or digits would let a
small model go on writing them, valid all along, until max_tokens (the embedded model did, in an "age").
llguidance's JSON compiler writes a number's digits without bound, and has no option for one, so the matcher
bounds them itself: it reads the JSON as it is written (JsonText), and outside strings it forbids each token
whose leading digits would make the number's run of digits longer than the bound.

The grammar engine is llguidance: it has no dependencies, so `pip install smollm2` alone answers
response_format and tools (xgrammar, faster on its own, ~4 us a token against llguidance's ~25 when they were
measured side by side, pulls transformers, pydantic and triton along, ~1 GB). benchmarks/constrained.py, on 2 CPU
cores shared with other work (load ~9), replaying valid answers to five JSON grammars: llguidance's mask, the bound
on digits and the advance took 0.20 ms a token on average (p99 0.37 ms; 14-21 us for two of the grammars), and
allowed() with the mask applied to the 49152-wide row 0.43 ms (p99 12 ms), while stream() took 75 ms a token in the
same run: ~0.6% of a step. A JSON schema compiles in 1-5 ms (llguidance builds its automata as tokens come, and the
first mask is part of the compile), its tokenizer tables in ~0.6 s, once per tokenizer.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import FieldError, SmolError
from ..json_schema import MAX_SCHEMA_CHARS, check_schema
from ..tools import CALL_BEGIN, CALL_END, Tools

if TYPE_CHECKING:  # imported at a grammar's first use (_llguidance): a model's run that uses none does not pay for it
    import llguidance

MAX_PATTERN_CHARS = 256  # a regex is a request's input too: llguidance builds its automaton as tokens come, each
# step's share bounded by its fuel (a pattern that needs more at its start is refused at once); a longer pattern
# only has more ways to spend it
MAX_CHOICES = 1024
DIGITS = 16  # the most digits a JSON number has in a row: before its point, after it, in its exponent (as llama.cpp)
CACHE_SIZE = 64  # compiled grammars kept, least recently used dropped first
# Compact JSON (", " and ": ", no free whitespace): a small model left free to write whitespace can write nothing
# else until max_tokens, and runs of it are wasted tokens anyway. oneOf as anyOf: pydantic writes a union as oneOf.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}
# Keywords whose values are schemas: one, a list of them, or a map of names to them (the rest is data).
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
                 "then", "else", "unevaluatedItems", "unevaluatedProperties")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")

_lock = threading.Lock()  # the server's handlers may compile concurrently; the caches are shared
_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> Vocab
_compiled: OrderedDict = OrderedDict()  # (the vocab's serial, key) -> llguidance.LLMatcher, at the grammar's start
_serials = itertools.count()  # not id(): a dropped tokenizer's vocab may leave its id to another's


@dataclass(frozen=True)
class Numbers:
    """Where a grammar's answer writes JSON, whose numbers hold at most `digits` digits in a row: after the bytes
    `begin` (b"": from the first byte)."""
    digits: int
    begin: bytes = b""


class Grammar:
    """A compiled grammar for one tokenizer: immutable, shared by every sequence that asks for it."""

    def __init__(self, compiled, vocab: Vocab, eos_token_id: int, key: str, numbers: Numbers | None):
        self._compiled, self.vocab, self.eos_token_id, self.key = compiled, vocab, eos_token_id, key
        self.vocab_size, self.numbers = vocab.size, numbers

    @classmethod
    def from_response_format(cls, response_format, tokenizer) -> Grammar | None:
        """{"type": "text"} -> None (no constraint); {"type": "json_object"} -> any JSON object;
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} -> JSON valid under that schema;
        {"type": "choice", "choices": [...]} -> one of the strings; {"type": "regex", "pattern": ...} -> text that
        matches the pattern."""
        if not isinstance(response_format, dict):
            raise SmolError(f"response_format must be an object, not {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls._get(tokenizer, "json_object", "response_format json_object",
                            lambda: _json_grammar({"type": "object"}), Numbers(DIGITS))
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise SmolError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
            schema = spec["schema"]
            check_schema(schema)
            return cls._get(tokenizer, json.dumps(schema, sort_keys=True), "response_format json_schema",
                            lambda: _json_grammar(_closed(schema)), Numbers(_digits(schema)))
        if kind == "choice":
            choices = response_format.get("choices")
            _check_choices(choices)
            return cls._get(tokenizer, "choice " + json.dumps(choices), "response_format choice",
                            lambda: _lark("start: " + " | ".join(json.dumps(c) for c in choices)))
        if kind == "regex":
            pattern = response_format.get("pattern")
            if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
                raise SmolError(f'response_format regex needs "pattern": a regular expression of 1 to '
                                f"{MAX_PATTERN_CHARS} characters")
            return cls._get(tokenizer, "regex " + pattern, "response_format regex",
                            lambda: _lark(f"start: /{_llguidance().regex_to_lark(pattern)}/"))
        raise SmolError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema', "
                        f"'choice', 'regex'")

    @classmethod
    def for_answer(cls, tokenizer, response_format=None, tools: Tools | None = None) -> Grammar | None:
        """What an answer must fit: the calls of the tools it may call, or response_format's JSON; not both (a
        FieldError naming response_format)."""
        if tools is not None and tools.offered:
            if response_format is not None and response_format != {"type": "text"}:  # "text": no constraint
                raise FieldError("response_format", "cannot constrain an answer that may call tools "
                                 "(tool_choice 'none' lets it)")
            return cls.from_tagged_json(tools.call_schema(), tokenizer, CALL_BEGIN, CALL_END,
                                        anywhere=tools.choice == "auto")
        return None if response_format is None else cls.from_response_format(response_format, tokenizer)

    @classmethod
    def from_tagged_json(cls, schema: dict, tokenizer, begin: str, end: str, anywhere: bool) -> Grammar:
        """JSON valid under `schema` between the strings `begin` and `end`, then EOS: tool calls, as
        <tool_call>[...]</tool_call>. anywhere: free text may come first, and the tagged JSON only where the text
        writes `begin` (or the text ends without it); else the answer is the tagged JSON from its first token.
        The schema is the caller's to check first (check_schema), with the name of the field it came in."""
        key = json.dumps({"begin": begin, "end": end, "anywhere": anywhere, "schema": schema}, sort_keys=True)
        return cls._get(tokenizer, key, f"{begin}...{end} JSON schema",
                        lambda: _tagged_grammar(_closed(schema), begin, end, anywhere),
                        Numbers(_digits(schema), begin.encode()))

    @classmethod
    def _get(cls, tokenizer, key: str, what: str, source, numbers: Numbers | None = None) -> Grammar:
        """The grammar cached under key for this tokenizer, or source()'s (llguidance's grammar text), compiled and
        cached. what: the grammar's name in its errors."""
        if tokenizer.eos_token_id is None:
            raise SmolError(f"{tokenizer.source}: the tokenizer has no EOS token to end a structured answer")
        with _lock:
            vocab = _vocab(tokenizer)
            cache_key = (vocab.serial, key)
            compiled = _compiled.get(cache_key)
            if compiled is not None:
                _compiled.move_to_end(cache_key)
            else:
                compiled = _compile(vocab, source(), what)
                _compiled[cache_key] = compiled
                while len(_compiled) > CACHE_SIZE:
                    _compiled.popitem(last=False)
        return cls(compiled, vocab, tokenizer.eos_token_id, key, numbers)

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """Where one sequence stands in a grammar: which tokens may come next, advanced a token at a time."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._m = grammar._compiled.deep_copy()  # ~10 us: the compiled grammar and lexer states are shared
        self._bitmask = np.zeros((grammar.vocab_size + 31) // 32, dtype=np.int32)  # bit j of word w: token 32w+j
        self._json = JsonText(grammar.numbers.begin) if grammar.numbers else None
        self.finished = False  # EOS was accepted: the grammar takes no more tokens and the sequence ends here
        # llguidance gave up on the grammar (a step past its fuel): EOS alone may follow, and the answer is cut short
        self.cut_short = False

    def mask(self, width: int | None = None) -> torch.Tensor:
        """(width,) bool, True where a token may come next. width: the logits' size (default the tokenizer's):
        ids past the tokenizer's vocabulary (padding rows of the model's embedding) are never allowed, and a
        narrower width drops the ids the model cannot produce anyway."""
        V = self.grammar.vocab_size
        width = V if width is None else width
        allowed = torch.from_numpy(self._allowed(min(V, width)))
        if width > allowed.shape[0]:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        return allowed

    def allowed(self, logits_row: torch.Tensor) -> torch.Tensor:
        """Set the forbidden tokens of a (V,) float logits row to -inf, in place; returns the row."""
        if logits_row.dim() != 1:
            raise SmolError(f"allowed() takes one (V,) logits row, not shape {tuple(logits_row.shape)}")
        n = min(self.grammar.vocab_size, logits_row.shape[0])
        allowed = self._allowed(n)
        if logits_row.device.type == "cpu" and logits_row.dtype == torch.float32:
            # numpy, one thread: torch's own ops on a row this wide go through its thread pool, which the model's
            # matmuls keep busy (tens of ms at p99 under load).
            np.copyto(logits_row[:n].numpy(), -np.inf, where=~allowed)
        else:
            logits_row[:n].masked_fill_(~torch.from_numpy(allowed).to(logits_row.device), float("-inf"))
        logits_row[n:] = float("-inf")  # ids the tokenizer does not have
        return logits_row

    def _allowed(self, n: int) -> np.ndarray:
        """(n,) bool: the tokens the grammar allows next, of the first n."""
        if self.finished:
            raise SmolError("the grammar is finished: no token may follow EOS")
        self._m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._m.is_error():
            self.cut_short = True
        if self.cut_short:
            eos = self.grammar.eos_token_id
            self._bitmask[:] = 0
            self._bitmask.view(np.uint8)[eos // 8] = 1 << eos % 8
        room = self._digit_room()
        if room is not None:
            fits = self.grammar.vocab.fits(room)
            if fits is not None:
                np.bitwise_and(self._bitmask, fits, out=self._bitmask)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:n].view(np.bool_)

    def _digit_room(self) -> int | None:
        """How many more digits the JSON number being written may take; None where no number is being written."""
        if self._json is None or not self._json.in_values:
            return None
        return max(0, self.grammar.numbers.digits - self._json.digits)

    def accept(self, token: int) -> None:
        """Advance by the sampled token; SmolError if the grammar does not allow it here."""
        token = int(token)
        if self.finished:
            raise SmolError(f"token {token} after the grammar's end (EOS)")
        if token == self.grammar.eos_token_id:
            ok = self.cut_short or self._m.is_accepting() and self._m.consume_token(token)
        else:
            room = self._digit_room()
            ok = 0 <= token < self.grammar.vocab_size and not self.cut_short \
                and (room is None or self.grammar.vocab.leading_digits[token] <= room) \
                and self._m.try_consume_tokens([token]) == 1  # unlike consume_token, no error state on a refusal
        if not ok:
            raise SmolError(f"token {token} is not allowed by the {self.grammar.key[:80]} grammar here")
        if token == self.grammar.eos_token_id:
            self.finished = True
        elif self._json is not None:
            self._json.feed(self.grammar.vocab.token_bytes[token])


class JsonText:
    """Reads JSON as it is written, byte by byte: whether it stands inside a string, and how many digits in a row
    it ends with outside strings (a number's, the only place JSON has digits outside a string). begin: the JSON
    starts after these bytes (b"": at once); before them, the text is not read as JSON."""

    def __init__(self, begin: bytes = b""):
        self.begin = begin
        self.before: bytes | None = b"" if begin else None  # while the JSON has not begun: the text's last bytes
        self.in_string = self.escaped = False
        self.digits = self.longest = 0

    @property
    def in_values(self) -> bool:
        """The JSON has begun, outside a string: a number may go on or begin."""
        return self.before is None and not self.in_string

    def feed(self, data: bytes) -> None:
        if self.before is not None:
            text = self.before + data
            at = text.find(self.begin)
            if at < 0:
                self.before = text[len(text) - len(self.begin) + 1:]  # what may be the start of `begin`
                return
            self.before, data = None, text[at + len(self.begin):]
        for byte in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # the closing quote
                    self.in_string = False
            elif 0x30 <= byte <= 0x39:
                self.digits += 1
                self.longest = max(self.longest, self.digits)
            else:
                self.in_string, self.digits = byte == 0x22, 0


def _digits(schema) -> int:
    """The most digits a row of an answer's number may have under the schema: DIGITS, or more where the schema's
    own numbers have more (a bound, an enum), and one beyond them (exclusiveMinimum 99 asks for 100)."""
    text = JsonText()
    text.feed(json.dumps(schema).encode())
    return max(DIGITS, text.longest + 1)


@dataclass
class Vocab:
    """llguidance's tables for a tokenizer (~0.5 s to build: every token's bytes in a trie), once each, and each
    token's bytes and leading digits for the bound on numbers."""
    serial: int
    tokenizer: llguidance.LLTokenizer
    token_bytes: list[bytes]
    leading_digits: np.ndarray  # (V,) how many digits each token starts with
    most_leading_digits: int
    _fits: dict = field(default_factory=dict)  # room -> bitmask

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def fits(self, room: int) -> np.ndarray | None:
        """The bitmask of the tokens that start with at most `room` digits; None where every token does."""
        if room >= self.most_leading_digits:
            return None
        if room not in self._fits:
            bits = np.packbits(self.leading_digits <= room, bitorder="little")
            self._fits[room] = np.pad(bits, (0, -len(bits) % 4)).view(np.int32)
        return self._fits[room]


def _llguidance():
    """llguidance, imported at a grammar's first use: ~3 MB resident in every process that never constrains."""
    import llguidance

    return llguidance


def _vocab(tokenizer) -> Vocab:
    vocab = _vocabs.get(tokenizer)
    if vocab is None:
        # Special tokens (<|im_start|>, <filename>, ...) are not their spelling: llguidance reads them from the
        # tokenizer.json as special and never allows them in text (EOS is allowed where the grammar ends).
        tables = _llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                        eos_token=tokenizer.eos_token_id)
        token_bytes = [tables.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        leading = np.array([len(b) - len(b.lstrip(b"0123456789")) for b in token_bytes], dtype=np.int64)
        vocab = _vocabs[tokenizer] = Vocab(next(_serials), tables, token_bytes, leading, int(leading.max()))
    return vocab


def _compile(vocab: Vocab, grammar: str, what: str):
    """An llguidance matcher at the grammar's start, its first mask computed (some errors, a lexer past its fuel,
    show only there; and each sequence's copy starts with the lexer states it built); SmolError naming what."""
    matcher = _llguidance().LLMatcher(vocab.tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        bitmask = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    if matcher.is_error():
        raise SmolError(f"{what}: {_reason(matcher.get_error())}")
    return matcher


def _reason(message: str) -> str:
    """llguidance's message in one line: without its position, the grammar's text and the parser's state."""
    lines = message.strip().splitlines()
    head = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    detail = next((line[len("error: "):] for line in lines[1:] if line.startswith("error: ")), "")
    return f"{head} {detail}".strip()


def _lark(grammar: str) -> str:
    """llguidance's grammar from Lark's text, with no_forcing: the model writes a stretch of text the grammar fixes
    in any tokens that spell it. Else llguidance allows only its own tokens there, chosen before the text after the
    stretch is known: `"` then `}}` where the model (and the tokenizer) would write `"}` then `},`."""
    return _llguidance().LLMatcher.grammar_from_lark('%llguidance {"no_forcing": true}\n' + grammar)


def _json_grammar(schema) -> str:
    return _lark(f"start: %json {json.dumps(_with_options(schema))}")


def _tagged_grammar(schema, begin: str, end: str, anywhere: bool) -> str:
    """Lark: the JSON between begin and end (compact, as response_format's), after free text without `begin`."""
    tagged = f"%json {json.dumps(_with_options(schema))} {json.dumps(end)}"
    if not anywhere:
        return _lark(f"start: {json.dumps(begin)} {tagged}")
    # The text before the tag is one lexeme, and lazy: it ends at the first `begin`, which text alone never writes.
    return _lark(
        f"start: TEXT | head {tagged}\n"
        f"head[lazy]: TEXT {json.dumps(begin)}\n"
        f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(begin)}(?s:.*)/\n")


def _with_options(schema) -> dict:
    """The schema with JSON_OPTIONS as its "x-guidance", llguidance's options, in place of any of its own (free
    whitespace, say). true and false as the objects that mean them: the options need an object."""
    if isinstance(schema, bool):
        schema = {} if schema else {"anyOf": []}
    return {**{k: v for k, v in schema.items() if k != "x-guidance"}, "x-guidance": JSON_OPTIONS}


def _closed(schema, merged: bool = False):
    """The schema with each object that does not say otherwise closed to properties it does not name
    (additionalProperties: false): the answers stay valid, and shorter. merged: the schema is a branch that
    llguidance merges with its parent's properties (allOf, or anyOf/oneOf beside properties), which it would
    otherwise refuse."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(v) for name, v in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            branch = key in ("allOf", "anyOf", "oneOf") and (key == "allOf" or "properties" in schema)
            out[key] = [_closed(v, branch) for v in value]
        elif key in SCHEMA_VALUES:
            out[key] = _closed(value)
        else:
            out[key] = value
    kind = schema.get("type")
    is_object = "properties" in schema or kind == "object" or isinstance(kind, list) and "object" in kind
    if is_object and not merged and not any(k in schema for k in OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _check_choices(choices) -> None:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SmolError('response_format choice needs "choices": a list of non-empty strings')
    if len(choices) > MAX_CHOICES:
        raise SmolError(f"response_format choice: {len(choices)} choices, more than {MAX_CHOICES}")
    characters = sum(map(len, choices))
    if characters > MAX_SCHEMA_CHARS:
        raise SmolError(f"response_format choice: {characters} characters, more than {MAX_SCHEMA_CHARS}")
    for c in choices:
        try:
            c.encode("utf-8")
        except UnicodeEncodeError:
            raise SmolError(f"response_format choice {c[:40]!r}: not valid Unicode text") from None
