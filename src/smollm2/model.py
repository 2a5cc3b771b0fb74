"""SmolLM2: a LLaMA-architecture decoder-only transformer, read top to bottom.

    tokens -> embed -> N x [RMSNorm -> attention (RoPE, grouped-query, KV cache) -> +residual
                            RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> tied lm_head -> logits

Module and parameter names are exactly transformers' LlamaForCausalLM's, so a HF state dict loads as is.
Numerics follow transformers: norms and softmax accumulate in float32; RoPE angles come from integer
positions in float32 whatever the model dtype.

Hook points, TransformerLens's names (generation/hooks.py): a pass given `hooks` (hidden_states) calls
hooks(name, activation) at each, a name relative to its module (hooks.at(prefix): a part's), and goes on with
what it returns; without, a point is a function call that hands the activation back. A hooked pass runs this
file's own modules, where an accelerated model's (kernels/) compute whole operations in C, and attention with
an explicit softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import SmolConfig
from .kv_cache import KVCache, kv_cache_dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, hooks=None) -> torch.Tensor:
        # Accumulate in float32: bf16 squares lose most of their digits.
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True) + self.eps  # (..., 1)
        if hooks is None:
            h = h * torch.rsqrt(variance)
        else:  # TransformerLens's points: the scale, sqrt(variance), and x divided by it, before the weight
            h = hooks("hook_normalized", (h / hooks("hook_scale", variance.sqrt())).to(x.dtype))
        return self.weight * h.to(x.dtype)


def hook(hooks, name: str, x: torch.Tensor) -> torch.Tensor:
    """x, or with hooks what the functions at point `name` make of it."""
    return x if hooks is None else hooks(name, x)


def hooked(module: nn.Module, forward, hooks, prefix: str, *args) -> torch.Tensor:
    """module(*args), or with hooks this file's `forward` of it, its points named under `prefix` (see the top)."""
    return module(*args) if hooks is None else forward(module, *args, hooks=hooks.at(prefix))


def rope_tables(config: SmolConfig, length: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1 (default: every position), (length, head_dim), float32: from integer
    positions turned into float32 (exact up to 2**24); bf16 cannot count past 256."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    positions = torch.arange(config.max_position_embeddings if length is None else length, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (P, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, hd): non-interleaved halves, as HF
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, config: SmolConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv = layer, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        c, q, kv, bias = config.hidden_size, self.n_heads * hd, self.n_kv * hd, config.attention_bias
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(c, n, bias=bias) for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, c, bias=bias)

    def forward(self, x, rope, mask, cache: KVCache | None, input_pos, last_only: bool = False, hooks=None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = hook(hooks, "hook_q", q.view(B, T, self.n_heads, self.head_dim))  # (B, T, nh, hd)
        k = hook(hooks, "hook_k", k.view(B, T, self.n_kv, self.head_dim))  # (B, T, n_kv, hd)
        v = hook(hooks, "hook_v", v.view(B, T, self.n_kv, self.head_dim))
        q, k = hook(hooks, "hook_rot_q", self.rotate(q, *rope)), hook(hooks, "hook_rot_k", self.rotate(k, *rope))
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, n_kv, T, hd)
        else:
            k, v = cache.update(self.layer, input_pos, k, v)  # (B, n_kv, S, hd)
        if last_only:  # every key is written; the last query alone sees them all, and needs no causal mask
            q, mask = q[:, -1:], None if mask is None else mask[:, :, -1:]
        if hooks is None:
            y = self.attend(q, k, v, mask, is_causal=mask is None and not last_only)  # (B, T, nh, hd)
        else:
            y = hooks("hook_z", self.attend_eagerly(q, k, v, mask, hooks))
        return self.o_proj(y.reshape(B, q.shape[1], self.n_heads * self.head_dim))

    def project(self, x):  # q, k, v: (B, T, nh * hd), (B, T, n_kv * hd) twice; the kernels' one pass
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE. x: (B, T, heads, hd); cos, sin: (B, T, 1, hd). Rotate-half layout: pairs are (i, i + hd/2)."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def attend(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        """q (B, T, nh, hd) against k, v (B, n_kv, S, hd) -> (B, T, nh, hd). enable_gqa shares each K/V head
        with its group of query heads without copying them."""
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.n_kv != self.n_heads)
        return y.transpose(1, 2)

    def attend_eagerly(self, q, k, v, mask, hooks) -> torch.Tensor:
        """attend() as transformers' eager attention, its scores and pattern (B, nh, T, S) at hook points; mask:
        (B, 1, T, S), True where a query sees a key. Each K/V head is repeated for its group of query heads."""
        k, v = (t.repeat_interleave(self.n_heads // self.n_kv, 1) for t in (k, v))  # (B, nh, S, hd)
        scores = q.transpose(1, 2) @ k.transpose(2, 3) * self.head_dim ** -0.5  # (B, nh, T, S)
        scores = hooks("hook_attn_scores", scores.masked_fill(~mask, -math.inf))
        pattern = hooks("hook_pattern", torch.softmax(scores.float(), dim=-1).to(q.dtype))
        return (pattern @ v).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config: SmolConfig):
        super().__init__()
        c, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(m, n, bias=bias) for m, n in ((c, i), (c, i), (i, c)))

    def forward(self, x, hooks=None):
        gate, up = hook(hooks, "hook_pre", self.gate_proj(x)), hook(hooks, "hook_pre_linear", self.up_proj(x))
        return self.down_proj(hook(hooks, "hook_post", F.silu(gate) * up))  # SwiGLU


class Block(nn.Module):
    def __init__(self, config: SmolConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, cache, input_pos, last_only: bool = False, hooks=None):
        x = hook(hooks, "hook_resid_pre", x)
        h = hooked(self.input_layernorm, RMSNorm.forward, hooks, "ln1.", x)
        h = hooked(self.self_attn, Attention.forward, hooks, "attn.", h, rope, mask, cache, input_pos, last_only)
        x = hook(hooks, "hook_resid_mid", (x[:, -1:] if last_only else x) + hook(hooks, "hook_attn_out", h))
        h = hooked(self.post_attention_layernorm, RMSNorm.forward, hooks, "ln2.", x)
        h = hook(hooks, "hook_mlp_out", hooked(self.mlp, MLP.forward, hooks, "mlp.", h))
        return hook(hooks, "hook_resid_post", x + h)


ROPE_POSITIONS_UP_FRONT = 1024  # 0.5 MiB of tables at head_dim 64 (the whole window, 8192 positions: 4 MiB, was
# ~1% of the 360M Q4_0 model's resident memory); a cache grows them to its length as it is made (new_cache)


class SmolLM2(nn.Module):
    def __init__(self, config: SmolConfig):
        super().__init__()
        self.config = config
        pad = config.pad_token_id if config.pad_token_id in range(config.vocab_size) else None
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=pad),  # as HF
            layers=nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers)),
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
        ))
        # Tied embeddings: the output projection is the embedding matrix itself, not a copy.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self.activation_checkpointing = False  # training: recompute each block in backward, keep only its input
        # Longer windows grow on demand (extend_rope()), built for the caches made, not the context window.
        for name, table in zip(("rope_cos", "rope_sin"),
                               rope_tables(config, min(config.max_position_embeddings, ROPE_POSITIONS_UP_FRONT))):
            self.register_buffer(name, table, persistent=False)
        self.apply(self._init_weights)

    def extend_rope(self, length: int) -> None:
        """Grow the RoPE tables to at least `length` positions (in doublings, up to the context window)."""
        if self.rope_cos.shape[0] < length:
            length = min(max(length, 2 * self.rope_cos.shape[0]), self.config.max_position_embeddings)
            with torch.inference_mode(False):  # tables of the usual kind, which training can use too
                self.rope_cos, self.rope_sin = rope_tables(self.config, length, self.rope_cos.device)

    def _init_weights(self, module):
        # As transformers: normal(0, initializer_range) for every matrix, zero biases and padding row, unit norms.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden_states(self, input_ids, input_pos=None, cache: KVCache | None = None, attention_mask=None,
                      last_only: bool = False, hooks=None):
        """The final normed hidden states, (B, T, C); with last_only, the last position's, (B, 1, C).

        input_ids: (B, T). input_pos: (T,) or (B, T) positions of these tokens, also their cache slots; default
        0..T-1. attention_mask: (B, S), 0 at padding, over every slot so far (as HF); positions then count real
        tokens only, so left-padded rows get the positions they would alone. last_only: the last block computes
        only the last position (as llama.cpp): every key and value still reaches the cache. hooks: called at
        every hook point (generation/hooks.py's Hooks).
        """
        (B, T), device = input_ids.shape, input_ids.device
        if input_pos is None:
            if T > self.config.max_position_embeddings:
                raise ValueError(f"{T} tokens exceed max_position_embeddings={self.config.max_position_embeddings}")
            input_pos = torch.arange(T, device=device)
        slots, input_pos = input_pos, input_pos.expand(B, T)  # slots: as given, (T,) when rows share them
        positions = input_pos if attention_mask is None else (
            attention_mask.long().cumsum(-1) - 1).clamp(min=0).gather(1, input_pos)

        # None: plain causal over these T tokens, the fast path, also for a prompt that fills a cache (view)
        # of exactly T slots, which it can only do at slots 0..T-1; hooks' explicit softmax needs it written out.
        mask = None
        if attention_mask is not None or (cache is not None and cache.max_len != T) or hooks is not None:
            key_slot = torch.arange(cache.max_len if cache is not None else T, device=device)  # (S,)
            mask = key_slot <= input_pos[..., None]  # (B, T, S) causal over slots, any cached length
            if attention_mask is not None:
                valid = F.pad(attention_mask.bool(), (0, key_slot.numel() - attention_mask.shape[1]))
                # A padding query still sees itself, so no row is fully masked (that would give NaN).
                mask = mask & (valid[:, None, :] | (key_slot == input_pos[..., None]))
            mask = mask[:, None]  # (B, 1, T, S)

        # Every slot of the cache, which bounds every position (a compiled step then never grows the tables).
        self.extend_rope(cache.max_len if cache is not None else int(slots.max()) + 1)
        x = hook(hooks, "hook_embed", self.model.embed_tokens(input_ids))  # (B, T, C)
        rope = (self.rope_cos[positions][:, :, None].to(x.dtype),  # (B, T, 1, hd)
                self.rope_sin[positions][:, :, None].to(x.dtype))
        if hooks is None:
            x = self.blocks(x, rope, mask, cache, slots, last_only)
        else:  # this file's loop (see the top)
            x = SmolLM2.blocks(self, x, rope, mask, cache, slots, last_only, hooks)
        return hooked(self.model.norm, RMSNorm.forward, hooks, "ln_final.", x)

    def blocks(self, x, rope, mask, cache, slots, last_only: bool = False, hooks=None) -> torch.Tensor:
        """The residual stream after every block, one after another (see hidden_states)."""
        for i, block in enumerate(self.model.layers):
            last = last_only and i == len(self.model.layers) - 1
            at = None if hooks is None else hooks.at(f"blocks.{i}.")
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, mask, cache, slots, last, at, use_reentrant=False)
            else:
                x = block(x, rope, mask, cache, slots, last, at)
        return x

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection, (vocab, C): the embedding matrix itself when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.output_weight)  # (B, T, vocab)

    def forward(self, input_ids, input_pos=None, cache: KVCache | None = None, attention_mask=None):
        return self.logits(self.hidden_states(input_ids, input_pos, cache, attention_mask))

    def new_cache(self, batch_size: int, max_len: int, kv_dtype: str | None = None) -> KVCache:
        """An empty cache for these rows and slots, storing kv_dtype: "fp32", "bf16", "int8", or None for the
        model's own dtype (KVCache)."""
        p = self.model.embed_tokens.weight
        kv_dtype = kv_cache_dtype(kv_dtype, p.dtype)
        self.extend_rope(max_len)  # here, not in a (compiled) step that fills the cache
        return KVCache(self.config, batch_size, max_len, device=p.device, dtype=p.dtype, kv_dtype=kv_dtype)
