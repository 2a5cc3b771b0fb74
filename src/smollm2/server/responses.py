"""OpenAI's Responses API: POST /v1/responses, on the machinery chat completions run on (messages -> chat
template -> prompt ids -> a Request on the model's engine thread), in its own shapes.

`input` is text or a list of items: messages (roles user, assistant, system, developer; content text or
input_text / output_text parts), an answer's function_call items and the function_call_output items that answer
them; `instructions` comes first as a system message, and is not kept for a later turn (as OpenAI). Function
`tools` and `tool_choice` are chat completions' in this API's shape (smollm2.tools.Tools): a call the answer
makes is a function_call output item after its message, if it wrote text. An answer stored (`store`, the default)
keeps its conversation, calls included, less instructions, for a later request's `previous_response_id`: the
last MAX_STORED, least recently used dropped first. Streamed, the answer is the event sequence OpenAI sends, each
event numbered by sequence_number.
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import BaseModel, ConfigDict, Field

from ..errors import FieldError
from ..generation.grammar import Grammar
from ..generation.request import Names, Request
from ..generation.sampling import Sampling
from ..tools import MAX_TOOLS, CallPiece, ToolCall, Tools, check_call, renamed
from .scheduler import Done, EngineThread
from .serving import (APIError, AppState, EventStream, Served, Text, Writer, answers, content_text, grammar, sse,
                      stream, submit)

MAX_STORED = 256  # conversations kept for previous_response_id
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}  # as the template
# knows them: a developer message is OpenAI's newer name for a system message
TEXT_PARTS = ("input_text", "output_text")  # what the client sends, and an earlier answer's parts sent back
# A function tool and a function_call item keep at their top what chat completions' keep under "function"; a
# call's id is its call_id.
FIELDS = {".function.": ".", ".id": ".call_id"}


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    format: dict = {"type": "text"}  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    input: Any  # text, or a list of items: checked by conversation()
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    text: TextOptions = TextOptions()
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    tools: list = []  # function tools: checked by function_tools()
    tool_choice: str | dict | None = None  # "auto" (the default with tools), "none", "required", or a function
    parallel_tool_calls: bool = True
    metadata: dict[str, Text] = {}

    def to_request(self, prompt: list[int], thread: EngineThread, grammar: Grammar | None) -> Request:
        """The Request of this body, its conversation already through the chat template as `prompt`."""
        return Request(prompt, self.max_output_tokens, Sampling(temperature=self.temperature, top_p=self.top_p),
                       grammar=grammar, speculative=thread.speculation(None), adapter=self.model,
                       names=Names(prompt="input", max_new_tokens="max_output_tokens", entries=True))


def function_tools(body: ResponsesBody) -> Tools | None:
    """The request's tools and tool_choice as chat completions' (smollm2.tools.Tools), or None without either;
    an error names the field as this API's shape has it (tools.1.name)."""
    if not body.tools and body.tool_choice is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f"tools.{i}.type", 'only function tools are served: {"type": "function", "name": ..., '
                             '"parameters": {...}}')
        if not isinstance(tool.get("strict"), bool | None):
            raise FieldError(f"tools.{i}.strict", "must be true or false")  # calls always fit the schema
        tools.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                       if tool.get(key) is not None}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise FieldError("tool_choice", 'a named function is {"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    try:
        return Tools(tools, choice, body.parallel_tool_calls)
    except FieldError as e:
        raise renamed(e, FIELDS) from None


def conversation(served: Served, body: ResponsesBody) -> list[dict]:
    """The chat so far, as chat messages: the stored conversation of previous_response_id, then the input's. A
    function_call item is a tool call of the assistant's message before it (or of one of its own); a
    function_call_output item, the tool message answering a call made before it."""
    history = []
    if body.previous_response_id is not None:
        history = served.responses.get(body.previous_response_id)
        if history is None:
            raise APIError(400, f"previous_response_id: no stored response {body.previous_response_id!r} (this "
                           f"server keeps the last {MAX_STORED} answered with store: true)",
                           param="previous_response_id", code="previous_response_not_found")
        served.responses.move_to_end(body.previous_response_id)
    if isinstance(body.input, str):
        return [*history, dict(role="user", content=content_text(body.input, "input"))]
    if not isinstance(body.input, list) or not body.input:
        raise APIError(400, "input: must be text or a non-empty list of items", param="input")
    called = {call["id"] for message in history for call in message.get("tool_calls", ())}
    messages = []
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an item {{'role': ..., 'content': ...}}", param=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            try:
                called.add(check_call(call, where))
            except FieldError as e:
                raise renamed(e, FIELDS) from None
            if messages and messages[-1]["role"] == "assistant":
                if len(messages[-1].setdefault("tool_calls", [])) == MAX_TOOLS:
                    raise APIError(400, f"{where}: more than {MAX_TOOLS} function calls in one answer", param=where)
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append(dict(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or item["call_id"] not in called:
                raise APIError(400, f"{where}.call_id: must be the call_id of a function_call before it, not "
                               f"{item.get('call_id')!r:.80}", param=f"{where}.call_id")
            messages.append(dict(role="tool", tool_call_id=item["call_id"],
                                 content=content_text(item.get("output"), f"{where}.output", TEXT_PARTS)))
        elif kind != "message":
            raise APIError(400, f"{where}.type: must be message, function_call or function_call_output, got "
                           f"{kind!r:.80}", param=f"{where}.type")
        elif not isinstance(item.get("role"), str) or item["role"] not in ROLES:
            raise APIError(400, f"{where}.role: must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                           param=f"{where}.role")
        else:
            messages.append(dict(role=ROLES[item["role"]],
                                 content=content_text(item.get("content"), f"{where}.content", TEXT_PARTS)))
    return [*history, *messages]


def remember(served: Served, response_id: str, chat: list[dict]) -> None:
    served.responses[response_id] = chat
    while len(served.responses) > MAX_STORED:
        served.responses.popitem(last=False)


router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesBody, connection: Connection, served: AppState):
    thread = served.engine(body.model)
    tools = function_tools(body)
    chat = conversation(served, body)
    system = [] if body.instructions is None else [dict(role="system", content=body.instructions)]
    prompt = served.tokenizer.apply_chat_template([*system, *chat], add_generation_prompt=True, tools=tools)
    response_format = body.text.format
    if response_format.get("type") == "json_schema":  # the Responses API's shape -> chat completions'
        response_format = {"type": "json_schema", "json_schema": response_format}
    request = body.to_request(prompt, thread, await grammar(response_format, served.tokenizer, "text.format", tools))
    generations = submit(served, [request])
    answer = Answer(body, served, chat)
    if body.stream:
        return EventStream(stream(thread, generations, answer, tools))
    (whole,) = await answers(thread, generations, connection, tools)
    return answer.finished_response(whole.text, whole.calls, whole.done)


class Answer(Writer):
    """One answer of /v1/responses in OpenAI's shapes: the response object, its output items (its message, then
    its function calls), the events of its stream. Once finished, its conversation is stored if the request
    asked."""

    def __init__(self, body: ResponsesBody, served: Served, chat: list[dict]):
        self.body, self.served, self.chat = body, served, chat
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.item_ids = collections.defaultdict(lambda: f"fc_{uuid.uuid4().hex}")  # each call's item's, by call id
        self.created = time.time()
        self.sequence_number = 0  # the next event's
        self.text: list[str] = []  # streamed: the message's text so far
        self.begun: list[ToolCall | None] = []  # streamed: the output items begun, the message as None

    def message(self, text: str | None, status: str) -> dict:
        """The answer's message item; text None: before its text part."""
        return dict(type="message", id=self.message_id, status=status, role="assistant",
                    content=[] if text is None else [self.part(text)])

    @staticmethod
    def part(text: str) -> dict:
        return dict(type="output_text", text=text, annotations=[], logprobs=[])

    def call_item(self, call: ToolCall, status: str, arguments: str | None = None) -> dict:
        """A call's function_call item; arguments: as far as written (all of them, by default)."""
        return dict(type="function_call", id=self.item_ids[call.id], call_id=call.id, name=call.name,
                    arguments=call.arguments if arguments is None else arguments, status=status)

    def output(self, content: str | None, calls: list[ToolCall], status: str) -> list[dict]:
        """The output items: the message where the answer wrote text (or made no call), then its calls; each
        completed but the last, which has the answer's status."""
        items = [self.message(content or "", "completed")] if content or not calls else []
        items += [self.call_item(call, "completed") for call in calls]
        items[-1]["status"] = status
        return items

    def response(self, status: str, output: list[dict], done: Done | None = None, error: str | None = None) -> dict:
        body = self.body
        usage = None if done is None else dict(
            input_tokens=done.prompt_tokens, input_tokens_details=dict(cached_tokens=0),
            output_tokens=done.completion_tokens, output_tokens_details=dict(reasoning_tokens=0),
            total_tokens=done.prompt_tokens + done.completion_tokens)
        return dict(
            id=self.id, object="response", created_at=self.created, status=status, model=body.model, output=output,
            error=None if error is None else dict(code="server_error", message=error),
            incomplete_details=dict(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, metadata=body.metadata,
            previous_response_id=body.previous_response_id, store=body.store, temperature=body.temperature,
            top_p=body.top_p, text=dict(format=body.text.format), tools=body.tools,
            tool_choice="auto" if body.tool_choice is None else body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls, truncation="disabled", usage=usage)

    def finished_response(self, content: str | None, calls: list[ToolCall], done: Done) -> dict:
        """The whole response, of the answer's text outside its calls and its calls; its conversation kept for a
        later previous_response_id if the request asked."""
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if self.body.store:  # a call cut short inside its arguments is not one to answer
            made = [call.openai() for call in calls if call.parsed_arguments() is not None]
            said = dict(role="assistant", content=content or "", **(dict(tool_calls=made) if made else {}))
            remember(self.served, self.id, [*self.chat, said])
        return self.response(status, self.output(content, calls, status), done)

    def event(self, kind: str, **fields) -> str:
        self.sequence_number += 1
        return sse(dict(type=kind, sequence_number=self.sequence_number - 1, **fields), event=kind)

    def pieces(self, content: str, pieces: list[CallPiece]):
        """The events of a piece of the answer: its own text, into its message (begun with its first text), and
        what it added to its calls (each call's item begun with its name). The grammar ends an answer with its
        calls: no text comes after them."""
        if content:
            if not self.begun:
                yield from self.open(None, self.message(None, "in_progress"))
            self.text.append(content)
            yield self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                             delta=content, logprobs=[])
        for piece in pieces:
            if piece.first:
                if self.begun:
                    last = self.begun[-1]
                    yield from self.close(self.message("".join(self.text), "completed") if last is None
                                          else self.call_item(last, "completed"))
                yield from self.open(piece.call, self.call_item(piece.call, "in_progress", arguments=""))
            if piece.arguments:
                yield self.event("response.function_call_arguments.delta", item_id=self.item_ids[piece.call.id],
                                 output_index=len(self.begun) - 1, delta=piece.arguments)

    def open(self, call: ToolCall | None, item: dict):
        self.begun.append(call)
        yield self.event("response.output_item.added", output_index=len(self.begun) - 1, item=item)
        if call is None:
            yield self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                             content_index=0, part=self.part(""))

    def close(self, item: dict):
        """The events that close the last item begun, as it ends."""
        index = len(self.begun) - 1
        if item["type"] == "message":
            where = dict(item_id=item["id"], output_index=index, content_index=0)
            yield self.event("response.output_text.done", **where, text=item["content"][0]["text"], logprobs=[])
            yield self.event("response.content_part.done", **where, part=item["content"][0])
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)

    # Streamed: the events of serving.stream's path.

    def begin(self):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))

    def piece(self, index, text, pieces, logprobs):
        return self.pieces(text, pieces)

    def finished(self, index, done, text, calls):
        yield from self.pieces(text, [])
        response = self.finished_response("".join(self.text) or None, calls, done)
        if not self.begun:  # no text and no call: the message, empty
            yield from self.open(None, self.message(None, "in_progress"))
        yield from self.close(response["output"][-1])
        yield self.event(f"response.{response['status']}", response=response)

    def failed(self, error):
        yield self.event("response.failed", response=self.response("failed", [], error=error))
