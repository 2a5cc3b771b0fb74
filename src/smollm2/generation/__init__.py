"""Generation: the engine that runs prompts through the model, and the sampler that picks tokens."""

from .engine import generate, stream
from .sampling import Sampling

__all__ = ["Sampling", "generate", "stream"]
