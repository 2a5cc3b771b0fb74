"""Generation: the engine that runs prompts through the model, and the sampler that picks tokens."""

from .engine import Conversation, generate, stream
from .sampling import Sampling

__all__ = ["Conversation", "Sampling", "generate", "stream"]
