"""OpenAI's Responses API: POST /v1/responses, on the machinery chat completions run on (messages -> chat
template -> prompt ids -> scheduler), in its own shapes.

`input` is text or a list of message items (roles user, assistant, system, developer; content text or
input_text / output_text parts); `instructions` comes first as a system message, and is not kept for a later
turn (as OpenAI). An answer stored (`store`, the default) keeps its conversation, less instructions, for a later
request's `previous_response_id`: the last MAX_STORED, least recently used dropped first. Streamed, the answer is
the event sequence OpenAI sends, each event numbered by sequence_number. Function tools are not served yet: a
request with `tools` is a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import BaseModel, ConfigDict, Field

from ..generation.sampling import Sampling
from .scheduler import Delta, Done, Request, Scheduler
from .serving import APIError, AppState, Ask, EventStream, Served, Text, answers, content_text, grammar, sse, submit

MAX_STORED = 256  # conversations kept for previous_response_id
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}  # as the template
# knows them: a developer message is OpenAI's newer name for a system message
TEXT_PARTS = ("input_text", "output_text")  # what the client sends, and an earlier answer's parts sent back


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    format: dict = {"type": "text"}  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    input: Any  # text, or a list of message items: checked by conversation()
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    text: TextOptions = TextOptions()
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    tools: list = []
    metadata: dict[str, Text] = {}


def conversation(served: Served, body: ResponsesBody) -> list[dict]:
    """The chat so far, as chat messages: the stored conversation of previous_response_id, then the input's."""
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
        raise APIError(400, "input: must be text or a non-empty list of message items", param="input")
    messages = []
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be a message item {{'role': ..., 'content': ...}}", param=where)
        if item.get("type", "message") != "message":  # function_call, function_call_output: tools, not yet
            raise APIError(400, f"{where}.type: only message items are supported, got {item.get('type')!r}",
                           param=f"{where}.type")
        if item.get("role") not in ROLES:
            raise APIError(400, f"{where}.role: must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                           param=f"{where}.role")
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
    scheduler = served.scheduler(body.model)
    if body.tools:  # where function tools will plug in: rendered into the prompt, parsed out of the answer
        raise APIError(400, "tools: function tools are not supported on /v1/responses yet", param="tools")
    chat = conversation(served, body)
    system = [] if body.instructions is None else [dict(role="system", content=body.instructions)]
    prompt = served.tokenizer.apply_chat_template([*system, *chat], add_generation_prompt=True)
    response_format = body.text.format
    if response_format.get("type") == "json_schema":  # the Responses API's shape -> chat completions'
        response_format = {"type": "json_schema", "json_schema": response_format}
    ask = Ask([prompt], body.max_output_tokens, Sampling(temperature=body.temperature, top_p=body.top_p),
              grammar=await grammar(response_format, served.tokenizer, "text.format"))
    (request,) = submit(scheduler, ask)
    answer = Answer(body, served, chat, len(prompt))
    if body.stream:
        return EventStream(answer.stream(scheduler, request))
    texts, dones, _ = await answers(scheduler, [request], connection)
    return answer.finished(texts[0], dones[0])


class Answer:
    """One answer of /v1/responses in OpenAI's shapes: the response object, its one message item, the events
    of its stream. Once finished, its conversation is stored if the request asked."""

    def __init__(self, body: ResponsesBody, served: Served, chat: list[dict], prompt_tokens: int):
        self.body, self.served, self.chat, self.prompt_tokens = body, served, chat, prompt_tokens
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = time.time()
        self.sequence_number = 0  # the next event's

    def message(self, text: str | None, status: str) -> dict:
        """The answer's message item; text None: before its text part."""
        return dict(type="message", id=self.message_id, status=status, role="assistant",
                    content=[] if text is None else [self.part(text)])

    @staticmethod
    def part(text: str) -> dict:
        return dict(type="output_text", text=text, annotations=[], logprobs=[])

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
            top_p=body.top_p, text=dict(format=body.text.format), tools=[], tool_choice="auto",
            parallel_tool_calls=True, truncation="disabled", usage=usage)

    def finished(self, text: str, done: Done) -> dict:
        """The whole response; its conversation kept for a later previous_response_id if the request asked."""
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if self.body.store:
            remember(self.served, self.id, [*self.chat, dict(role="assistant", content=text)])
        return self.response(status, [self.message(text, status)], done)

    def event(self, kind: str, **fields) -> str:
        self.sequence_number += 1
        return sse(dict(type=kind, sequence_number=self.sequence_number - 1, **fields), event=kind)

    async def stream(self, scheduler: Scheduler, request: Request):
        where = dict(item_id=self.message_id, output_index=0, content_index=0)
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            yield self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress"))
            yield self.event("response.content_part.added", **where, part=self.part(""))
            text = []
            async for event in request.events():
                if isinstance(event, Delta):
                    if event.text:
                        text.append(event.text)
                        yield self.event("response.output_text.delta", **where, delta=event.text, logprobs=[])
                elif event.error:  # the status is already sent: the error can only travel in the stream
                    yield self.event("response.failed", response=self.response("failed", [], error=event.error))
                else:
                    text = "".join(text)
                    yield self.event("response.output_text.done", **where, text=text, logprobs=[])
                    yield self.event("response.content_part.done", **where, part=self.part(text))
                    response = self.finished(text, event)
                    yield self.event("response.output_item.done", output_index=0, item=response["output"][0])
                    yield self.event(f"response.{response['status']}", response=response)
        finally:  # no-op once done; frees the slot when the client went away mid-answer
            scheduler.cancel(request)
