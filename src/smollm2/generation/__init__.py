"""Generation: per-sequence state, a batched sampler and the model's steps, driven as a static batch here
(generate, stream) or as a continuous one by the server's scheduler."""

from .engine import Conversation, generate, stream
from .sampling import Sampling
from .sequence import Step

__all__ = ["Conversation", "Sampling", "Step", "generate", "stream"]
