"""smollm2: the SmolLM2 language models in plain PyTorch, exact to transformers.

    model = smollm2.load()                      # a directory, a .gguf file, a hub id; None: the embedded one
    out = smollm2.generate(model, [ids], 40)    # or smollm2.stream(model, ...); smollm2.save(model, path)
"""

from .config import PRESETS, SmolConfig
from .errors import SmolError
from .kv_cache import KVCache
from .model import SmolLM2

__all__ = ["PRESETS", "KVCache", "SmolConfig", "SmolError", "SmolLM2", "Tokenizer", "accelerate", "generate", "load",
           "save", "stream"]


def __getattr__(name):
    # The tokenizer pulls in `tokenizers` and jinja2, the kernels and the loader gguf, generation the grammar
    # engine; import them only when asked for.
    if name == "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer
    if name == "accelerate":
        from .kernels import accelerate

        return accelerate
    if name in ("load", "save"):
        from . import loading

        return getattr(loading, name)
    if name in ("generate", "stream"):
        from . import generation

        return getattr(generation, name)
    raise AttributeError(name)
