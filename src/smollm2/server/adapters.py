"""vLLM's routes for LoRA adapters loaded while serving: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}, behind the API key as every route. A request names its adapter as its
`model`; /v1/models lists the loaded ones (openai.py). An adapter is held as its low-rank matrices, its rows
decoding in the same passes as the base's and other adapters' (generation/adapters.py).

Unloading an adapter that requests are using: the requests in flight (and those already queued) finish with it, as
they hold it; a new request naming it gets 404 at once, and its memory goes with the last request that held it.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..errors import SmolError
from ..generation.adapters import read_lora
from .scheduler import EngineThread
from .serving import APIError, AppState, Served, Text


class LoadBody(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)


class UnloadBody(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: Text = Field(min_length=1)


router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadBody, served: AppState):
    thread = base_thread(served)
    check_free(served, body.lora_name)
    try:  # in a thread: it reads the adapter's files
        lora = await run_in_threadpool(read_lora, thread.model, body.lora_name, body.lora_path)
    except SmolError as e:
        raise APIError(400, str(e), param="lora_path") from None
    check_free(served, body.lora_name)  # another load of that name may have ended meanwhile
    thread.adapters.loaded[body.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadBody, served: AppState):
    loaded = base_thread(served).adapters.loaded
    if body.lora_name not in loaded:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found; loaded: "
                       f"{', '.join(map(repr, loaded)) or 'none'}", param="lora_name", code="model_not_found")
    del loaded[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def base_thread(served: Served) -> EngineThread:
    """The engine thread whose model the adapters adapt: the app's one."""
    return next(iter(served.engines.values()))


def check_free(served: Served, name: str) -> None:
    if name in served.models:
        raise APIError(400, f"the model name {name!r} is taken (by the base model or a loaded adapter); unload it "
                       "first", param="lora_name")


def load_at_start(served: Served, adapters: dict[str, str]) -> None:
    """create_app's adapters ({name: directory}, `smollm2 serve --lora NAME=DIR`): loaded as the route loads them."""
    thread = base_thread(served)
    for name, path in adapters.items():
        if name in served.models:
            raise SmolError(f"an adapter cannot be served as {name!r}, the base model's name or another's")
        thread.adapters.loaded[name] = read_lora(thread.model, name, path)
