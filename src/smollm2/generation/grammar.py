"""Structured output: OpenAI's `response_format` as a grammar that masks each step's logits.

    grammar = Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": {...}}}, tokenizer)
    matcher = grammar.matcher()            # one per sequence: it holds where in the JSON the sequence is
    row = matcher.allowed(logits[i])       # -inf on every token the grammar forbids next (in place)
    token = sample(row)
    matcher.accept(token)                  # SmolError if the grammar forbids it
    if matcher.finished: ...               # EOS was accepted: the answer is complete

Once the JSON value is complete the grammar allows EOS alone, so a sequence under a grammar ends with EOS
(or runs out of tokens first, and its JSON is cut short, as any answer cut by max_tokens is).

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

MAX_SCHEMA_CHARS = 32_768  # a schema is a request's input: bounded before it reaches a compiler
MAX_SCHEMA_DEPTH = 32
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
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} -> JSON valid under that schema."""
        if not isinstance(response_format, dict):
            raise SmolError(f"response_format must be an object, not {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls._get(tokenizer, "json_object", None)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise SmolError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
            schema = spec["schema"]
            check_schema(schema)
            return cls._get(tokenizer, json.dumps(schema, sort_keys=True), schema)
        raise SmolError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")

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
        return cls._get(tokenizer, key, (schema, begin, end, anywhere), _compile_tagged)

    @classmethod
    def _get(cls, tokenizer, key: str, schema, compile=None) -> Grammar:
        if tokenizer.eos_token_id is None:
            raise SmolError(f"{tokenizer.source}: the tokenizer has no EOS token to end a structured answer")
        with _lock:
            serial, compiler = _compiler(tokenizer)
            cache_key = (serial, key)
            compiled = _compiled.get(cache_key)
            if compiled is not None:
                _compiled.move_to_end(cache_key)
            else:
                compiled = (compile or _compile)(compiler, schema)
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


def _compile(compiler, schema):
    # Compact JSON (", " and ": ", no free whitespace): a small model left free to write whitespace can write
    # nothing else until max_tokens, and runs of it are wasted tokens anyway.
    if schema is None:
        # Any object, any properties: strict_mode=False, else {"type": "object"} would allow only {}.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    try:
        # strict_mode: no properties beyond those the schema names (the answers stay valid, and shorter).
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except RuntimeError as e:  # xgrammar's message names the unsupported or broken part of the schema
        reason = str(e).strip().splitlines()[0].split(": ", 1)[-1]
        raise SmolError(f"response_format json_schema: {reason}") from None


def _compile_tagged(compiler, spec):
    schema, begin, end, anywhere = spec
    import xgrammar as xgr
    try:
        # The JSON as response_format's (compact, no properties beyond the schema's), as a grammar inside the tag.
        json_grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0].split(": ", 1)[-1]
        raise SmolError(f"{begin}...{end} JSON schema: {reason}") from None
    tag = {"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": str(json_grammar)}, "end": end}
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
