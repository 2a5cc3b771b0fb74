"""See inside the model over HTTP: POST /inspect (smollm2.lens on a prompt or a chat), and `steering`, the request
extension of /v1/chat/completions and /v1/completions that adds a vector to the residual stream of that request
alone.

/inspect takes `prompt` (text) or `messages` (a chat, rendered by the chat template; a last assistant message is
a finished turn, any other last message gets the assistant's header after it), and returns its tokens, each with
its log-probability and the `top_k` likeliest tokens at its position; the logit lens (layers 0..L: the residual
stream entering each block, then leaving the last, each position's top_k tokens and probabilities); the attention
patterns of the blocks listed in `attention`; with `profile`, where the time of the prompt's pass and of one
decoding step after it goes (smollm2.roofline.profile). A prompt has at most MAX_INSPECT_TOKENS tokens. The work runs
on the scheduler's thread in pieces (the pass; the lens a few layers at a time; the profile), between its steps.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import BaseModel, ConfigDict, Field

from .. import lens, roofline
from ..generation.hooks import Hooks, steering
from ..generation.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from .scheduler import EngineThread
from .serving import APIError, AppState, Text, content_text

MAX_INSPECT_TOKENS = 256  # the logit lens of 256 tokens is 31 x 256 output projections: seconds on 2 cores
LENS_LAYERS_A_CALL = 4  # the lens's layers computed between two steps of the scheduler: a prefill chunk's time
MAX_STEERING_TOKENS = 64  # each of the two texts a steering vector is made from
MAX_STEERING_SCALE = 100.0


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant"]
    content: Any  # a string, or a list of {"type": "text", "text": ...} parts: checked by content_text


class InspectBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    top_k: int = Field(5, ge=1, le=MAX_TOP_LOGPROBS)
    logit_lens: bool = True
    attention: list[int] = Field([], max_length=1024)  # the blocks whose patterns to return
    profile: bool = False


class Steering(BaseModel):
    """Add `scale` times a vector to the residual stream entering block `layer`, at every position of this request:
    `vector` itself (hidden_size numbers), or the stream at the last token of `toward` less that of `away`
    (smollm2.lens.steering_vector)."""
    model_config = ConfigDict(strict=True)
    layer: int
    vector: list[Annotated[float, Field(allow_inf_nan=False)]] | None = None
    toward: Text | None = None
    away: Text | None = None
    scale: float = Field(1.0, ge=-MAX_STEERING_SCALE, le=MAX_STEERING_SCALE)


async def steering_hooks(body: Steering | None, scheduler: EngineThread, tokenizer) -> Hooks | None:
    """A request's `steering` as the hooks its row runs, or None; a 400 naming the field for what cannot be."""
    if body is None:
        return None
    model, config = scheduler.model, scheduler.model.config
    if not 0 <= body.layer < config.num_hidden_layers:
        raise APIError(400, f"steering.layer: must be a block, 0 to {config.num_hidden_layers - 1}, got {body.layer}",
                       param="steering.layer")
    texts = (body.toward, body.away)
    if not (body.vector is not None and texts == (None, None) or body.vector is None and None not in texts):
        raise APIError(400, "steering: give either vector or both toward and away", param="steering")
    if body.vector is not None and len(body.vector) != config.hidden_size:
        raise APIError(400, f"steering.vector: must have {config.hidden_size} numbers (the hidden size), got "
                       f"{len(body.vector)}", param="steering.vector")
    prompts = {}
    for field, text in zip(("toward", "away"), texts):
        prompts[field] = ids = [] if text is None else tokenizer.encode(text)
        if text is not None and not lens.MIN_STEERING_TOKENS <= len(ids) <= MAX_STEERING_TOKENS:
            raise APIError(400, f"steering.{field}: must be {lens.MIN_STEERING_TOKENS} to {MAX_STEERING_TOKENS} "
                           f"tokens (the first position is the attention sink's), got {len(ids)}",
                           param=f"steering.{field}")

    def hooks() -> Hooks:  # scheduler thread
        vector = torch.tensor(body.vector, dtype=model.model.embed_tokens.weight.dtype) if body.vector is not None \
            else lens.steering_vector(model, prompts["toward"], prompts["away"], body.layer)
        return Hooks(config.num_hidden_layers, steering(config, body.layer, body.scale * vector))

    return await scheduler.call(hooks)


router = APIRouter()


@router.post("/inspect")
async def inspect(body: InspectBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.engine(body.model), served.tokenizer
    ids = prompt_of(body, tokenizer)
    layers = scheduler.model.config.num_hidden_layers
    for i, layer in enumerate(body.attention):
        if not 0 <= layer < layers:
            raise APIError(400, f"attention.{i}: {layer} is not a block, 0 to {layers - 1}", param=f"attention.{i}")
    attention = sorted(set(body.attention))
    tokens, residual, patterns = await scheduler.call(functools.partial(first_pass, scheduler.model, ids, body.top_k,
                                                                        attention))
    top = []
    for begin in range(0, layers + 1 if body.logit_lens else 0, LENS_LAYERS_A_CALL):
        if await connection.is_disconnected():  # nobody is waiting for the rest
            raise APIError(499, "the client went away")
        top += await scheduler.call(functools.partial(lens_of, scheduler.model,
                                                      residual[begin:begin + LENS_LAYERS_A_CALL], body.top_k))
    text = tokenizer.token_text
    answer = dict(
        object="inspection", model=body.model,
        tokens=[dict(id=ids[0], text=text(ids[0]), logprob=None, top=[])] + [
            dict(id=lp.token, text=text(lp.token), logprob=lp.logprob,
                 top=[dict(id=t, text=text(t), logprob=v) for t, v in lp.top]) for lp in tokens],
        logit_lens=[[[dict(id=i, text=text(i), prob=p) for i, p in position] for position in layer] for layer in top]
        if body.logit_lens else None,
        attention=[dict(layer=layer, heads=[[row[:q + 1] for q, row in enumerate(head)] for head in pattern])
                   for layer, pattern in zip(attention, patterns)])
    if body.profile:
        answer["profile"] = profile_of(await scheduler.call(functools.partial(roofline.profile, scheduler.model, ids)))
    return answer


def prompt_of(body: InspectBody, tokenizer) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt)
    else:
        chat = [dict(role=m.role, content=content_text(m.content, f"messages.{i}.content"))
                for i, m in enumerate(body.messages)]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=chat[-1]["role"] != "assistant")
    where = "prompt" if body.prompt is not None else "messages"
    if not 1 <= len(ids) <= MAX_INSPECT_TOKENS:
        raise APIError(400, f"{where}: must be 1 to {MAX_INSPECT_TOKENS} tokens to inspect, got {len(ids)}",
                       param=where)
    return ids


def first_pass(model, ids: list[int], top_k: int, attention: list[int]):  # scheduler thread
    """Each token's log-probability and its position's top_k (the first token's none), the residual stream
    (layers + 1, T, C), and the patterns of the blocks in `attention`, rounded, as lists."""
    layers = model.config.num_hidden_layers
    names = [*(f"blocks.{layer}.hook_resid_pre" for layer in range(layers)), f"blocks.{layers - 1}.hook_resid_post",
             *(f"blocks.{layer}.attn.hook_pattern" for layer in attention)]
    logits, cache = lens.run_with_cache(model, [ids], names)
    tokens = token_logprobs(logits[0, :-1], ids[1:], top_k) if len(ids) > 1 else []
    patterns = [rounded(cache[f"blocks.{layer}.attn.hook_pattern"][0]) for layer in attention]
    return tokens, lens.residual_stream(cache)[:, 0], patterns


def lens_of(model, residual: torch.Tensor, top_k: int) -> list:  # scheduler thread
    """The logit lens of a few layers' residual streams (layers, T, C): per layer, per position, its top_k
    (id, probability) pairs."""
    probs, ids = lens.logit_lens(model, residual, top_k)
    return [[list(zip(*position)) for position in zip(*layer)] for layer in zip(ids.tolist(), rounded(probs))]


def rounded(probs: torch.Tensor) -> list:
    """Probabilities to 6 decimals, as lists: what a page can show, in a third of the JSON."""
    return (probs.float() * 1e6).round().div(1e6).tolist()


def profile_of(profile: roofline.Profile) -> dict:
    def ops(items: list[roofline.Op]) -> list[dict]:
        return [dict(layer=op.layer, name=op.name, kind=op.kind, seconds=op.seconds, bytes=op.bytes, flops=op.flops)
                for op in items]

    return dict(tokens=profile.tokens, machine=dict(bandwidth=profile.machine.bandwidth, flops=profile.machine.flops),
                prefill=dict(ops=ops(profile.prefill), served_seconds=profile.served_prefill_s),
                decode=dict(ops=ops(profile.decode), served_seconds=profile.served_decode_s))
