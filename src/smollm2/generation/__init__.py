"""Generation: one Request type (request.py), per-sequence state, a batched sampler and the model's steps, in one
engine of cache rows, driven as a static batch here (generate, stream) or as a continuous one by the server's
engine thread; and embeddings (embed), the model's pooled hidden states."""

from .batch import generate, stream
from .embeddings import embed
from .prefix_cache import PrefixCache
from .request import Request
from .sampling import Sampling
from .sequence import Step

__all__ = ["PrefixCache", "Request", "Sampling", "Step", "embed", "generate", "stream"]
