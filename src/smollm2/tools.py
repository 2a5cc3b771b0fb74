"""Tool calls: function tools offered to the model, and the calls it answers with, in SmolLM2's trained format.

    tools = Tools([{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],
                  choice="auto")                       # or "none", "required", or a function's name
    ids = tokenizer.apply_chat_template(messages, tools=tools)
    for steps in stream(model, [ids], tokenizer=tokenizer, tools=tools): ...   # calls fit the tools' schemas
    content, calls = parse_tool_calls(answer)          # the text around the calls; ToolCall(id, name, arguments)

SmolLM2-Instruct was trained to read the tools as JSON in its system prompt, between <tools> and </tools>, to
call them as a JSON list, <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>, and to read each
result back in a user turn, between <tool_response> and </tool_response>. A chat template that handles tools
itself (one that reads a `tools` variable) renders them its own way instead; the answer is read as above.

This module is the format alone; the grammar (Grammar.for_answer, generation/grammar.py, over call_schema) holds
every call to a tool's name and its parameters' schema: under "auto" the answer is free text until it writes
<tool_call>, then a list of calls and the end; under "required" or a named function it is that list from its
first token.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from .errors import FieldError
from .json_schema import check_schema

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
RESULT_BEGIN, RESULT_END = "<tool_response>", "</tool_response>"
MAX_TOOLS = 128  # as OpenAI; also the most calls one assistant message may carry
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_ID_CHARS = 256
CHOICES = ("auto", "none", "required")

# SmolLM2's function-calling system prompt, in our words; the tools' JSON goes between <tools> and </tools>.
SYSTEM_PROMPT = """You can call functions. Given a question and the functions below, make the function calls \
that achieve what it asks.
If none of the functions fits the question, say so. If the question lacks an argument a function needs, say so.
The functions:
<tools>{tools}</tools>
Write the calls in this format and nothing else, each argument of the type its function asks for:
<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>
If no call is needed, write an empty list: <tool_call>[]</tool_call>"""


class Tools:
    """Function tools in OpenAI's shape, checked, and how an answer may call them.

    tools: [{"type": "function", "function": {"name", "description" (optional), "parameters" (optional: a JSON
    schema of the arguments object)}}]. choice: OpenAI's tool_choice: "auto" (the default where there are tools:
    the model decides), "none" (no calls; the tools are not shown to the model), "required" (at least one call),
    or {"type": "function", "function": {"name": ...}} (calls to that function alone). parallel: more than one
    call in an answer. FieldError names what is wrong (tools.1.function.name)."""

    def __init__(self, tools: list[dict], choice: str | dict | None = None, parallel: bool = True):
        self.functions = check_tools(tools)  # name -> {"name", "description", "parameters"}
        # "auto", "none" or "required"; and the one function a named choice requires a call to, else None
        self.choice, self.named = check_choice(choice, self.functions)
        if not isinstance(parallel, bool):
            raise FieldError("parallel_tool_calls", f"must be true or false, not {parallel!r}")
        self.parallel = parallel
        if self.functions:  # each tool's schema is bounded; so is all they make together
            check_schema(self.call_schema(), "tools")

    @property
    def offered(self) -> bool:
        """Whether the model sees the tools and may call them."""
        return self.choice != "none"

    def openai(self) -> list[dict]:
        """The tools as OpenAI's request lists them (and chat templates expect them)."""
        return [{"type": "function", "function": function} for function in self.functions.values()]

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(tools=json.dumps(self.openai(), ensure_ascii=False))

    def call_schema(self) -> dict:
        """The JSON schema of the list an answer's calls are written as: objects whose name is a tool's (the
        chosen one's, for a named choice) and whose arguments fit that tool's parameters."""
        names = [self.named] if self.named else list(self.functions)
        calls = [{"type": "object", "required": ["name", "arguments"],
                  "properties": {"name": {"const": name}, "arguments": self.functions[name]["parameters"]}}
                 for name in names]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if self.choice == "required":  # "auto" may write [] for no call, as the system prompt says
            schema["minItems"] = 1
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def check_tools(tools) -> dict[str, dict]:
    if not isinstance(tools, list):
        raise FieldError("tools", f"must be a list of function tools, not {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    functions = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f"{where}.type", 'only {"type": "function", "function": {...}} tools are supported')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise FieldError(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name", f"must be 1 to 64 letters, digits, _ or -, not {name!r:.80}")
        if name in functions:
            raise FieldError(f"{where}.function.name", f"{name!r} names two tools")
        if not isinstance(function.get("description", ""), str):
            raise FieldError(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise FieldError(f"{where}.function.parameters", 'must be a JSON schema of {"type": "object"}')
        check_schema(parameters, f"{where}.function.parameters")
        functions[name] = {key: function[key] for key in ("name", "description") if key in function}
        functions[name]["parameters"] = parameters
    return functions


def check_choice(choice, functions: dict) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = choice["function"].get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise FieldError("tool_choice", 'a named function is {"type": "function", "function": {"name": ...}}')
        if name not in functions:
            raise FieldError("tool_choice", f"no tool is named {name!r:.80}")
        return "required", name
    if choice not in CHOICES:
        raise FieldError("tool_choice", f'must be "auto", "none", "required" or a named function, not {choice!r:.80}')
    if choice != "none" and not functions:
        raise FieldError("tool_choice", "asks for tool calls, but there are no tools")
    return choice, None


def check_tool_messages(messages: list[dict]) -> None:
    """The tool parts of a chat whose roles are known to be strings: each assistant's tool_calls well formed
    (its content then a string or None); each tool message's tool_call_id that of a call made before it."""
    called = set()
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            if message["role"] != "assistant":
                raise FieldError(f"messages.{i}.tool_calls", "only an assistant's message makes tool calls")
            if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
                raise FieldError(f"messages.{i}.tool_calls", f"must be a list of at most {MAX_TOOLS} calls")
            if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
                raise FieldError(f"messages.{i}.content", "must be a string, or null beside tool calls")
            for j, call in enumerate(calls):
                called.add(check_call(call, f"messages.{i}.tool_calls.{j}"))
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise FieldError(f"messages.{i}.tool_call_id", "must be the id of a tool call made before it, "
                             f"not {message.get('tool_call_id')!r:.80}")


def check_call(call, where: str) -> str:
    """An assistant's tool call, {"id", "type": "function", "function": {"name", "arguments": JSON text}}: its id."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("function"), dict):
        raise FieldError(where, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    if not isinstance(call.get("id"), str) or not 0 < len(call["id"]) <= MAX_ID_CHARS:
        raise FieldError(f"{where}.id", f"must be a string of 1 to {MAX_ID_CHARS} characters")
    if not isinstance(call["function"].get("name"), str):
        raise FieldError(f"{where}.function.name", "must be a string")
    arguments = call["function"].get("arguments")
    try:
        if not isinstance(json.loads(arguments), dict):
            raise ValueError
    except (TypeError, ValueError, RecursionError):
        raise FieldError(f"{where}.function.arguments", "must be a JSON object, as text") from None
    return call["id"]


def renamed(error: FieldError, names: dict[str, str]) -> FieldError:
    """A FieldError about tools or calls in chat completions' shape, its field named as another API's shape names
    it: `names` maps each part of the chat's field to the other's (".function.parameters" -> ".input_schema")."""
    field = error.field
    for chat, own in names.items():
        field = field.replace(chat, own)
    return FieldError(field, str(error).removeprefix(f"{error.field}: "))


def trained_format(messages: list[dict], tools: Tools | None) -> list[dict]:
    """A chat with tools, calls and results as messages of role and content alone, the way SmolLM2 reads them:
    the tools in the system prompt (before the caller's own system message), each assistant's calls after its
    text as <tool_call>[...]</tool_call>, each result a user turn of its own between <tool_response> tags."""
    plain = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                     for call in message["tool_calls"]]
            message = {"role": message["role"], "content": (message.get("content") or "") + CALL_BEGIN
                       + json.dumps(calls, ensure_ascii=False) + CALL_END}
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"{RESULT_BEGIN}\n{message['content']}\n{RESULT_END}"}
        plain.append(message)
    if tools is not None and tools.offered:
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": tools.system_prompt() + "\n\n" + plain[0]["content"]}
        else:
            plain.insert(0, {"role": "system", "content": tools.system_prompt()})
    return plain


def template_format(messages: list[dict]) -> list[dict]:
    """A chat for a template that writes tool calls itself: the calls' arguments as objects, not JSON text, as
    transformers' chat templates take them."""
    return [{**m, "tool_calls": [{**call, "function": {**call["function"],
                                                        "arguments": json.loads(call["function"]["arguments"])}}
                                 for call in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


@dataclass
class ToolCall:
    """One call an answer makes: arguments are the JSON text of its arguments object, as the model wrote it
    (cut short where the answer was)."""
    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def parsed_arguments(self) -> dict | None:
        """The arguments as an object; None where the answer was cut short inside them."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return None


@dataclass(frozen=True)
class CallPiece:
    """What a piece of an answer added to its call number `index`: the call itself, where `first` (its id and
    name are new), and more of its arguments' text."""
    index: int
    call: ToolCall
    first: bool
    arguments: str


class ToolCallParser:
    """Splits an answer into its own text and its calls as the answer grows, for streaming: feed() each new
    piece of text, then finish(). Text that may yet turn into <tool_call> is held back until it cannot; a call
    is known once its name is complete, and its arguments' text comes as it is written."""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._held = ""  # the answer's own text, not yet given out: it may end with the start of <tool_call>
        self._block: _CallBlock | None = None  # inside <tool_call>

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The answer's own text now final, and what the new text added to the calls."""
        content, pieces = "", []
        while text:
            if self._block is not None:
                text = self._block.feed(text, pieces)
                if text is None:  # still inside the block
                    break
                self._block = None
                continue
            self._held += text
            start = self._held.find(CALL_BEGIN)
            if start < 0:
                keep = next((n for n in range(min(len(self._held), len(CALL_BEGIN) - 1), 0, -1)
                             if CALL_BEGIN.startswith(self._held[-n:])), 0)
                content += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                break
            content += self._held[:start]
            text, self._held = self._held[start + len(CALL_BEGIN):], ""
            self._block = _CallBlock(self.calls)
        return content, pieces

    def finish(self) -> str:
        """The answer's own text still held back, where the answer ended."""
        held, self._held = self._held, ""
        return held


class _CallBlock:
    """One <tool_call> block: a JSON list of {"name", "arguments"} objects (or one such object), then
    </tool_call>. Read a character at a time, tracking strings, nesting and keys, so that no text is read twice
    however the answer is cut into pieces."""

    def __init__(self, calls: list[ToolCall]):
        self.calls, self.text = calls, ""  # the JSON read so far
        self.depth, self.call_depth = 0, None  # call_depth: where a call's keys are (2 in a list, 1 alone)
        self.string_start, self.escaped = None, False  # where the string being read starts
        self.key, self.expect_key = None, False  # the call's key being read, or whose value is
        self.call, self.args_start, self.args_end, self.args_open = None, None, 0, False
        self.sent = 0  # the arguments' text given out, up to here
        self.closing = None  # after the JSON: the characters of </tool_call> matched

    def feed(self, text: str, pieces: list[CallPiece]) -> str | None:
        """Read text; returns what follows </tool_call> (the answer's own text again), None while inside."""
        for k, c in enumerate(text):
            if self.closing is not None:
                if c == CALL_END[self.closing]:
                    self.closing += 1
                    if self.closing == len(CALL_END):
                        return text[k + 1:]
                elif not (c.isspace() and self.closing == 0):  # no closing tag: the rest is text
                    return CALL_END[:self.closing] + text[k:]
                continue
            self.read(c, pieces)
        self.send(pieces)
        return None

    def read(self, c: str, pieces: list[CallPiece]) -> None:
        i = len(self.text)
        self.text += c
        if self.string_start is not None:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                if self.depth == self.call_depth:
                    self.string(json.loads(self.text[self.string_start:]), pieces)
                self.string_start = None
        elif c == '"':
            self.string_start = i
        elif c in "[{":
            if self.depth == 0:
                self.call_depth = 2 if c == "[" else 1
            if c == "{" and self.depth == self.call_depth and self.key == "arguments" and not self.expect_key:
                self.args_start, self.args_open = i, True
            self.depth += 1
            if c == "{" and self.depth == self.call_depth:  # a call begins
                self.call, self.key, self.expect_key, self.args_start = None, None, True, None
        elif c in "]}":
            self.depth -= 1
            if self.depth == self.call_depth and self.args_open:
                self.args_open, self.args_end = False, i + 1
            elif c == "}" and self.depth == self.call_depth - 1:
                self.end_call(pieces)
            if self.depth == 0:
                self.closing = 0
        elif self.depth == self.call_depth and c == ":":
            self.expect_key = False
        elif self.depth == self.call_depth and c == ",":
            self.key, self.expect_key = None, True
        if self.args_open:
            self.args_end = i + 1

    def string(self, value: str, pieces: list[CallPiece]) -> None:
        if self.expect_key:
            self.key = value
        elif self.key == "name" and self.call is None:
            self.call = ToolCall(value)
            self.calls.append(self.call)
            add(pieces, CallPiece(len(self.calls) - 1, self.call, True, ""))
            self.send(pieces)

    def end_call(self, pieces: list[CallPiece]) -> None:
        if self.call is not None and self.args_start is None:  # no arguments: an empty object
            self.call.arguments = "{}"
            add(pieces, CallPiece(len(self.calls) - 1, self.call, False, "{}"))
        self.send(pieces)
        self.call = None

    def send(self, pieces: list[CallPiece]) -> None:
        """Give out the arguments' text written since the last time."""
        if self.call is not None and self.args_start is not None and self.args_end > self.sent:
            new = self.text[max(self.sent, self.args_start):self.args_end]
            self.call.arguments += new
            self.sent = self.args_end
            add(pieces, CallPiece(len(self.calls) - 1, self.call, False, new))


def add(pieces: list[CallPiece], piece: CallPiece) -> None:
    """One piece per call for each piece of text: a call's new arguments join its piece already there."""
    last = pieces[-1] if pieces else None
    if last is not None and last.call is piece.call:
        pieces[-1] = CallPiece(last.index, last.call, last.first, last.arguments + piece.arguments)
    else:
        pieces.append(piece)


def parse_tool_calls(answer: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's text outside its calls (None if empty) and its calls, as streaming them would give."""
    parser = ToolCallParser()
    content, _ = parser.feed(answer)
    content += parser.finish()
    return content or None, parser.calls
