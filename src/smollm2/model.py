"""SmolLM2: a LLaMA-architecture decoder-only transformer, read top to bottom.

    tokens -> embed -> N x [RMSNorm -> attention (RoPE, grouped-query, KV cache) -> +residual
                            RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> tied lm_head -> logits

Module and parameter names are exactly transformers' LlamaForCausalLM's, so a HF state dict loads as is.
Numerics follow transformers: norms and softmax accumulate in float32; RoPE angles come from integer
positions in float32 whatever the model dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from . import kernels
from .config import SmolConfig
from .errors import SmolError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, lambda: self.plain(x))  # a CPU prompt: one pass, not six

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        # Accumulate in float32: bf16 squares lose most of their digits.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(config: SmolConfig, length: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1 (default: every position), (length, head_dim), float32.

    Positions are integers turned into float32 (exact up to 2**24); bf16 cannot count past 256.
    """
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    positions = torch.arange(config.max_position_embeddings if length is None else length, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (P, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, hd): non-interleaved halves, as HF
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, heads, hd); cos, sin: (B, T, 1, hd). Rotate-half layout: pairs are (i, i + hd/2).
    def plain():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return kernels.rope(x, cos, sin, plain)  # a prompt on the CPU: one pass, not five


class KVCache:
    """A static cache: every layer's keys and values, (L, B, n_kv, max_len, hd) each, written in place at each
    token's position. Nothing is re-copied per token; slot s of row b holds position s of that row's sequence."""

    def __init__(self, config: SmolConfig, batch_size: int, max_len: int, device=None, dtype=None):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def view(self, rows: slice = slice(None), length: int | None = None) -> KVCache:
        """These rows and the first `length` slots, sharing storage: writes land in this cache, and attention
        reads only those slots instead of the whole window."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, rows, :, :length], self.v[:, rows, :, :length]
        return view

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # k, v: (B, T, n_kv, hd) written at (b, :, input_pos[b, t]), or input_pos[t] for every row when it is
        # (T,) (one copy, cheaper than scattering); returns the layer's whole (B, n_kv, S, hd).
        keys, values = self.k[layer], self.v[layer]
        if input_pos.dim() == 1:
            keys.index_copy_(2, input_pos, k.transpose(1, 2))
            values.index_copy_(2, input_pos, v.transpose(1, 2))
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            keys[rows, :, input_pos] = k
            values[rows, :, input_pos] = v
        return keys, values


def project(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """The outputs of linear layers (nn.Linear, or int8 ones with a .scale) of one input x; when decoding
    on the CPU, their weights stream through one kernel call (q, k and v: one pass, not three)."""
    ys = kernels.linear(x, [layer.weight for layer in layers], [getattr(layer, "scale", None) for layer in layers])
    return [y if layer.bias is None else y + layer.bias for y, layer in zip(ys, layers)]


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)[0]


class Attention(nn.Module):
    def __init__(self, config: SmolConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv = layer, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.n_kv * hd, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.n_kv * hd, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, config.hidden_size, bias=bias)

    def forward(self, x, rope, mask, cache: KVCache | None, input_pos, last_only: bool = False):
        B, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
        v = v.view(B, T, self.n_kv, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, n_kv, T, hd)
        else:
            k, v = cache.update(self.layer, input_pos, k, v)  # (B, n_kv, S, hd)
        if last_only:  # every key is written; the last query alone sees them all, and needs no causal mask
            q, mask = q[:, -1:], None if mask is None else mask[:, :, -1:]

        def plain():  # enable_gqa shares each K/V head with its group of query heads without copying them.
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                               is_causal=mask is None and not last_only,
                                               enable_gqa=self.n_kv != self.n_heads)
            return y.transpose(1, 2)  # (B, T, nh, hd)

        y = plain() if mask is not None else kernels.prompt_attention(q, k, v, plain)  # a CPU prompt: the causal half
        return self.o_proj(y.reshape(B, q.shape[1], self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: SmolConfig):
        super().__init__()
        c, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(c, i, bias=bias)
        self.up_proj = Linear(c, i, bias=bias)
        self.down_proj = Linear(i, c, bias=bias)

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(kernels.silu_mul(gate, up, lambda: F.silu(gate) * up))  # SwiGLU; a CPU prompt: one pass


class Block(nn.Module):
    def __init__(self, config: SmolConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, cache, input_pos, last_only: bool = False):
        h = self.self_attn(self.input_layernorm(x), rope, mask, cache, input_pos, last_only)
        x = (x[:, -1:] if last_only else x) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class WithoutRandomInit(TorchFunctionMode):
    """Modules built inside skip drawing their random initial weights, which stay allocated but untouched
    (no resident memory, no time). Unlike building on the meta device, which runs torch's reference
    implementations of those draws and of the RoPE tables, and so imports its compiler stack (~75 MB)."""

    DRAWS = (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_)  # what nn.Linear, nn.Embedding and we call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DRAWS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


ROPE_POSITIONS_UP_FRONT = 8192  # SmolLM2's whole context window: 4 MB of tables


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
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.activation_checkpointing = False  # training: recompute each block in backward, keep only its input
        # Longer windows grow on demand (extend_rope()): millions of positions would take gigabytes up front.
        cos, sin = rope_tables(config, min(config.max_position_embeddings, ROPE_POSITIONS_UP_FRONT))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def parameter_shapes(config: SmolConfig) -> dict[str, torch.Size]:
        """The state dict's shapes, from the config alone: a checkpoint is checked against them before any
        module is built, so sizes it got wrong never turn into allocations."""
        c, i = config.hidden_size, config.intermediate_size
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        block = {"input_layernorm.weight": (c,), "post_attention_layernorm.weight": (c,),
                 "self_attn.q_proj.weight": (q, c), "self_attn.k_proj.weight": (kv, c),
                 "self_attn.v_proj.weight": (kv, c), "self_attn.o_proj.weight": (c, q),
                 "mlp.gate_proj.weight": (i, c), "mlp.up_proj.weight": (i, c), "mlp.down_proj.weight": (c, i)}
        if config.attention_bias:
            block |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                      "self_attn.o_proj.bias": (c,)}
        if config.mlp_bias:
            block |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (c,)}
        shapes = {"model.embed_tokens.weight": (config.vocab_size, c), "model.norm.weight": (c,)}
        shapes |= {f"model.layers.{n}.{name}": shape for n in range(config.num_hidden_layers)
                   for name, shape in block.items()}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, c)
        return {name: torch.Size(shape) for name, shape in shapes.items()}

    def extend_rope(self, length: int) -> None:
        """Grow the RoPE tables to at least `length` positions (in doublings, up to the context window)."""
        if self.rope_cos.shape[0] >= length:
            return
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
                      last_only: bool = False):
        """The final normed hidden states, (B, T, C); with last_only, the last position's, (B, 1, C).

        input_ids: (B, T). input_pos: (T,) or (B, T) positions of these tokens, which are also their cache
        slots; default 0..T-1. attention_mask: (B, S) with 0 at padding, over every slot so far (as HF);
        positions then count real tokens only, so left-padded rows get the positions they would alone.
        last_only: the last block computes its attention and MLP for the last position alone (llama.cpp does the
        same): every other position's keys and values still reach the cache, and next-token logits need no more.
        """
        B, T = input_ids.shape
        device = input_ids.device
        if input_pos is None:
            if T > self.config.max_position_embeddings:
                raise ValueError(f"{T} tokens exceed max_position_embeddings={self.config.max_position_embeddings}")
            input_pos = torch.arange(T, device=device)
        slots, input_pos = input_pos, input_pos.expand(B, T)  # slots: as given, (T,) when rows share them
        positions = input_pos
        if attention_mask is not None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).gather(1, input_pos)

        # None: plain causal over these T tokens, the fast path, also for a prompt that fills a cache (view)
        # of exactly T slots, which it can only do at slots 0..T-1.
        mask = None
        if attention_mask is not None or (cache is not None and cache.max_len != T):
            key_slot = torch.arange(cache.max_len if cache is not None else T, device=device)  # (S,)
            mask = key_slot <= input_pos[..., None]  # (B, T, S) causal over slots, any cached length
            if attention_mask is not None:
                valid = F.pad(attention_mask.bool(), (0, key_slot.numel() - attention_mask.shape[1]))
                # A padding query still sees itself, so no row is fully masked (that would give NaN).
                mask = mask & (valid[:, None, :] | (key_slot == input_pos[..., None]))
            mask = mask[:, None]  # (B, 1, T, S)

        # Every slot of the cache, which bounds every position (a compiled step then never grows the tables).
        self.extend_rope(cache.max_len if cache is not None else T if input_pos is None else int(slots.max()) + 1)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        rope = (self.rope_cos[positions][:, :, None].to(x.dtype),  # (B, T, 1, hd)
                self.rope_sin[positions][:, :, None].to(x.dtype))
        if cache is not None and (y := kernels.blocks(self.model.layers, x, rope, mask, cache, slots,
                                                      lambda: self.blocks(x, rope, mask, cache, slots))) is not None:
            return self.model.norm(y[:, -1:] if last_only else y)  # a few rows on the CPU: one kernel call
        return self.model.norm(self.blocks(x, rope, mask, cache, slots, last_only))

    def blocks(self, x, rope, mask, cache, slots, last_only: bool = False) -> torch.Tensor:
        """The residual stream after every block, one after another (see hidden_states)."""
        for i, block in enumerate(self.model.layers):
            last = last_only and i == len(self.model.layers) - 1
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, mask, cache, slots, last, use_reentrant=False)
            else:
                x = block(x, rope, mask, cache, slots, last)
        return x

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection, (vocab, C): the embedding matrix itself when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return kernels.linear(h, [self.output_weight])[0]  # (B, T, vocab)

    def forward(self, input_ids, input_pos=None, cache: KVCache | None = None, attention_mask=None):
        return self.logits(self.hidden_states(input_ids, input_pos, cache, attention_mask))

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        p = self.model.embed_tokens.weight
        self.extend_rope(max_len)  # here, not in a (compiled) step that fills the cache
        return KVCache(self.config, batch_size, max_len, device=p.device, dtype=p.dtype)

    # Loading, saving and generating live in checkpoints/ and generation/; these are the front doors.

    @classmethod
    def from_pretrained(cls, src: str | Path | None = None, dtype=torch.float32, device="cpu") -> SmolLM2:
        """src: a HF directory, a .gguf file, a hub id, or None for the embedded SmolLM2-135M-Instruct."""
        from .checkpoints import load_checkpoint

        # Even under inference_mode, weights of the usual kind: they can be trained, and their changes are seen.
        with torch.inference_mode(False):
            ckpt = load_checkpoint(src, dtype, blocks=torch.device(device).type == "cpu")  # for the kernels
            ckpt.check(cls.parameter_shapes(ckpt.config))
            with WithoutRandomInit():  # every weight is replaced below
                model = cls(ckpt.config)
            model.load_state_dict(ckpt.tensors, strict=True, assign=True)  # already in dtype
            model.to(device).eval()
            for name, (kind, blocks) in ckpt.blocks.items():
                kernels.keep_blocks(model.get_parameter(name), kind, blocks)
            return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors that transformers' from_pretrained loads."""
        from .checkpoints import save_hf

        state = self.state_dict()
        if not all(t.is_floating_point() for t in state.values()):
            raise SmolError("a quantized model cannot be saved as a HF checkpoint; save it before quantizing")
        save_hf(self.config, state, path)

    def generate(self, input_ids, max_new_tokens: int = 128, **kwargs):
        """See smollm2.generation.generate."""
        from .generation import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids, max_new_tokens: int = 128, **kwargs):
        """See smollm2.generation.stream."""
        from .generation import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)
