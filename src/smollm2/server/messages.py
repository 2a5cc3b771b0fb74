"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, on the machinery chat completions run
on (messages -> chat template -> prompt ids -> a Request on the model's engine thread), in Anthropic's shapes.

`system` is a string or text blocks; each message's content a string or blocks: text, an assistant's tool_use
blocks (its calls) and a user's tool_result blocks (a tool's answer to one). A last assistant message of text is
a prefill: the answer continues it (its text is not repeated in the answer). `tools` and `tool_choice` are chat
completions' in Anthropic's shape (smollm2.tools.Tools): a call the answer makes is a tool_use block after its
text, if it wrote some. The answer ends with stop_reason end_turn (EOS), tool_use (EOS after calls), max_tokens,
or stop_sequence (then stop_sequence names it). Streamed, it is Anthropic's named events. Every error, on these
routes, is Anthropic's error body {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import collections
import json
import secrets
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi import Request as Connection
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ..errors import FieldError
from ..generation.grammar import Grammar
from ..generation.request import Names, Request
from ..generation.sampling import Sampling
from ..tools import CallPiece, ToolCall, Tools, check_call, renamed
from .scheduler import Done, EngineThread
from .serving import (APIError, AppState, EventStream, Served, Stops, Text, Writer, answers, as_api_error,
                      content_text, grammar, sse, stream, submit)

# An Anthropic tool keeps at its top what chat completions' keep under "function", its parameters' schema as
# input_schema; a tool_use block its arguments as input.
FIELDS = {".function.parameters": ".input_schema", ".function.arguments": ".input", ".function.": "."}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice's types, as chat completions' choices
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}  # any other: api_error


def error_body(e: APIError) -> dict:
    """Anthropic's error body; where the field is known, the message starts with it."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class AnthropicErrors(APIRoute):
    """A route whose errors, whatever raised them (the body's validation, the API key's check, the route itself),
    leave in Anthropic's shape rather than the app's (OpenAI's)."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def handle_in_anthropic_shape(connection: Connection):
            try:
                return await handle(connection)
            except Exception as e:
                error = as_api_error(e)
                return JSONResponse(error_body(error), error.status)

        return handle_in_anthropic_shape


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["user", "assistant"]
    content: Any  # a string, or a list of {"type": "text", "text": ...} blocks: checked by content_text


class CountBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Any = None  # a string, or text blocks
    tools: list = []  # checked by function_tools()
    tool_choice: dict | None = None  # {"type": "auto" | "any" | "tool" (with "name") | "none",
    # "disable_parallel_tool_use": bool}


class MessagesBody(CountBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: Stops | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False

    def to_request(self, prompt: list[int], thread: EngineThread, grammar: Grammar | None) -> Request:
        """The Request of this body, its conversation already through the chat template as `prompt`."""
        return Request(prompt, self.max_tokens, Sampling(temperature=self.temperature, top_p=self.top_p,
                                                         top_k=self.top_k),
                       stop=tuple(self.stop_sequences or ()), grammar=grammar, speculative=thread.speculation(None),
                       adapter=self.model, names=Names(prompt="messages", max_new_tokens="max_tokens",
                                                       stop="stop_sequences", entries=True))


def function_tools(body: CountBody) -> Tools | None:
    """The request's tools and tool_choice as chat completions' (smollm2.tools.Tools), or None without either;
    an error names the field as Anthropic's shape has it (tools.1.input_schema)."""
    if not body.tools and body.tool_choice is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise FieldError(f"tools.{i}.type", 'only client tools are served: {"name": ..., "input_schema": {...}}')
        tools.append({"type": "function", "function": {chat: tool[own] for chat, own in (
            ("name", "name"), ("description", "description"), ("parameters", "input_schema")) if own in tool}})
    choice = {"type": "auto"} if body.tool_choice is None else body.tool_choice
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise FieldError("tool_choice.disable_parallel_tool_use", "must be true or false")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if choice.get("type") == "tool":
        if not isinstance(choice.get("name"), str):
            raise FieldError("tool_choice.name", "must be the name of the tool to call")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice.get("type"), str) and choice["type"] in CHOICES:
        choice = CHOICES[choice["type"]]
    else:
        raise FieldError("tool_choice.type", f'must be "auto", "any", "tool" or "none", not {choice.get("type")!r:.80}')
    try:
        return Tools(tools, choice, parallel)
    except FieldError as e:
        raise renamed(e, FIELDS) from None


def conversation(body: CountBody) -> list[dict]:
    """The messages as chat messages: each one's text blocks joined; an assistant's tool_use blocks its
    tool_calls; each of a user's tool_result blocks a tool message of its own, ahead of the user's text."""
    chat, called = [], set()
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = message.content if isinstance(message.content, list) else []
        tool_kind = "tool_use" if message.role == "assistant" else "tool_result"
        text = content_text(message.content, where, others=(tool_kind,))
        tool_blocks = [(f"{where}.{j}", block) for j, block in enumerate(blocks) if block.get("type") == tool_kind]
        if message.role == "assistant":
            calls = [tool_call(block, at) for at, block in tool_blocks]
            called.update(call["id"] for call in calls)
            chat.append(dict(role="assistant", content=text, **(dict(tool_calls=calls) if calls else {})))
        else:
            chat += [tool_result(block, at, called) for at, block in tool_blocks]
            if text or not tool_blocks:  # a user's results alone make no turn of the user's own
                chat.append(dict(role="user", content=text))
    return chat


def tool_call(block: dict, where: str) -> dict:
    """A tool_use block as a chat's tool call."""
    if not isinstance(block.get("input"), dict):
        raise FieldError(f"{where}.input", "must be an object: the tool's input")
    call = {"id": block.get("id"), "type": "function",
            "function": {"name": block.get("name"), "arguments": json.dumps(block["input"], ensure_ascii=False)}}
    try:
        check_call(call, where)
    except FieldError as e:
        raise renamed(e, FIELDS) from None
    return call


def tool_result(block: dict, where: str, called: set[str]) -> dict:
    """A tool_result block as a chat's tool message; a result marked is_error says so ahead of its content, as
    SmolLM2's format has no mark of its own for a failed call."""
    if not isinstance(block.get("tool_use_id"), str) or block["tool_use_id"] not in called:
        raise FieldError(f"{where}.tool_use_id", f"must be the id of a tool_use before it, not "
                         f"{block.get('tool_use_id')!r:.80}")
    if not isinstance(block.get("is_error", False), bool):
        raise FieldError(f"{where}.is_error", "must be true or false")
    content = content_text(block.get("content", ""), f"{where}.content")
    return dict(role="tool", tool_call_id=block["tool_use_id"],
                content=f"Error: {content}" if block.get("is_error") else content)


def prompt_ids(served: Served, body: CountBody, tools: Tools | None) -> list[int]:
    """The prompt: the tools, the system text and the messages through the chat template; a last assistant
    message's text after the assistant's header, for the answer to continue."""
    chat = conversation(body)
    if body.system is not None:
        chat.insert(0, dict(role="system", content=content_text(body.system, "system")))
    if chat[-1]["role"] == "assistant" and chat[-1].get("tool_calls"):
        raise FieldError(f"messages.{len(body.messages) - 1}.content", "a tool_use must be answered by a "
                         "tool_result in a user message after it")
    prefill = chat.pop()["content"] if chat[-1]["role"] == "assistant" else ""
    if not prefill:
        return served.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tools=tools)
    text = served.tokenizer.render_chat(chat, add_generation_prompt=True, tools=tools) + prefill
    return served.tokenizer.backend.encode(text, add_special_tokens=False).ids


router = APIRouter(route_class=AnthropicErrors)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountBody, served: AppState):
    served.engine(body.model)
    return {"input_tokens": len(prompt_ids(served, body, function_tools(body)))}


@router.post("/v1/messages")
async def create_message(body: MessagesBody, connection: Connection, served: AppState):
    thread = served.engine(body.model)
    tools = function_tools(body)
    prompt = prompt_ids(served, body, tools)
    request = body.to_request(prompt, thread, await grammar(None, served.tokenizer, "tools", tools))
    generations = submit(served, [request])
    answer = Answer(body.model, len(prompt))
    if body.stream:
        return EventStream(stream(thread, generations, answer, tools))
    (whole,) = await answers(thread, generations, connection, tools)
    return answer.message(answer.content(whole.text, whole.calls), whole.done, whole.calls)


class Answer(Writer):
    """One answer of /v1/messages in Anthropic's shapes: the message (its text block, then its tool_use blocks),
    or the events of its stream."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex}", model, prompt_tokens
        self.ids = collections.defaultdict(lambda: f"toolu_{secrets.token_hex(12)}")  # each call's, by its call id
        self.blocks = 0  # streamed: the content blocks begun, the last one open

    def message(self, content: list[dict], done: Done | None = None, calls: list[ToolCall] = ()) -> dict:
        """The message object; done None: as it starts, before its end is known."""
        return dict(id=self.id, type="message", role="assistant", model=self.model, content=content,
                    **self.stop_reason(done, calls), usage=dict(input_tokens=self.prompt_tokens,
                                                        output_tokens=0 if done is None else done.completion_tokens))

    def content(self, text: str | None, calls: list[ToolCall]) -> list[dict]:
        """The content blocks: the text where the answer wrote some (or made no call), then its calls; a call cut
        short inside its arguments has input {}."""
        blocks = [{"type": "text", "text": text or ""}] if text or not calls else []
        return blocks + [self.tool_use(call, call.parsed_arguments() or {}) for call in calls]

    def tool_use(self, call: ToolCall, arguments: dict) -> dict:
        return {"type": "tool_use", "id": self.ids[call.id], "name": call.name, "input": arguments}

    @staticmethod
    def stop_reason(done: Done | None, calls: list[ToolCall] = ()) -> dict:
        """stop_reason and stop_sequence: EOS is the end of the model's turn, or of its calls."""
        if done is None:
            return dict(stop_reason=None, stop_sequence=None)
        if done.finish_reason == "length":
            return dict(stop_reason="max_tokens", stop_sequence=None)
        if done.stop_string is not None:
            return dict(stop_reason="stop_sequence", stop_sequence=done.stop_string)
        return dict(stop_reason="tool_use" if calls else "end_turn", stop_sequence=None)

    @staticmethod
    def event(kind: str, **fields) -> str:
        return sse(dict(type=kind, **fields), event=kind)

    def pieces(self, text: str, pieces: list[CallPiece]):
        """The events of a piece of the answer: its own text, into its text block (begun with its first text),
        and what it added to its calls (each call's block begun with its name). The grammar ends an answer with
        its calls: no text comes after them."""
        if text:
            if not self.blocks:
                yield from self.open({"type": "text", "text": ""})
            yield self.event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})
        for piece in pieces:
            if piece.first:
                yield from self.open(self.tool_use(piece.call, {}))
            if piece.arguments:
                yield self.event("content_block_delta", index=self.blocks - 1,
                                 delta={"type": "input_json_delta", "partial_json": piece.arguments})

    def open(self, block: dict):
        """The events that close the open block, if any, and begin this one."""
        if self.blocks:
            yield self.event("content_block_stop", index=self.blocks - 1)
        self.blocks += 1
        yield self.event("content_block_start", index=self.blocks - 1, content_block=block)

    # Streamed: the events of serving.stream's path.

    def begin(self):
        yield self.event("message_start", message=self.message([]))

    def piece(self, index, text, pieces, logprobs):
        return self.pieces(text, pieces)

    def finished(self, index, done, text, calls):
        yield from self.pieces(text, [])
        if not self.blocks:  # no text and no call: the text, empty
            yield from self.open({"type": "text", "text": ""})
        yield self.event("content_block_stop", index=self.blocks - 1)
        yield self.event("message_delta", delta=self.stop_reason(done, calls),
                         usage=dict(output_tokens=done.completion_tokens))
        yield self.event("message_stop")

    def failed(self, error):
        yield sse(error_body(APIError(503, error)), event="error")
