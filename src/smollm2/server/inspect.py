"""See inside the model over HTTP: POST /inspect (smollm2.lens on a prompt or a chat), its sparse dictionaries'
features and attribution graphs (the SAEs and transcoders serve_dictionaries gives the app), and `steering` and
`steer`, the request extensions of /v1/chat/completions and /v1/completions that add a vector, or a feature's
decoder direction, to the residual stream of that request alone.

/inspect takes `prompt` (text) or `messages` (a chat, rendered by the chat template; a last assistant message is
a finished turn, any other last message gets the assistant's header after it), and returns its tokens, each with
its log-probability and the `top_k` likeliest tokens at its position; the logit lens (layers 0..L: the residual
stream entering each block, then leaving the last, each position's top_k tokens and probabilities); the attention
patterns of the blocks listed in `attention`; with `profile`, where the time of the prompt's pass and of one
decoding step after it goes (smollm2.roofline.profile). A prompt has at most MAX_INSPECT_TOKENS tokens. The work runs
on the scheduler's thread in pieces (the pass; the lens a few layers at a time; the profile), between its steps.

GET /inspect/dictionaries lists the dictionaries served; POST /inspect/features gives each position's strongest
features at one's hook point (smollm2.features.top_features), POST /inspect/feature one feature's activation at
every position and its logit effect (the tokens its decoder direction promotes and suppresses), POST
/inspect/graph the attribution graph of a prompt from the served transcoders, one per block (smollm2.graphs), in
circuit-tracer's JSON. A graph is one call on the scheduler's thread: its backward passes take seconds.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import BaseModel, ConfigDict, Field

from .. import graphs, lens, roofline
from ..errors import SmolError
from ..features import feature_steering, logit_effect, top_features, writes_to_stream
from ..generation.hooks import Hooks, steering
from ..generation.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from ..generation.request import check_token_id
from ..sae import SAE, load_saes
from .scheduler import EngineThread
from .serving import APIError, AppState, Text, content_text

MAX_INSPECT_TOKENS = 256  # the logit lens of 256 tokens is 31 x 256 output projections: seconds on 2 cores
LENS_LAYERS_A_CALL = 4  # the lens's layers computed between two steps of the scheduler: a prefill chunk's time
MAX_STEERING_TOKENS = 64  # each of the two texts a steering vector is made from
MAX_STEERING_SCALE = 100.0
MAX_FEATURES_K = 20  # a position's strongest features shown
MAX_GRAPH_TOKENS = 64  # a graph's backward passes grow with the prompt: 16 tokens of the 135M take ~30 s
MAX_GRAPH_FEATURES = 4096
MAX_FEATURE_STEERS = 16
MAX_FEATURE_VALUE = 1e4  # an activation to clamp to, or a multiple of a decoder direction to add


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant"]
    content: Any  # a string, or a list of {"type": "text", "text": ...} parts: checked by content_text


class PromptBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class InspectBody(PromptBody):
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


class Feature(BaseModel):
    model_config = ConfigDict(strict=True)
    sae: Text  # a served dictionary's name
    index: int = Field(ge=0)


class FeatureSteering(BaseModel):
    """Steer by a feature at every position of this request: add `value` times its decoder direction where its
    dictionary writes, or clamp its activation there to `value` (smollm2.features.feature_steering)."""
    model_config = ConfigDict(strict=True)
    feature: Feature
    value: float = Field(ge=-MAX_FEATURE_VALUE, le=MAX_FEATURE_VALUE)
    mode: Literal["add", "clamp"] = "add"


async def steering_hooks(body: Steering | None, scheduler: EngineThread, tokenizer, steer: list[FeatureSteering],
                         connection: Connection) -> Hooks | None:
    """A request's `steering` and `steer` as the hooks its row runs, or None; a 400 naming the field for what
    cannot be."""
    config = scheduler.model.config
    pairs = []
    for i, item in enumerate(steer):
        sae = dictionary(connection, item.feature.sae, f"steer.{i}.feature.sae")
        where = f"steer.{i}.feature.index" if item.feature.index >= sae.W_dec.shape[0] else f"steer.{i}.feature.sae"
        try:
            pairs += feature_steering(config, sae, item.feature.index,
                                      **{"scale" if item.mode == "add" else "clamp": item.value})
        except SmolError as e:
            raise APIError(400, f"{where}: {e}", param=where) from None
    if body is not None:
        pairs += await vector_steering(body, scheduler, tokenizer)
    return Hooks(config.num_hidden_layers, pairs) if pairs else None


async def vector_steering(body: Steering, scheduler: EngineThread, tokenizer) -> list:
    """`steering`'s hook, made on the scheduler's thread from its texts where it has them."""
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

    def hooks() -> list:  # scheduler thread
        vector = torch.tensor(body.vector, dtype=model.model.embed_tokens.weight.dtype) if body.vector is not None \
            else lens.steering_vector(model, prompts["toward"], prompts["away"], body.layer)
        return steering(config, body.layer, body.scale * vector)

    return await scheduler.call(hooks)


router = APIRouter()


@router.post("/inspect")
async def inspect(body: InspectBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.engine(body.model), served.tokenizer
    ids = prompt_of(body, tokenizer, MAX_INSPECT_TOKENS)
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


def prompt_of(body: PromptBody, tokenizer, limit: int) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt)
    else:
        chat = [dict(role=m.role, content=content_text(m.content, f"messages.{i}.content"))
                for i, m in enumerate(body.messages)]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=chat[-1]["role"] != "assistant")
    where = "prompt" if body.prompt is not None else "messages"
    if not 1 <= len(ids) <= limit:
        raise APIError(400, f"{where}: must be 1 to {limit} tokens to inspect, got {len(ids)}", param=where)
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


# Sparse dictionaries: features and attribution graphs.

class Dictionaries:
    """The dictionaries an app serves, by name; those whose features have a logit effect (they write to the
    residual stream); the transcoders its graphs use: one per block, each writing its MLP's output
    (smollm2.graphs), where the dictionaries hold such a set, else None."""

    def __init__(self, dictionaries: dict[str, SAE], in_stream: set[str], transcoders: list[SAE] | None):
        self.dictionaries, self.in_stream, self.transcoders = dictionaries, in_stream, transcoders


def serve_dictionaries(app, sources: list[str]) -> None:
    """Serve the dictionaries of `sources` (each a directory or hub id of an SAE or transcoder, or of a set of them:
    sae.load_saes; `smollm2 serve --sae`) on the app's page and routes, by their folders' names; each checked
    against the app's first model (the base; adapters share its shape): its hook points the model's, as wide as the
    activations there. Before the app starts: the schedulers' threads own the model once it runs."""
    if not sources:  # none to check: the check's pass, on torch alone, would decode every held matrix once
        return
    model = next(iter(app.state.served.engines.values())).model
    dictionaries = {}
    for source in sources:
        for name, sae in load_saes(source, model).items():
            if name in dictionaries:
                raise SmolError(f"--sae {source}: a dictionary named {name!r} is already served")
            dictionaries[name] = sae
    names = sorted({point for sae in dictionaries.values() for point in (sae.hook_name, sae.hook_name_out)})
    _, cache = lens.run_with_cache(model, [[0]], names)  # the hook points are the model's, or a SmolError
    for name, sae in dictionaries.items():
        for point, width in ((sae.hook_name, sae.W_enc.shape[0]), (sae.hook_name_out, sae.W_dec.shape[1])):
            if cache[point].shape[-1] != width:
                raise SmolError(f"the dictionary {name} has {width} numbers at {point}, the model "
                                f"{cache[point].shape[-1]}")
    layers = model.config.num_hidden_layers
    per_block = [[sae for sae in dictionaries.values() if sae.transcoder
                  and sae.hook_name_out == f"blocks.{layer}.hook_mlp_out"] for layer in range(layers)]
    transcoders = [found[0] for found in per_block] if all(len(found) == 1 for found in per_block) else None
    try:
        graphs.check(model.config, transcoders or [])
    except SmolError:  # not a set a graph can use (each must read its MLP's input): served for their features
        transcoders = None
    in_stream = {name for name, sae in dictionaries.items() if writes_to_stream(model.config, sae)}
    app.state.dictionaries = Dictionaries(dictionaries, in_stream, transcoders)


def served_dictionaries(connection: Connection) -> Dictionaries:
    # an app given none by serve_dictionaries serves none
    return getattr(connection.app.state, "dictionaries", None) or Dictionaries({}, set(), None)


def dictionary(connection: Connection, name: str, field: str) -> SAE:
    dictionaries = served_dictionaries(connection).dictionaries
    if name not in dictionaries:
        raise APIError(404 if field == "sae" else 400, f"{field}: no dictionary {name!r}; this server has "
                       f"{', '.join(map(repr, dictionaries)) or 'none (smollm2 serve --sae)'}", param=field)
    return dictionaries[name]


class FeaturesBody(PromptBody):
    sae: Text
    k: int = Field(5, ge=1, le=MAX_FEATURES_K)


class FeatureBody(PromptBody):
    sae: Text
    index: int = Field(ge=0)
    k: int = Field(10, ge=1, le=MAX_FEATURES_K)  # the tokens promoted, and suppressed


class GraphBody(PromptBody):
    target: int | None = Field(None, ge=0)  # a token id; default: the likeliest tokens (95% of the probability)
    max_features: int = Field(256, ge=1, le=MAX_GRAPH_FEATURES)
    node_threshold: float = Field(0.8, ge=0, le=1)
    edge_threshold: float = Field(0.98, ge=0, le=1)


@router.get("/inspect/dictionaries")
async def dictionaries(connection: Connection):
    served = served_dictionaries(connection)
    return dict(object="list", graphs=served.transcoders is not None, data=[
        dict(name=name, hook_name=sae.hook_name, hook_name_out=sae.hook_name_out, transcoder=sae.transcoder,
             activation=sae.activation, features=sae.W_enc.shape[1], logit_effect=name in served.in_stream)
        for name, sae in served.dictionaries.items()])


@router.post("/inspect/features")
async def features(body: FeaturesBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.engine(body.model), served.tokenizer
    sae = dictionary(connection, body.sae, "sae")
    ids = prompt_of(body, tokenizer, MAX_INSPECT_TOKENS)
    k = min(body.k, sae.W_enc.shape[1])
    values, indices = await scheduler.call(functools.partial(top_features, scheduler.model, sae, [ids], k))
    return dict(object="features", model=body.model, sae=body.sae, hook_name=sae.hook_name,
                tokens=[dict(id=i, text=tokenizer.token_text(i)) for i in ids],
                top=[[dict(index=i, activation=v) for i, v in zip(position_ids, position_values) if v > 0]
                     for position_ids, position_values in zip(indices[0].tolist(), rounded(values[0]))])


@router.post("/inspect/feature")
async def feature(body: FeatureBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.engine(body.model), served.tokenizer
    sae = dictionary(connection, body.sae, "sae")
    if body.index >= sae.W_enc.shape[1]:
        raise APIError(400, f"index: {body.sae} has {sae.W_enc.shape[1]} features, 0 to {sae.W_enc.shape[1] - 1}, "
                       f"got {body.index}", param="index")
    ids = prompt_of(body, tokenizer, MAX_INSPECT_TOKENS)
    activations, effect = await scheduler.call(functools.partial(feature_of, scheduler.model, sae, ids, body.index,
                                                                 body.k))
    text = tokenizer.token_text
    return dict(object="feature", model=body.model, sae=body.sae, index=body.index,
                tokens=[dict(id=i, text=text(i)) for i in ids], activations=activations,
                promoted=None if effect is None else [dict(id=i, text=text(i), logit=v) for i, v in effect[0]],
                suppressed=None if effect is None else [dict(id=i, text=text(i), logit=-v) for i, v in effect[1]])


def feature_of(model, sae: SAE, ids: list[int], index: int, k: int):  # scheduler thread
    """The feature's activation at each position; its logit effect ((id, logit) promoted, suppressed), or None
    where its direction is not in the residual stream."""
    _, cache = lens.run_with_cache(model, [ids], [sae.hook_name])
    activations = rounded(sae.encode(cache[sae.hook_name])[0, :, index])
    if not writes_to_stream(model.config, sae):
        return activations, None
    promoted, suppressed = logit_effect(model, sae, index, k)
    return activations, [list(zip(top.indices.tolist(), rounded(top.values))) for top in (promoted, suppressed)]


@router.post("/inspect/graph")
async def graph(body: GraphBody, connection: Connection, served: AppState):
    scheduler, tokenizer = served.engine(body.model), served.tokenizer
    transcoders = served_dictionaries(connection).transcoders
    if transcoders is None:
        raise APIError(400, "this server has no transcoder set (one per block, writing its MLP's output: smollm2 "
                       "serve --sae DIR of them) to make a graph with", param="model")
    ids = prompt_of(body, tokenizer, MAX_GRAPH_TOKENS)
    if body.target is not None:
        check_token_id(body.target, scheduler.model.config.vocab_size, "target")

    def attribute():  # scheduler thread
        found = graphs.attribute(scheduler.model, transcoders, ids, None if body.target is None else [body.target],
                                 max_features=body.max_features)
        return graphs.graph_json(found, tokenizer.decode, slug="smollm2", node_threshold=body.node_threshold,
                                 edge_threshold=body.edge_threshold)

    return await scheduler.call(attribute)
