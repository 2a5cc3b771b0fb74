"""OpenAI's embeddings: POST /v1/embeddings, smollm2.generation.embed on the model's engine thread.

`input` is a string, token ids, or a list of either (at most MAX_INPUTS, each within the context window, at most
MAX_TOKENS in all); `encoding_format` float (a list of numbers) or base64 (little-endian float32, as OpenAI's).
The rows run in batches of at most BATCH_TOKENS padded tokens, each a call between two of the engine's steps,
so the streams running meanwhile wait for no more than a prompt's prefill chunk at a time.
"""

from __future__ import annotations

import base64
import functools
from typing import Annotated, Literal

from fastapi import APIRouter
from fastapi import Request as Connection
from pydantic import BaseModel, BeforeValidator, ConfigDict

from ..generation import steps
from ..generation.adapters import Adapters, LoRA
from ..generation.embeddings import embed
from ..generation.request import checked_rows
from .serving import APIError, AppState, Text, text_or_ids

MAX_INPUTS = 2048  # as OpenAI
MAX_TOKENS = 300_000  # as OpenAI
BATCH_TOKENS = steps.PREFILL_CHUNK


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(strict=True)
    model: Text
    input: Annotated[list[str | list[int]], BeforeValidator(lambda value: text_or_ids(value, MAX_INPUTS))]
    encoding_format: Literal["float", "base64"] = "float"


def batches(rows: list[list[int]]) -> list[list[list[int]]]:
    """The rows, in order, in groups of at most BATCH_TOKENS once padded to their longest; a longer row alone."""
    groups = [[]]
    for row in rows:
        group = groups[-1]
        if group and (len(group) + 1) * max(len(row), *map(len, group)) > BATCH_TOKENS:
            groups.append(group := [])
        group.append(row)
    return groups


router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingsBody, connection: Connection, served: AppState):
    thread = served.engine(body.model)
    rows = []
    for i, item in enumerate(body.input):
        where = "input" if len(body.input) == 1 else f"input.{i}"
        ids = served.tokenizer.encode(item) if isinstance(item, str) else item
        if not ids:
            raise APIError(400, f"{where}: is empty: an embedding needs a token at least", param=where)
        rows += checked_rows([ids], thread.model.config, thread.max_seq_len, where)
    tokens = sum(map(len, rows))
    if tokens > MAX_TOKENS:
        raise APIError(400, f"input: {tokens} tokens in all; at most {MAX_TOKENS}", param="input")
    lora = thread.adapters.loaded.get(body.model)  # a LoRA adapter's embeddings are its own
    vectors = []
    for batch in batches(rows):
        if await connection.is_disconnected():  # nobody is waiting for the rest
            raise APIError(499, "the client went away")
        vectors += await thread.call(functools.partial(adapted_embed, thread.adapters, lora, batch))
    data = [dict(object="embedding", index=i, embedding=encode(vector, body.encoding_format))
            for i, vector in enumerate(vectors)]
    return dict(object="list", data=data, model=body.model, usage=dict(prompt_tokens=tokens, total_tokens=tokens))


def encode(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def adapted_embed(adapters: Adapters, lora: LoRA | None, rows: list[list[int]]):
    """embed() on the model with `lora` (None: the base), chosen on the engine thread, where passes select theirs."""
    return embed(adapters.model_for([lora] * len(rows)), rows)
