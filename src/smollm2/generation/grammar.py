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

The grammar engine is xgrammar, chosen over llguidance by measurement (benchmarks/constrained.py: 2 shared CPU
cores, SmolLM2's tokenizer, replaying valid answers to five JSON grammars): computing the allowed-token bitmask
and advancing the matcher took 4.1 us a token on average with xgrammar (p99 15 us), 25 us with llguidance (p99
206 us; 55 us on average for a schema with maxLength strings and integer ranges, where xgrammar stayed at 4.5).
Both are small beside the model's own decode step (6.2 ms at batch 1, fp32, in the same run); applying the
mask to a 49152-wide row costs more than either (0.13-0.24 ms with xgrammar's CPU kernel), so allowed() is
~0.3 ms a token in all, ~5% of a step. xgrammar compiles a JSON schema in ~5-7 ms (llguidance ~1 ms: it compiles
lazily, as tokens come), paid once per schema thanks to the LRU cache below, and builds its tokenizer tables in
~0.7-1 s, once per tokenizer.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import FieldError, SmolError

if TYPE_CHECKING:
    from ..tools import Tools

MAX_SCHEMA_CHARS = 32_768  # a schema (or a list of choices) is a request's input: bounded before it reaches a compiler
MAX_SCHEMA_DEPTH = 32
MAX_PATTERN_CHARS = 256  # a regex's compiled grammar grows with it: each counted repetition of a broad class,
# [^a]{0,40} say, costs xgrammar up to ~0.6 s of one CPU thread to compile
MAX_CHOICES = 1024
DIGITS = 16  # the most digits a JSON number has before its point, after it, and in its exponent (as llama.cpp)
LARGEST = 10**DIGITS - 1
# xgrammar's built-in rules for numbers without a range, as it prints them, with their digits bounded. (A range
# with both ends gives bounded digits already; a range open at one end is closed at +-LARGEST, see _bounded.)
BOUNDED_NUMBERS = {
    "basic_integer": f'"0" | "-"? [1-9] [0-9]{{0,{DIGITS - 1}}}',
    "basic_number": f'"-"? ("0" | [1-9] [0-9]{{0,{DIGITS - 1}}}) ("." [0-9]{{1,{DIGITS}}})? '
                    f'([eE] [+\\-]? [0-9]{{1,{DIGITS}}})?',
}
CACHE_SIZE = 64  # compiled grammars kept, least recently used dropped first
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}

_lock = threading.Lock()  # the server's handlers may compile concurrently; the caches are shared
_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (serial, GrammarCompiler)
_compiled: OrderedDict = OrderedDict()  # (the compiler's serial, key) -> CompiledGrammar
_serials = itertools.count()  # not id(): a dropped tokenizer's compiler may leave its id to another's


class Grammar:
    """A compiled grammar for one tokenizer: immutable, shared by every sequence that asks for it."""

    def __init__(self, compiled, vocab_size: int, eos_token_id: int, key: str):
        self._compiled, self.vocab_size, self.eos_token_id, self.key = compiled, vocab_size, eos_token_id, key

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
            return cls._get(tokenizer, "json_object", lambda compiler: _compile_json(compiler, None))
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise SmolError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
            schema = spec["schema"]
            check_schema(schema)
            return cls._get(tokenizer, json.dumps(schema, sort_keys=True),
                            lambda compiler: _compile_json(compiler, schema))
        if kind == "choice":
            choices = response_format.get("choices")
            _check_choices(choices)
            # An EBNF string literal escapes as JSON does; a character beyond ASCII stays itself.
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return cls._get(tokenizer, "choice " + json.dumps(choices), lambda compiler: compiler.compile_grammar(ebnf))
        if kind == "regex":
            pattern = response_format.get("pattern")
            if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
                raise SmolError(f'response_format regex needs "pattern": a regular expression of 1 to '
                                f"{MAX_PATTERN_CHARS} characters")
            return cls._get(tokenizer, "regex " + pattern, lambda compiler: _compile_regex(compiler, pattern))
        raise SmolError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema', "
                        f"'choice', 'regex'")

    @classmethod
    def for_answer(cls, tokenizer, response_format=None, tools: Tools | None = None) -> Grammar | None:
        """What an answer must fit: the calls of the tools it may call, or response_format's JSON; not both (a
        FieldError naming response_format)."""
        if tools is not None and tools.offered:
            if response_format is not None:
                raise FieldError("response_format", "cannot constrain an answer that may call tools "
                                 "(tool_choice 'none' lets it)")
            return tools.grammar(tokenizer)
        return None if response_format is None else cls.from_response_format(response_format, tokenizer)

    @classmethod
    def from_tagged_json(cls, schema: dict, tokenizer, begin: str, end: str, anywhere: bool) -> Grammar:
        """JSON valid under `schema` between the strings `begin` and `end`, then EOS: tool calls, as
        <tool_call>[...]</tool_call>. anywhere: free text may come first, and the tagged JSON only where the text
        writes `begin` (or the text ends without it); else the answer is the tagged JSON from its first token.
        The schema is the caller's to check first (check_schema), with the name of the field it came in."""
        key = json.dumps({"begin": begin, "end": end, "anywhere": anywhere, "schema": schema}, sort_keys=True)
        return cls._get(tokenizer, key, lambda compiler: _compile_tagged(compiler, schema, begin, end, anywhere))

    @classmethod
    def _get(cls, tokenizer, key: str, compile) -> Grammar:
        """The grammar cached under key for this tokenizer, or compile(compiler)'s, cached."""
        if tokenizer.eos_token_id is None:
            raise SmolError(f"{tokenizer.source}: the tokenizer has no EOS token to end a structured answer")
        with _lock:
            serial, compiler = _compiler(tokenizer)
            cache_key = (serial, key)
            compiled = _compiled.get(cache_key)
            if compiled is not None:
                _compiled.move_to_end(cache_key)
            else:
                compiled = compile(compiler)
                _compiled[cache_key] = compiled
                while len(_compiled) > CACHE_SIZE:
                    _compiled.popitem(last=False)
        return cls(compiled, tokenizer.vocab_size, tokenizer.eos_token_id, key)

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """Where one sequence stands in a grammar: which tokens may come next, advanced a token at a time."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr
        self._xgr, self.grammar = xgr, grammar
        self._m = xgr.GrammarMatcher(grammar._compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)  # (1, ceil(V/32)) int32, reused

    @property
    def finished(self) -> bool:
        """EOS was accepted: the grammar takes no more tokens and the sequence ends here."""
        return self._m.is_terminated()

    def mask(self, width: int | None = None) -> torch.Tensor:
        """(width,) bool, True where a token may come next. width: the logits' size (default the tokenizer's):
        ids past the tokenizer's vocabulary (padding rows of the model's embedding) are never allowed, and a
        narrower width drops the ids the model cannot produce anyway."""
        V = self.grammar.vocab_size
        width = V if width is None else width
        self._fill()
        # Bit j of word w allows token 32*w + j (little-endian within each int32 word). numpy, not torch: one
        # thread, no wait on torch's pool, which the model's matmuls keep busy.
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:min(V, width)]
        allowed = torch.from_numpy(bits).bool()
        if width > allowed.shape[0]:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        return allowed

    def allowed(self, logits_row: torch.Tensor) -> torch.Tensor:
        """Set the forbidden tokens of a (V,) float logits row to -inf, in place; returns the row."""
        if logits_row.dim() != 1:
            raise SmolError(f"allowed() takes one (V,) logits row, not shape {tuple(logits_row.shape)}")
        self._fill()
        n = min(self.grammar.vocab_size, logits_row.shape[0])
        if logits_row.device.type == "cpu":
            # xgrammar's C++ kernel on the CPU: ~0.13 ms a 49152-wide row, and no tail when the CPUs are busy
            # (torch's own ops on a row this wide go through its thread pool: tens of ms at p99 under load).
            self._xgr.apply_token_bitmask_inplace(logits_row[None, :n], self._bitmask, vocab_size=n)
        else:
            logits_row[:n].masked_fill_(~self.mask(n).to(logits_row.device), float("-inf"))
        logits_row[n:] = float("-inf")  # ids the tokenizer does not have
        return logits_row

    def _fill(self) -> None:
        if self._m.is_terminated():
            raise SmolError("the grammar is finished: no token may follow EOS")
        self._m.fill_next_token_bitmask(self._bitmask)

    def accept(self, token: int) -> None:
        """Advance by the sampled token; SmolError if the grammar does not allow it here."""
        token = int(token)
        if self._m.is_terminated():
            raise SmolError(f"token {token} after the grammar's end (EOS)")
        if not 0 <= token < self.grammar.vocab_size or not self._m.accept_token(token):
            raise SmolError(f"token {token} is not allowed by the {self.grammar.key[:80]} grammar here")


def _compiler(tokenizer):
    """xgrammar's tables for a tokenizer (~1 s to build: every token's bytes sorted into a trie), once each."""
    entry = _compilers.get(tokenizer)
    if entry is None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise SmolError("response_format and tools need xgrammar: pip install 'smollm2[structured]'") from None
        backend = tokenizer.backend
        # The vocabulary as stored (byte-level BPE: bytes as GPT-2's printable characters); xgrammar decodes it
        # the way the tokenizer.json's decoder does, which it detects from the serialized tokenizer.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab = [backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        # Special tokens (<|im_start|>, <filename>, ...) are not their spelling: as text, "<|im_start|>" would be
        # allowed inside any JSON string. An empty string is how xgrammar marks a token as special, never allowed
        # (EOS is allowed where the grammar ends, as the stop token).
        for i, added in backend.get_added_tokens_decoder().items():
            if added.special and i < len(vocab):
                vocab[i] = ""
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=tokenizer.vocab_size,
                                 stop_token_ids=[tokenizer.eos_token_id],
                                 add_prefix_space=meta["add_prefix_space"])
        # One thread: the CPUs belong to the model's matmuls. Our own LRU replaces xgrammar's unbounded cache.
        entry = _compilers[tokenizer] = next(_serials), xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return entry


def _compile_json(compiler, schema):
    """Any JSON object (schema None) or JSON valid under the schema; compact, numbers bounded (see above)."""
    return compiler.compile_grammar(_json_grammar(schema, "response_format json_schema"))


def _json_grammar(schema, what: str) -> str:
    """The EBNF of any JSON object (schema None) or of JSON valid under the schema: compact, numbers bounded (see
    above). what: where the schema came from, for its errors."""
    # Compact JSON (", " and ": ", no free whitespace): a small model left free to write whitespace can write
    # nothing else until max_tokens, and runs of it are wasted tokens anyway.
    import xgrammar as xgr
    try:
        if schema is None:
            # Any object, any properties: strict_mode=False, else {"type": "object"} would allow only {}.
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        else:
            # strict_mode: no properties beyond those the schema names (the answers stay valid, and shorter).
            grammar = xgr.Grammar.from_json_schema(json.dumps(_bounded(schema)), any_whitespace=False,
                                                   strict_mode=True)
    except RuntimeError as e:  # xgrammar's message names the unsupported or broken part of the schema
        raise SmolError(f"{what}: {_reason(e)}") from None
    rules = []
    for rule in str(grammar).splitlines():
        name = rule.split(" ::= ", 1)[0]
        rules.append(f"{name} ::= {BOUNDED_NUMBERS[name]}" if name in BOUNDED_NUMBERS else rule)
    return "\n".join(rules)


def _bounded(schema):
    """The schema with every integer or number range that is open at one end closed at +-LARGEST (where that
    leaves it some numbers): xgrammar writes an open end's digits without bound."""
    if isinstance(schema, list):
        return [_bounded(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples") else _bounded(v) for k, v in schema.items()}
    kind = schema.get("type")  # a dict here is a property named "type": `properties` holds schemas by name
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    if "integer" in kinds or "number" in kinds:
        low = [schema[k] for k in ("minimum", "exclusiveMinimum") if _is_number(schema.get(k))]
        high = [schema[k] for k in ("maximum", "exclusiveMaximum") if _is_number(schema.get(k))]
        if low and not high and max(low) < LARGEST:
            out["maximum"] = LARGEST
        if high and not low and min(high) > -LARGEST:
            out["minimum"] = -LARGEST
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _compile_regex(compiler, pattern: str):
    try:
        return compiler.compile_regex(pattern)
    except RuntimeError as e:  # xgrammar's message says what is wrong, and where
        raise SmolError(f"response_format regex: {_reason(e)}") from None


def _reason(error: RuntimeError) -> str:
    """xgrammar's message, without the source file and line it starts with."""
    return str(error).strip().splitlines()[0].split(": ", 1)[-1]


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


def _compile_tagged(compiler, schema, begin: str, end: str, anywhere: bool):
    # The JSON as response_format's (compact, numbers bounded, no properties beyond the schema's), inside the tag.
    json_grammar = _json_grammar(schema, f"{begin}...{end} JSON schema")
    tag = {"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": json_grammar}, "end": end}
    if anywhere:  # free text, then at most one tag, then the end
        tag = {"type": "triggered_tags", "triggers": [begin], "tags": [tag], "stop_after_first": True}
    return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))


def check_schema(schema, where: str = "response_format") -> None:
    """Bounds and names what a compiler would otherwise meet first: size, depth, and the `type` keywords.
    where: the field the schema came in, which the errors (FieldError) name."""
    if not isinstance(schema, (dict, bool)):
        raise FieldError(where, f"the schema must be an object, not {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise FieldError(where, f"not JSON ({e})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise FieldError(where, f"{len(text)} characters, more than {MAX_SCHEMA_CHARS}")

    def walk(node, path: str, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise FieldError(where, f"nested deeper than {MAX_SCHEMA_DEPTH} at {path}")
        if isinstance(node, dict):
            kind = node.get("type")  # a dict here is a property named "type", walked below
            for t in kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []:
                if t not in JSON_TYPES:
                    raise FieldError(where, f"unknown type {t!r} at {path}")
            for k, v in node.items():
                if k not in ("enum", "const", "default", "examples"):  # values there are data, not schemas
                    walk(v, f"{path}/{k}", depth + 1)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}", depth + 1)

    walk(schema, "#", 0)
