"""Text <-> token ids, and the chat template, for the same sources the model loads from.

Everything runs on Hugging Face's `tokenizers` library; this module only assembles one:

* a HF directory (or hub id) already has a `tokenizer.json`, so it is loaded as it is, with the special
  tokens and the chat template from `tokenizer_config.json` (or `chat_template.jinja`, transformers 5 style);
* a GGUF file has no `tokenizer.json`, only llama.cpp's metadata (vocabulary, merges, token types), so the
  pipeline SmolLM2's `tokenizer.json` describes is rebuilt from it: digits split one by one, then GPT-2's
  byte-level BPE with no prefix space. Control tokens become special tokens, matched whole in the text.

The chat template is the checkpoint's own Jinja, rendered in a sandbox the way transformers renders it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from pathlib import Path

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

from .checkpoints import resolve
from .checkpoints.gguf import open_gguf
from .errors import SmolError
from .tools import Tools, check_tool_messages, template_format, trained_format

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types
# The pre-tokenizers _from_gguf builds, as tokenizer.json describes them (offsets aside), by llama.cpp's names
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]},
    "gpt-2": BYTE_LEVEL,
}


class StreamDecoder:
    """Decodes one token at a time; a character split across tokens comes out once it is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # kept only so that finish() can name what is still held back
        self._emitted = 0

    def step(self, token_id: int) -> str:
        self._ids += self._tok._check_ids([token_id])
        text = self._stream.step(self._tok.backend, self._ids[-1]) or ""
        self._emitted += len(text)
        return text

    def finish(self) -> str:
        """What is still held back: an incomplete character at the end becomes U+FFFD, as in decode()."""
        return self._tok.decode(self._ids, self._skip)[self._emitted:]


class Tokenizer:
    def __init__(self, backend: Backend, source: str, *, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None, unk: str | None = None, chat_template: str | None = None,
                 template_source: str | None = None):
        self.backend, self.source, self.chat_template = backend, source, chat_template
        self.template_source = template_source or source  # the file errors in the template name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos, eos, pad, unk
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = (
            self._id_of(t) for t in (bos, eos, pad, unk))

    @classmethod
    def from_pretrained(cls, src: str | os.PathLike | None = None) -> Tokenizer:
        """None (the embedded SmolLM2-135M-Instruct), a HF directory, a .gguf file, or a hub id."""
        path = resolve(src)
        if path.is_dir():
            return cls._from_hf_dir(path)
        if path.suffix == ".gguf":
            return cls._from_gguf(path)
        raise SmolError(f"{path}: not a tokenizer source (expected a HF directory with tokenizer.json, "
                        "or a .gguf file)")

    @classmethod
    def _from_hf_dir(cls, path: Path) -> Tokenizer:
        if not (path / "tokenizer.json").is_file():
            raise SmolError(f"{path}: no tokenizer.json in this directory")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception
            raise SmolError(f"{path / 'tokenizer.json'}: not a valid tokenizer file ({e})") from None
        config = {}
        if (path / "tokenizer_config.json").is_file():
            try:
                config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise SmolError(f"{path / 'tokenizer_config.json'}: not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise SmolError(f"{path / 'tokenizer_config.json'}: expected a JSON object")
        template, template_file = config.get("chat_template"), path / "tokenizer_config.json"
        if isinstance(template, list):  # older transformers: named templates; "default" is the chat one
            if not all(isinstance(t, dict) for t in template):
                raise SmolError(f"{template_file}: chat_template must be a string or a list of "
                                "{'name': ..., 'template': ...} objects")
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template_file = path / "chat_template.jinja"
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise SmolError(f"{template_file}: cannot read the chat template ({e})") from None
        if not isinstance(template, (str, type(None))):
            raise SmolError(f"{template_file}: chat_template must be a string, got {str(template)[:40]!r}")

        def token(name):  # a string, or an AddedToken serialised as a dict
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if not isinstance(value, (str, type(None))):
                raise SmolError(f"{path / 'tokenizer_config.json'}: {name} must be a string, got {value!r:.40}")
            if value is not None and backend.token_to_id(value) is None:
                raise SmolError(f"{path / 'tokenizer_config.json'}: {name} {value!r:.40} is not in the vocabulary")
            return value

        return cls(backend, str(path), bos=token("bos_token"), eos=token("eos_token"), pad=token("pad_token"),
                   unk=token("unk_token"), chat_template=template, template_source=str(template_file))

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        reader = open_gguf(path)
        kind, pre = reader.metadata.get("tokenizer.ggml.model"), reader.metadata.get("tokenizer.ggml.pre")
        if kind is None:
            raise SmolError(f"{path}: no tokenizer in this GGUF (metadata tokenizer.ggml.model is missing)")
        if kind != "gpt2":
            raise SmolError(f"{path}: unsupported tokenizer model {kind!r}; only byte-level BPE ('gpt2') is supported")
        if pre not in ("smollm", "gpt-2"):
            raise SmolError(f"{path}: unsupported pre-tokenizer {pre!r}; only 'smollm' and 'gpt-2' are supported")
        tokens, merges = reader.metadata.get("tokenizer.ggml.tokens"), reader.metadata.get("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise SmolError(f"{path}: missing metadata tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = reader.metadata.get("tokenizer.ggml.token_type")
        for key, values, kind in (("tokens", tokens, str), ("merges", merges, str), ("token_type", types, int)):
            if values is not None and (not isinstance(values, list) or not all(isinstance(v, kind) for v in values)):
                raise SmolError(f"{path}: tokenizer.ggml.{key} must be a list of "
                                f"{'strings' if kind is str else 'integers'}")
        types = [NORMAL] * len(tokens) if types is None else types
        if len(types) != len(tokens):
            raise SmolError(f"{path}: tokenizer.ggml.token_type lists {len(types)} types for {len(tokens)} tokens")
        # llama.cpp needs one token per row of the embeddings; fewer would fail only once generation reaches them.
        rows = next((t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight"), len(tokens))
        if len(tokens) != rows:
            raise SmolError(f"{path}: tokenizer.ggml.tokens lists {len(tokens)} tokens, but token_embd.weight "
                            f"has {rows} rows")
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        if (bad := next((i for i, pair in enumerate(pairs) if len(pair) != 2 or not all(pair)), None)) is not None:
            raise SmolError(f"{path}: tokenizer.ggml.merges[{bad}] ({merges[bad][:40]!r}) is not two tokens "
                            "separated by a space")
        try:
            backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
        except Exception as e:  # the Rust library's message runs over several lines: one, for the CLI
            raise SmolError(f"{path}: inconsistent vocabulary and merges ({' '.join(str(e).split())})") from None
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        # SmolLM2 was trained on digits split one by one; its merges have no multi-digit tokens to find.
        backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                                 if pre == "smollm" else byte_level)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == USER_DEFINED])

        def token(key):
            i = reader.metadata.get(f"tokenizer.ggml.{key}")
            if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
                raise SmolError(f"{path}: tokenizer.ggml.{key} must be a token id, got {str(i)[:40]!r}")
            if i is not None and not 0 <= i < len(tokens):
                raise SmolError(f"{path}: tokenizer.ggml.{key} = {i} is outside the vocabulary of {len(tokens)}")
            return None if i is None else tokens[i]

        bos, eos = token("bos_token_id"), token("eos_token_id")
        add_bos = bos is not None and bool(reader.metadata.get("tokenizer.ggml.add_bos_token", False))
        add_eos = eos is not None and bool(reader.metadata.get("tokenizer.ggml.add_eos_token", False))
        if add_bos or add_eos:  # llama.cpp adds them only where the file says so
            ends = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
            backend.post_processor = processors.TemplateProcessing(
                single=[bos] * add_bos + ["$A"] + [eos] * add_eos,
                special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(ends)])
        template = reader.metadata.get("tokenizer.chat_template")
        if not isinstance(template, (str, type(None))):
            raise SmolError(f"{path}: tokenizer.chat_template must be a string")
        return cls(backend, str(path), bos=bos, eos=eos, pad=token("padding_token_id"), unk=token("unknown_token_id"),
                   chat_template=template)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json, which from_pretrained and transformers read."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                  "unk_token": self.unk_token, "chat_template": self.chat_template,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def gguf_metadata(self) -> dict[str, str | bool | int | list]:
        """The tokenizer.* keys _from_gguf reads and llama.cpp loads, as data for checkpoints.save_gguf (a string,
        a flag, a token id, or a list each): the vocabulary, its token types and merges, the pre-tokenizer by
        llama.cpp's name for it, the special tokens, and the chat template."""
        spec = json.loads(self.backend.to_str())
        model, splits = spec["model"], _ids_only(spec.get("pre_tokenizer"))
        pre = next((name for name, known in PRE_TOKENIZERS.items() if known == splits), None)
        if (model["type"] != "BPE" or model.get("ignore_merges") or spec.get("normalizer") is not None
                or pre is None):
            raise SmolError(f"{self.source}: GGUF holds byte-level BPE tokenizers that split text as SmolLM2's or "
                            "GPT-2's do; this one does not")
        ids = {i: token for token, i in self.backend.get_vocab(with_added_tokens=True).items()}
        if sorted(ids) != list(range(len(ids))):
            raise SmolError(f"{self.source}: the token ids are not 0 to {len(ids) - 1} without gaps, "
                            "as GGUF's list of tokens needs")
        added = self.backend.get_added_tokens_decoder()
        types = [(CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL for i in range(len(ids))]
        add_bos, add_eos = self._added_ends()
        metadata = {"tokenizer.ggml.model": "gpt2",  # llama.cpp's name for byte-level BPE
                    "tokenizer.ggml.pre": pre,
                    "tokenizer.ggml.tokens": [ids[i] for i in range(len(ids))],
                    "tokenizer.ggml.token_type": types,
                    "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]}
        special = {"bos": self.bos_token_id, "eos": self.eos_token_id, "unknown": self.unk_token_id,
                   "padding": self.pad_token_id}
        metadata |= {f"tokenizer.ggml.{name}_token_id": i for name, i in special.items() if i is not None}
        metadata["tokenizer.ggml.add_bos_token"] = add_bos
        if add_eos:  # llama.cpp's converter writes it only then; llama.cpp reads its absence as False
            metadata["tokenizer.ggml.add_eos_token"] = True
        if self.chat_template is not None:
            metadata["tokenizer.chat_template"] = self.chat_template
        return metadata

    def _added_ends(self) -> tuple[bool, bool]:
        """Whether encode() puts the BOS token before a text and the EOS token after it: all that GGUF's
        add_bos_token and add_eos_token can say about a post-processor."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a").ids
        start = full.index(plain[0])
        before, after = full[:start], full[start + len(plain):]
        if before not in ([], [self.bos_token_id]) or after not in ([], [self.eos_token_id]):
            raise SmolError(f"{self.source}: the tokenizer adds {before} before a text and {after} after it; "
                            "GGUF can only say whether the BOS and EOS tokens are added")
        return bool(before), bool(after)

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise SmolError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return token_id

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise SmolError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise SmolError(f"encode() takes a string, not {type(text).__name__}")
        return self.backend.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a character, for some): its byte-level BPE string mapped
        back to bytes; a special token's own text, as UTF-8."""
        (token_id,) = self._check_ids([token_id])
        piece = self.backend.id_to_token(token_id) or ""
        table = _unicode_to_byte()
        if token_id in self._special_ids or not all(c in table for c in piece):
            return piece.encode("utf-8")
        return bytes(table[c] for c in piece)

    def token_text(self, token_id: int) -> str:
        """One token's text: its bytes as UTF-8, an incomplete character shown as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: Tools | None = None) -> str:
        """The chat as its template writes it. Messages are {"role", "content"}, with OpenAI's tool parts where
        there are some: an assistant's "tool_calls" (its content then may be None), and role "tool" messages with
        the "tool_call_id" they answer. tools: the tools the model may call (smollm2.tools.Tools). A template
        that writes tools itself (one that reads a `tools` variable) gets them, and the calls, as transformers
        gives them; any other, the chat in SmolLM2's trained format (smollm2.tools.trained_format)."""
        if self.chat_template is None:
            raise SmolError(f"{self.source}: this checkpoint has no chat template")
        _check_messages(messages)
        check_tool_messages(messages)
        try:
            env, template = _compiled_template(self.chat_template)
            if _reads_tools(self.chat_template):
                offered = tools.openai() if tools is not None and tools.offered else None
                chat = dict(messages=template_format(messages), tools=offered)
            else:
                chat = dict(messages=trained_format(messages, tools))
            return env.render(template, **chat, add_generation_prompt=add_generation_prompt,
                              bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except Exception as e:  # the template is untrusted code: whatever it raises is its failure
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SmolError(f"{self.template_source}: chat template failed: {reason}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Tools | None = None) -> list[int]:
        """render_chat's text as token ids."""
        # The template writes its own special tokens, so none are added around it.
        return self.backend.encode(self.render_chat(messages, add_generation_prompt, tools),
                                   add_special_tokens=False).ids


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> tuple[BoundedSandbox, jinja2.Template]:
    """A chat template compiled once, in its own sandbox: compiling takes milliseconds, rendering a chat a tenth
    of one, and a server renders one per request. A template that fails to compile is not kept."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    return env, env.from_string(source)


@functools.lru_cache(maxsize=16)
def _reads_tools(source: str) -> bool:
    """Whether a chat template writes tools itself: it reads a `tools` variable (as transformers tells)."""
    env, _ = _compiled_template(source)
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


class TemplateLimit(jinja2.TemplateError):
    """A chat template asked for more time, memory or output than any chat needs."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox keeps a template away from Python's internals; this one also bounds what it costs.
    A template is untrusted code, and a few characters of it can ask for gigabytes or hours: its ranges, the
    strings and lists its operators, calls and filters make, and its output are capped, as are the numbers it
    passes to calls and filters and the widths in its formats; powers are bounded, and it stops past a time
    limit, checked on each line of the template's compiled code."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    SECONDS = 2.0
    LENGTH = 1_000_000  # characters or items: far beyond any chat a context window holds

    def __init__(self, **options):
        super().__init__(**options)
        self.code_generator_class = _BoundedJoins
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise_exception
        # Jinja's own tojson escapes HTML; templates expect plain JSON, as transformers gives them.
        self.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.filters = {name: self._sized(f, name) for name, f in self.filters.items()}

    def _range(self, *args):
        numbers = range(*args)
        if len(numbers) > self.LENGTH:
            raise TemplateLimit(f"range of {len(numbers)} numbers; at most {self.LENGTH}")
        return numbers

    def bounded(self, value):
        if isinstance(value, (str, list, tuple)) and len(value) > self.LENGTH:
            raise TemplateLimit(f"a string or list longer than {self.LENGTH}")
        return value

    def check_arguments(self, args, kwargs) -> None:
        """Widths, counts and indents beyond the output's length would only ask for memory."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.LENGTH:
                raise TemplateLimit(f"an argument of {value}; at most {self.LENGTH}")

    def check_format(self, text) -> None:
        if isinstance(text, str) and re.search(r"\d{7}", text):
            raise TemplateLimit(f"a format with a width or precision beyond {self.LENGTH}")

    def _sized(self, f, name):
        @functools.wraps(f)  # keeps the pass_context marks Jinja reads
        def sized(*args, **kwargs):
            self.check_arguments(args, kwargs)
            if name == "format":
                self.check_format(next((a for a in args if isinstance(a, str)), None))
            return self.bounded(f(*args, **kwargs))

        return sized

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (named as the sandbox names them)
        __self.check_arguments(args, kwargs)
        return __self.bounded(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):  # a template's str.format and str.format_map
        if getattr(value, "__name__", None) in ("format", "format_map"):
            self.check_format(getattr(value, "__self__", None))
        return super().wrap_str_format(value)

    def call_binop(self, context, operator, left, right):
        sizes = [len(v) for v in (left, right) if isinstance(v, (str, list, tuple))]
        counts = [v for v in (left, right) if isinstance(v, int)]
        if operator == "*" and sizes and counts and sizes[0] * counts[0] > self.LENGTH:
            raise TemplateLimit(f"a string or list longer than {self.LENGTH}")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateLimit(f"an exponent of {right}; at most 1024")
        if operator == "%":
            self.check_format(left)
        return self.bounded(super().call_binop(context, operator, left, right))

    def render(self, template: jinja2.Template, **variables) -> str:
        deadline = time.monotonic() + self.SECONDS

        def on_line(frame, event, arg):
            if time.monotonic() > deadline:
                raise TemplateLimit(f"took more than {self.SECONDS:g} s")
            return on_line

        def on_call(frame, event, arg):  # only the template's own code is traced, line by line
            return on_line if frame.f_code.co_filename == "<template>" else None

        previous, output, length = sys.gettrace(), [], 0
        sys.settrace(on_call)
        try:
            for chunk in template.generate(**variables):
                output.append(chunk)
                length += len(chunk)
                if length > self.LENGTH:
                    raise TemplateLimit(f"output longer than {self.LENGTH} characters")
        finally:
            sys.settrace(previous)
        return "".join(output)


class _BoundedJoins(jinja2.compiler.CodeGenerator):
    """The ~ operator joins strings in the compiled code, out of the sandbox's reach: its result is checked."""

    def visit_Concat(self, node, frame):
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _ids_only(spec):
    """A pre-tokenizer's description without trim_offsets, which changes the offsets of tokens, never their ids."""
    if isinstance(spec, dict):
        return {key: _ids_only(value) for key, value in spec.items() if key != "trim_offsets"}
    if isinstance(spec, list):
        return [_ids_only(value) for value in spec]
    return spec


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)):
        raise SmolError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                        f"not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SmolError(f"messages[{i}] must be a dict with 'role' and 'content', not {type(m).__name__}")
        for key in ("role", "content") if m.get("tool_calls") is None else ("role",):  # see check_tool_messages
            if not isinstance(m.get(key), str):
                raise SmolError(f"messages[{i}]: {key!r} must be a string, got {m.get(key)!r}")
