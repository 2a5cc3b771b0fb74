"""Running the model for generation, the same for every driver: a prompt into a KV cache in chunks, one
decoding step, and how long a cache to give attention."""

from __future__ import annotations

import functools

import torch

PREFILL_CHUNK = 512
CACHE_BLOCK = 128  # caches are sized in these steps: compiled steps see few distinct lengths, so rarely recompile


def decode_step(model, ids, input_pos, cache, attention_mask) -> torch.Tensor:
    """One token per row at slot input_pos -> next-token logits, (B, V)."""
    return model.logits(model.hidden_states(ids, input_pos, cache, attention_mask))[:, -1]


@functools.cache
def compiled_decode_step(device_type: str):
    # CUDA: CUDA graphs replay the whole step without Python; CPU: inductor fuses the small ops.
    return torch.compile(decode_step, mode="reduce-overhead" if device_type == "cuda" else None)


def prefill(model, ids, cache, start: int = 0, attention_mask=None) -> torch.Tensor:
    """Prompt ids (B, T) into the cache from slot `start` on, PREFILL_CHUNK tokens at a time (bounded memory);
    returns the last position's hidden state, (B, C). Each chunk's attention reads only the slots filled so far:
    the first chunk of an unpadded prompt is plain causal, which the CPU kernel computes half of."""
    T = ids.shape[1]
    for begin in range(start, T, PREFILL_CHUNK):
        end = min(begin + PREFILL_CHUNK, T)
        h = model.hidden_states(ids[:, begin:end], torch.arange(begin, end, device=ids.device),
                                cache.view(length=end), None if attention_mask is None else attention_mask[:, :end],
                                last_only=True)
    return h[:, -1]


def cache_length(n: int, limit: int) -> int:
    """n slots rounded up to a whole number of blocks (at most limit): fewer distinct cache shapes."""
    return min(-(-n // CACHE_BLOCK) * CACHE_BLOCK, limit)
