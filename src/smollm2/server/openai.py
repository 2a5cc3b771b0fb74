"""OpenAI's chat completions and completions: POST /v1/chat/completions and /v1/completions, and GET /v1/models.

Each body becomes one generation.request.Request (its to_request method), answered n times (choice i seeded
seed + i), a prompt of /v1/completions' list each in turn; the answer is OpenAI's response object, or its chunks
as server-sent events ending with `data: [DONE]`, along the one streaming path every API shares (serving.stream).
Beyond OpenAI's own fields, vLLM's `stop_token_ids` and `min_tokens`, response_format types "choice" and "regex"
(see grammar.py), and ours: `speculative` and `steering`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from ..errors import FieldError, SmolError
from ..generation.grammar import Grammar
from ..generation.hooks import Hooks
from ..generation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ..generation.request import Names, Request
from ..generation.sampling import MAX_BIAS, MAX_PENALTY, MAX_SEED, Sampling
from ..tools import CallPiece, ToolCall, Tools
from . import inspect
from .scheduler import EngineThread, Generation
from .serving import (APIError, AppState, EventStream, Served, Stops, Text, Whole, Writer, answers, content_text,
                      grammar, sse, stream, submit, text_or_ids)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat answers may run to the context window
MAX_N = 8  # choices per prompt: each is a request of its own in the batch
MAX_PROMPTS = 16  # prompts per /v1/completions request
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries: each is applied to its row's logits at every step

# A token id as a JSON object's key, which is a string: "1234" is token 1234 (and "1234.0" or " 1234" none).
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$"), AfterValidator(int)]


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts: checked by content_text
    tool_calls: Any = None  # an assistant's: checked with the chat (smollm2.tools.check_tool_messages)
    tool_call_id: Text | None = None  # a tool's: the call it answers

    def chat(self, i: int) -> dict:
        """The message as the tokenizer takes it; content None only for an assistant's that makes tool calls."""
        message = dict(role=self.role, content=None if self.content is None and self.tool_calls
                       else content_text(self.content, f"messages.{i}.content"))
        for key in ("tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Body(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Stops | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choice i samples with seed + i
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema" | "choice" | "regex",
    # ...}: see grammar.py
    speculative: Literal["ngram", "draft", "off"] | None = None  # our extension: None is the server's --speculative
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = \
        Field(None, max_length=MAX_LOGIT_BIAS)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = Field(0, ge=0)
    steering: inspect.Steering | None = None  # our extension: a vector added to this request's residual stream
    steer: list[inspect.FeatureSteering] = Field([], max_length=inspect.MAX_FEATURE_STEERS)  # ours: by SAE features

    def _request(self, prompt: list[int], thread: EngineThread, max_tokens: int | None, names: Names,
                 prepared: Prepared) -> Request:
        return Request(prompt, max_tokens, Sampling(
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias, min_new_tokens=self.min_tokens),
            stop=(*self.stop_token_ids, *(self.stop or [])), logprobs=prepared.logprobs,
            prompt_logprobs=prepared.prompt_logprobs, grammar=prepared.grammar,
            speculative=thread.speculation(self.speculative), hooks=prepared.hooks, adapter=self.model,
            names=dataclasses.replace(names, min_new_tokens="min_tokens", stop="stop_token_ids", entries=True))


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs
    tools: list | None = None  # OpenAI's function tools, checked by smollm2.tools.Tools
    tool_choice: str | dict | None = None  # "auto" (the default with tools), "none", "required", or a function
    parallel_tool_calls: bool = True

    @property
    def logprobs_top(self) -> int | None:
        """None, or how many top tokens each generated token's log-probabilities list."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_request(self, prompt: list[int], thread: EngineThread, prepared: Prepared) -> Request:
        """The Request of this chat, its messages (and tools) already through the chat template as `prompt`."""
        limit = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return self._request(prompt, thread, self.max_completion_tokens or self.max_tokens,
                             Names(prompt="messages", max_new_tokens=limit), prepared)


class CompletionBody(Body):
    # Each text or token ids; a list of them is a batch: each prompt's choices in turn.
    prompt: Annotated[list[str | list[int]], BeforeValidator(lambda prompt: text_or_ids(prompt, MAX_PROMPTS))]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (echo with logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI allows up to 5; we, as many as chat
    echo: bool = False

    def to_request(self, prompt: list[int], where: str, thread: EngineThread, prepared: Prepared) -> Request:
        """The Request of one of this body's prompts, as ids; where: the field it came in (prompt, prompt.1)."""
        max_tokens = COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self._request(prompt, thread, max_tokens, Names(prompt=where, max_new_tokens="max_tokens"), prepared)


@dataclasses.dataclass
class Prepared:
    """What a body asks of each of its requests beside its fields, made ready by the route (compiled, computed on
    the engine thread): the grammar its answers fit, its steering hooks, its log-probabilities."""
    grammar: Grammar | None
    hooks: Hooks | None
    logprobs: int | None
    prompt_logprobs: int | None


router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, connection: Connection, served: AppState):
    thread = served.engine(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs to be true", param="top_logprobs")
    tools = None
    if body.tools is not None or body.tool_choice is not None:
        tools = Tools(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    messages = [m.chat(i) for i, m in enumerate(body.messages)]
    try:
        prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except FieldError:
        raise  # it names its own field (messages.1.tool_call_id)
    except SmolError as e:  # the template refused these messages, or rendering them ran past its bounds
        raise FieldError("messages", str(e)) from None
    check_n(1, body.n, thread)
    ready = await prepare(body, served, thread, connection, body.logprobs_top, echo=False, tools=tools)
    generations = submit(served, [body.to_request(prompt, thread, ready)], body.n)
    reply = ChatReply(body.model, served.tokenizer, [prompt], body.n, body.logprobs_top, tools)
    return await respond(body, thread, generations, reply, connection, tools)


@router.post("/v1/completions")
async def completions(body: CompletionBody, connection: Connection, served: AppState):
    thread, tokenizer = served.engine(body.model), served.tokenizer
    prompts = [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt for prompt in body.prompt]
    check_n(len(prompts), body.n, thread)
    ready = await prepare(body, served, thread, connection, body.logprobs, echo=body.echo)
    requests = [body.to_request(prompt, "prompt" if len(prompts) == 1 else f"prompt.{p}", thread, ready)
                for p, prompt in enumerate(prompts)]
    generations = submit(served, requests, body.n)
    echo = None  # the prompts' ids are checked by now (submit): they decode
    if body.echo:
        echo = [prompt if isinstance(prompt, str) else tokenizer.decode(prompt) for prompt in body.prompt]
    reply = CompletionReply(body.model, tokenizer, prompts, body.n, body.logprobs, echo)
    return await respond(body, thread, generations, reply, connection)


def check_n(prompts: int, n: int, thread: EngineThread) -> None:
    if prompts * n > thread.max_waiting:  # it could never be queued whole
        raise APIError(400, f"n: {prompts} prompt(s) x n={n} choices is {prompts * n} requests, more than this "
                       f"server queues ({thread.max_waiting})", param="n")


async def prepare(body: Body, served: Served, thread: EngineThread, connection: Connection, logprobs: int | None,
                  echo: bool, tools: Tools | None = None) -> Prepared:
    """What the body's requests share beyond its fields: its grammar compiled, its steering's hooks made."""
    return Prepared(await grammar(body.response_format, served.tokenizer, "response_format", tools),
                    await inspect.steering_hooks(body.steering, thread, served.tokenizer, body.steer, connection),
                    logprobs, logprobs if echo else None)


async def respond(body: Body, thread: EngineThread, generations: list[Generation], reply: Reply,
                  connection: Connection, tools: Tools | None = None):
    """Every prompt's n choices (submit: choice p * n + i, prompt p's choice i, seeded seed + i), whole or
    streamed."""
    if body.stream:
        reply.include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(stream(thread, generations, reply, tools))
    return reply.whole(await answers(thread, generations, connection, tools))


class Reply(Writer):
    """What OpenAI's chat and completion replies share (as vLLM's serving_chat and serving_completion do): the
    object's id, time and model, the usage, and a stream's error and end. Each writes its own choices and chunks.
    prompts: each prompt's ids, choice c answering prompt c // n; logprobs: None, or the number of top tokens each
    token's log-probabilities list."""
    object: str  # the whole answer's
    chunk_object: str  # a streamed chunk's
    id_prefix: str

    def __init__(self, model_name: str, tokenizer, prompts: list[list[int]], n: int, logprobs: int | None = None):
        self.model, self.tokenizer, self.prompts, self.n, self.logprobs = model_name, tokenizer, prompts, n, logprobs
        self.include_usage = False  # streamed: a last chunk with the usage (stream_options.include_usage)
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return dict(id=self.id, object=kind, created=self.created, model=self.model, choices=choices, **extra)

    def usage(self, dones) -> dict:
        """Each prompt counted once, however many choices."""
        prompt = sum(map(len, self.prompts))
        completion = sum(done.completion_tokens for done in dones)
        return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def whole(self, answers: list[Whole]) -> dict:
        """The whole answer: each choice's (serving.answers)."""
        return self._object(self.object, [self.choice(i, answer) for i, answer in enumerate(answers)],
                            usage=self.usage([answer.done for answer in answers]))

    def choice(self, index: int, answer: Whole) -> dict:
        raise NotImplementedError

    # Streamed: the chunks of serving.stream's path.

    def failed(self, error):
        yield sse({"error": dict(message=error, type="server_error", param=None, code=None)})

    def end(self, dones, failed):
        if self.include_usage and not failed:  # one more chunk, with no choices
            yield sse(self._object(self.chunk_object, [], usage=self.usage(dones)))
        yield sse("[DONE]")


class ChatReply(Reply):
    """A chat's reply, "chat.completion" or its chunks: each choice a message (or deltas of one), with the calls
    of `tools` where they were offered and the model made them."""
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, model_name: str, tokenizer, prompts: list[list[int]], n: int, logprobs: int | None = None,
                 tools: Tools | None = None):
        super().__init__(model_name, tokenizer, prompts, n, logprobs)
        self.tools = tools if tools is not None and tools.offered else None

    def format_logprobs(self, items: list[TokenLogprob]) -> dict | None:
        """Some tokens' log-probabilities as a chat's {"content": [...]}; None unless the request asked for them."""
        if self.logprobs is None:
            return None

        def entry(token, logprob):
            return dict(token=self.tokenizer.token_text(token), logprob=logprob,
                        bytes=list(self.tokenizer.token_bytes(token)))

        return {"content": [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
                            for lp in items]}

    def choice(self, index, answer):
        message = dict(role="assistant", content=answer.text)
        if answer.calls:
            message["tool_calls"] = [call.openai() for call in answer.calls]
        return dict(index=index, message=message, logprobs=self.format_logprobs(answer.logprobs),
                    finish_reason=tool_finish(answer.done.finish_reason, answer.calls))

    def chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> str:
        return sse(self._object(self.chunk_object, [dict(index=index, delta=delta, logprobs=logprobs,
                                                         finish_reason=finish_reason)]))

    def begin(self):
        for i in range(len(self.prompts) * self.n):
            yield self.chunk(i, dict(role="assistant", content=""))

    def piece(self, index, text, pieces, logprobs):
        formatted = self.format_logprobs(logprobs) if logprobs else None
        delta = self.delta(text, pieces) if self.tools is not None else dict(content=text)
        if delta or formatted:  # nothing while the text may be the start of a tool call
            yield self.chunk(index, delta, logprobs=formatted)

    def finished(self, index, done, text, calls):
        yield self.chunk(index, dict(content=text) if text else {}, tool_finish(done.finish_reason, calls))

    @staticmethod
    def delta(text: str, pieces: list[CallPiece]) -> dict:
        """A chat's new text as OpenAI streams it where tools are offered: its own text as content, and each
        call's first piece (its index, id and name) then pieces of its arguments as tool_calls."""
        delta = dict(content=text) if text else {}
        if pieces:
            delta["tool_calls"] = [
                dict(index=p.index, id=p.call.id, type="function", function=dict(name=p.call.name,
                                                                                   arguments=p.arguments))
                if p.first else dict(index=p.index, function=dict(arguments=p.arguments)) for p in pieces]
        return delta


class CompletionReply(Reply):
    """A completion's reply, "text_completion" whole and streamed: each choice a text. echo: the prompts' texts,
    which a choice's text then starts with (and, with logprobs, its tokens and their log-probabilities)."""
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model_name: str, tokenizer, prompts: list[list[int]], n: int, logprobs: int | None = None,
                 echo: list[str] | None = None):
        super().__init__(model_name, tokenizer, prompts, n, logprobs)
        self.echo = echo
        self.offsets = collections.defaultdict(int)  # text_offset, per choice: characters of the text before the
        # next token's

    def echoed(self, index: int) -> str:
        """The text choice `index` starts with: its prompt's, with echo."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def format_logprobs(self, items: list[TokenLogprob | None], index: int) -> dict | None:
        """Some tokens of choice `index` with their log-probabilities as a completion's {tokens, token_logprobs,
        top_logprobs, text_offset}; None unless the request asked for them."""
        if self.logprobs is None:
            return None
        text = self.tokenizer.token_text
        out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in items:
            if lp is None:  # the prompt's first token (echo): nothing predicts it
                token, logprob, top = text(self.prompts[index // self.n][0]), None, None
            else:
                token, logprob, top = text(lp.token), lp.logprob, {text(t): v for t, v in lp.top}
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
        return out

    def choice(self, index, answer):
        return dict(index=index, text=self.echoed(index) + answer.text,
                    logprobs=self.format_logprobs(answer.logprobs, index), finish_reason=answer.done.finish_reason)

    def chunk(self, index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> str:
        return sse(self._object(self.chunk_object, [dict(index=index, text=text, logprobs=logprobs,
                                                         finish_reason=finish_reason)]))

    def begin(self):
        for i in range(len(self.prompts) * self.n):
            if self.echoed(i) and self.logprobs is None:  # with logprobs, the prompt's come first (scored)
                yield self.chunk(i, self.echoed(i))

    def scored(self, index, logprobs):
        yield self.chunk(index, self.echoed(index), logprobs=self.format_logprobs(logprobs, index))

    def piece(self, index, text, pieces, logprobs):
        yield self.chunk(index, text, logprobs=self.format_logprobs(logprobs, index) if logprobs else None)

    def finished(self, index, done, text, calls):  # no tools: no calls, and no text held back
        yield self.chunk(index, text, done.finish_reason)


def tool_finish(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not cut short) with calls."""
    return "tool_calls" if reason == "stop" and calls else reason


@router.get("/v1/models")
async def models(served: AppState):
    # meta, as llama.cpp's: what a client (the page) may want to know of the model's shape
    # a LoRA adapter as vLLM lists one: its base model as `parent`, its directory as `root`
    return {"object": "list", "data": [
        entry for name, thread in served.engines.items() for entry in (
            {"id": name, "object": "model", "created": 0, "owned_by": "smollm2", "meta": meta(thread.model.config)},
            *({"id": lora.name, "object": "model", "created": 0, "owned_by": "smollm2", "parent": name,
               "root": lora.path, "meta": meta(thread.model.config)} for lora in thread.adapters.loaded.values()))]}


def meta(config) -> dict:
    return dict(n_vocab=config.vocab_size, n_ctx_train=config.max_position_embeddings, n_embd=config.hidden_size,
                n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                n_head_kv=config.num_key_value_heads)
