"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, on the machinery chat completions run
on (messages -> chat template -> prompt ids -> scheduler), in Anthropic's shapes.

`system` is a string or text blocks; each message's content a string or text blocks. A last assistant message is
a prefill: the answer continues it (its text is not repeated in the answer). The answer ends with stop_reason
end_turn (EOS), max_tokens, or stop_sequence (then stop_sequence names it). Streamed, it is Anthropic's named
events. Every error, on these routes, is Anthropic's error body {"type": "error", "error": {"type", "message"}}.
Tools are not served yet: a request with `tools` is a 400.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi import Request as Connection
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ..generation.sampling import Sampling
from .scheduler import Delta, Done, Request, Scheduler
from .serving import (APIError, AppState, Ask, EventStream, Served, Stops, Text, answers, as_api_error,
                      content_text, sse, submit)

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
    tools: list = []


class MessagesBody(CountBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: Stops | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


def prompt_ids(served: Served, body: CountBody) -> list[int]:
    """The prompt: the system text and the messages through the chat template; a last assistant message's text
    after the assistant's header, for the answer to continue."""
    if body.tools:  # where tools will plug in: rendered into the prompt, tool_use blocks parsed out of the answer
        raise APIError(400, "tools: tools are not supported on /v1/messages yet", param="tools")
    chat = [dict(role=m.role, content=content_text(m.content, f"messages.{i}.content"))
            for i, m in enumerate(body.messages)]
    if body.system is not None:
        chat.insert(0, dict(role="system", content=content_text(body.system, "system")))
    prefill = chat.pop()["content"] if chat[-1]["role"] == "assistant" else ""
    if not prefill:
        return served.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    return served.tokenizer.backend.encode(served.tokenizer.render_chat(chat, add_generation_prompt=True) + prefill,
                                           add_special_tokens=False).ids


router = APIRouter(route_class=AnthropicErrors)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountBody, served: AppState):
    served.scheduler(body.model)
    return {"input_tokens": len(prompt_ids(served, body))}


@router.post("/v1/messages")
async def create_message(body: MessagesBody, connection: Connection, served: AppState):
    scheduler = served.scheduler(body.model)
    prompt = prompt_ids(served, body)
    sampling = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    (request,) = submit(scheduler, Ask([prompt], body.max_tokens, sampling, stop=body.stop_sequences or []))
    answer = Answer(body.model, len(prompt))
    if body.stream:
        return EventStream(answer.stream(scheduler, request))
    texts, dones, _ = await answers(scheduler, [request], connection)
    return answer.message([{"type": "text", "text": texts[0]}], dones[0])


class Answer:
    """One answer of /v1/messages in Anthropic's shapes: the message, or the events of its stream."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex}", model, prompt_tokens

    def message(self, content: list[dict], done: Done | None = None) -> dict:
        """The message object; done None: as it starts, before its end is known."""
        return dict(id=self.id, type="message", role="assistant", model=self.model, content=content,
                    **self.end(done), usage=dict(input_tokens=self.prompt_tokens,
                                                 output_tokens=0 if done is None else done.completion_tokens))

    @staticmethod
    def end(done: Done | None) -> dict:
        """stop_reason and stop_sequence: EOS is the end of the model's turn."""
        if done is None:
            return dict(stop_reason=None, stop_sequence=None)
        if done.finish_reason == "length":
            return dict(stop_reason="max_tokens", stop_sequence=None)
        if done.stop_string is not None:
            return dict(stop_reason="stop_sequence", stop_sequence=done.stop_string)
        return dict(stop_reason="end_turn", stop_sequence=None)

    @staticmethod
    def event(kind: str, **fields) -> str:
        return sse(dict(type=kind, **fields), event=kind)

    async def stream(self, scheduler: Scheduler, request: Request):
        try:
            yield self.event("message_start", message=self.message([]))
            yield self.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            async for event in request.events():
                if isinstance(event, Delta):
                    if event.text:
                        yield self.event("content_block_delta", index=0, delta={"type": "text_delta",
                                                                                "text": event.text})
                elif event.error:  # the status is already sent: the error can only travel in the stream
                    yield sse(error_body(APIError(503, event.error)), event="error")
                else:
                    yield self.event("content_block_stop", index=0)
                    yield self.event("message_delta", delta=self.end(event),
                                     usage=dict(output_tokens=event.completion_tokens))
                    yield self.event("message_stop")
        finally:  # no-op once done; frees the slot when the client went away mid-answer
            scheduler.cancel(request)
