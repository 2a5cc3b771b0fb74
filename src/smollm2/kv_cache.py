"""The KV cache: every layer's keys and values, written in place at each token's slot, in the model's dtype or
fewer bytes (bf16, int8 with a scale per head and slot), read back in the model's dtype by attention."""

from __future__ import annotations

import torch

from .config import SmolConfig
from .errors import SmolError

KV_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}  # what a cache may store
INT8_LIMIT = 127  # an int8 cache's largest magnitude: symmetric, so -x is stored as exactly -(x's int8)


def kv_cache_dtype(name: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache stores for `name` (KV_CACHE_DTYPES; None: the model's own, `dtype`)."""
    if name is None:
        return dtype
    if name not in KV_CACHE_DTYPES:
        raise SmolError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


class KVCache:
    """A static cache: every layer's keys and values, (L, B, n_kv, max_len, hd) each, written in place at each
    token's position. Nothing is re-copied per token; slot s of row b holds position s of that row's sequence.

    It stores the model's dtype, or fewer bytes (kv_dtype): bf16, each value rounded to it; or int8, each head's
    hd keys (or values) at a slot as int8 times one float32 scale, their largest magnitude / 127, kept in
    k_scale and v_scale, (L, B, n_kv, max_len, 1). Attention reads them back in the model's dtype, the
    rounded values: every path (torch's, the CPU kernels', a prompt's and a decoding step's) sees the same."""

    def __init__(self, config: SmolConfig, batch_size: int, max_len: int, device=None, dtype=None, kv_dtype=None):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.dtype = dtype or torch.get_default_dtype()  # what update() returns
        kv_dtype = kv_dtype or self.dtype
        self.k, self.v = (torch.zeros(shape, device=device, dtype=kv_dtype) for _ in "kv")
        self.k_scale = self.v_scale = None
        if kv_dtype == torch.int8:
            self.k_scale, self.v_scale = (torch.zeros(*shape[:4], 1, device=device) for _ in "kv")

    max_len = property(lambda self: self.k.shape[3])

    @property
    def parts(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, each (L, B, n_kv, max_len, ...): what moves when a row's slots move."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @parts.setter
    def parts(self, tensors: list[torch.Tensor]) -> None:
        self.k, self.v, self.k_scale, self.v_scale = (*tensors, None, None)[:4]

    def view(self, rows: slice = slice(None), length: int | None = None) -> KVCache:
        """These rows and the first `length` slots, sharing storage: writes land in this cache, and attention
        reads only those slots instead of the whole window."""
        view = object.__new__(KVCache)
        view.dtype, view.parts = self.dtype, [t[:, rows, :, :length] for t in self.parts]
        return view

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # k, v: (B, T, n_kv, hd) written at (b, :, input_pos[b, t]), or input_pos[t] for every row when it is
        # (T,) (one copy, cheaper than scattering); returns the layer's whole (B, n_kv, S, hd), as stored.
        read = []
        for cache, scale, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scale is None:
                write(cache[layer], input_pos, new.to(cache.dtype))
                read.append(cache[layer].to(self.dtype))
                continue
            new_scale = new.float().abs().amax(-1, keepdim=True) / INT8_LIMIT
            # A head of zeros divides by 1, not 0: its int8 values and scale are zeros.
            write(cache[layer], input_pos, (new.float() / torch.where(new_scale == 0, 1, new_scale)).round()
                  .clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8))
            write(scale[layer], input_pos, new_scale)
            read.append((cache[layer].float() * scale[layer]).to(self.dtype))
        return read


def write(cache: torch.Tensor, input_pos: torch.Tensor, new: torch.Tensor) -> None:
    """new (B, T, n_kv, n) into a layer's cache (B, n_kv, S, n) at slots input_pos: (T,) or (B, T)."""
    if input_pos.dim() == 1:
        cache.index_copy_(2, input_pos, new.transpose(1, 2))
    else:
        cache[torch.arange(new.shape[0], device=new.device)[:, None], :, input_pos] = new  # rows: (B, 1)
