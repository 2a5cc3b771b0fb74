"""smollm2: the SmolLM2 language models in plain PyTorch, exact to transformers."""

from .config import PRESETS, SmolConfig
from .errors import SmolError
from .model import KVCache, SmolLM2

__all__ = ["PRESETS", "KVCache", "SmolConfig", "SmolError", "SmolLM2", "Tokenizer"]


def __getattr__(name):
    # The tokenizer pulls in `tokenizers` and jinja2; import it only when asked for.
    if name == "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(name)
