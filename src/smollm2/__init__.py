"""smollm2: the SmolLM2 language models in plain PyTorch, exact to transformers."""

from .config import PRESETS, SmolConfig
from .errors import SmolError
from .kv_cache import KVCache
from .model import SmolLM2

__all__ = ["PRESETS", "KVCache", "SmolConfig", "SmolError", "SmolLM2", "Tokenizer", "accelerate", "load_model"]


def __getattr__(name):
    # The tokenizer pulls in `tokenizers` and jinja2, the kernels and the loader gguf; import them only when asked
    # for.
    if name == "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer
    if name == "accelerate":
        from .kernels import accelerate

        return accelerate
    if name == "load_model":
        from .loading import load_model

        return load_model
    raise AttributeError(name)
