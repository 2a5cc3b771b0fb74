"""Hook points: model.py's forward pass written out one operation at a time, with a point between operations
where a function may read the activation or replace it. The points are named as TransformerLens names them
(SAELens and most interpretability code expect these names):

    hook_embed
    blocks.{l}.hook_resid_pre
    blocks.{l}.ln1.hook_scale, blocks.{l}.ln1.hook_normalized          (x / scale, before the norm's weight)
    blocks.{l}.attn.hook_q, hook_k, hook_v                             (batch, pos, heads, head_dim); k and v
    blocks.{l}.attn.hook_rot_q, hook_rot_k                              have the key-value heads; after RoPE
    blocks.{l}.attn.hook_attn_scores, hook_pattern                     (batch, heads, query pos, key slot)
    blocks.{l}.attn.hook_z                                             (batch, pos, heads, head_dim)
    blocks.{l}.hook_attn_out, blocks.{l}.hook_resid_mid
    blocks.{l}.ln2.hook_scale, blocks.{l}.ln2.hook_normalized
    blocks.{l}.mlp.hook_pre (gate), mlp.hook_pre_linear (up), mlp.hook_post (SiLU(gate) * up)
    blocks.{l}.hook_mlp_out, blocks.{l}.hook_resid_post
    ln_final.hook_scale, ln_final.hook_normalized

A function at a point is called as fn(activation, name) and returns a replacement, or None to leave the
activation as it is. The pass calls the model's own linear layers (quantized, adapted or accelerated, whatever
they are) and its RoPE tables; the rest (norms, attention with an explicit softmax, SwiGLU) it computes as
model.py does, up to float rounding: attention as transformers' eager attention, so that a pattern is there to
read. A row of the engine that has hooks (Row.hooks) runs this pass, alone; the other rows' passes never see it.
"""

from __future__ import annotations

import collections
import math
from collections import abc

import torch
import torch.nn.functional as F

from ..errors import SmolError
from ..model import Attention, KVCache

HookFunction = abc.Callable[[torch.Tensor, str], torch.Tensor | None]

BLOCK_POINTS = ("hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k",
                "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern",
                "attn.hook_z", "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized",
                "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")


def point_names(layers: int) -> list[str]:
    """Every hook point of a model of `layers` blocks, in the order a pass reaches them."""
    return ["hook_embed", *(f"blocks.{layer}.{point}" for layer in range(layers) for point in BLOCK_POINTS),
            "ln_final.hook_scale", "ln_final.hook_normalized"]


class Hooks:
    """Functions at hook points, and the forward pass that calls them (see the module's docstring)."""

    def __init__(self, layers: int, hooks: abc.Iterable[tuple[str, HookFunction]] | abc.Mapping[str, HookFunction]):
        """layers: the model's blocks; hooks: (point name, function) pairs, TransformerLens's fwd_hooks, or a dict
        of them; several functions at one point run in the order given, each on what the one before returned."""
        known = set(point_names(layers))
        self.functions: dict[str, list[HookFunction]] = collections.defaultdict(list)
        for pair in hooks.items() if isinstance(hooks, abc.Mapping) else hooks:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise SmolError(f"hooks must be (point name, function) pairs or a dict of them, got {pair!r}")
            name, function = pair
            if name not in known:
                raise SmolError(f"no hook point {name!r} in a model of {layers} blocks: they are hook_embed, "
                                f"blocks.{{0..{layers - 1}}}.{{{', '.join(BLOCK_POINTS)}}}, ln_final.hook_scale and "
                                f"ln_final.hook_normalized")
            if not callable(function):
                raise SmolError(f"the hook at {name!r} is not a function: {function!r}")
            self.functions[name].append(function)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        for function in self.functions.get(name, ()):
            replaced = function(x, name)
            if replaced is not None:
                x = replaced
        return x

    def hidden_states(self, model, ids: torch.Tensor, slots: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """What model.hidden_states(ids, slots, cache) computes, through the hook points: the final normed hidden
        states, (B, T, C). slots: (T,) or (B, T), the tokens' positions, also their cache slots (default 0..T-1);
        cache: where their keys and values are written, beside those of the earlier slots that they attend to."""
        B, T = ids.shape
        slots = torch.arange(T, device=ids.device) if slots is None else slots
        keys = cache.max_len if cache is not None else T
        model.extend_rope(keys)
        positions = slots.expand(B, T)
        visible = (torch.arange(keys, device=ids.device) <= positions[..., None])[:, None]  # (B, 1, T, S)
        dtype = model.model.embed_tokens.weight.dtype
        rope = (model.rope_cos[positions][:, :, None].to(dtype), model.rope_sin[positions][:, :, None].to(dtype))
        x = self("hook_embed", model.model.embed_tokens(ids))
        for layer, block in enumerate(model.model.layers):
            x = self.block(f"blocks.{layer}.", block, x, rope, visible, cache, slots)
        return self.norm("ln_final.", model.model.norm, x)

    def block(self, at: str, block, x, rope, visible, cache, slots) -> torch.Tensor:
        x = self(at + "hook_resid_pre", x)
        h = self.norm(at + "ln1.", block.input_layernorm, x)
        x = self(at + "hook_resid_mid", x + self(at + "hook_attn_out",
                                                 self.attention(at + "attn.", block.self_attn, h, rope, visible,
                                                                cache, slots)))
        h, mlp = self.norm(at + "ln2.", block.post_attention_layernorm, x), block.mlp
        gate, up = self(at + "mlp.hook_pre", mlp.gate_proj(h)), self(at + "mlp.hook_pre_linear", mlp.up_proj(h))
        out = self(at + "hook_mlp_out", mlp.down_proj(self(at + "mlp.hook_post", F.silu(gate) * up)))
        return self(at + "hook_resid_post", x + out)

    def norm(self, at: str, norm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm, in float32 as model.py's; TransformerLens's points: the scale, sqrt(mean(x^2) + eps), and x
        divided by it, before the weight."""
        h = x.float()
        scale = self(at + "hook_scale", (h.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt())
        return norm.weight * self(at + "hook_normalized", (h / scale).to(x.dtype))

    def attention(self, at: str, attn, x, rope, visible, cache, slots) -> torch.Tensor:
        B, T, _ = x.shape
        q = self(at + "hook_q", attn.q_proj(x).view(B, T, attn.n_heads, attn.head_dim))
        k = self(at + "hook_k", attn.k_proj(x).view(B, T, attn.n_kv, attn.head_dim))
        v = self(at + "hook_v", attn.v_proj(x).view(B, T, attn.n_kv, attn.head_dim))
        q, k = self(at + "hook_rot_q", Attention.rotate(q, *rope)), self(at + "hook_rot_k", Attention.rotate(k, *rope))
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            k, v = cache.update(attn.layer, slots, k, v)  # every slot so far, (B, n_kv, S, hd)
        group = attn.n_heads // attn.n_kv  # query heads that share a key-value head, next to each other
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q.transpose(1, 2) @ k.transpose(2, 3)) * attn.head_dim ** -0.5  # (B, nh, T, S)
        scores = self(at + "hook_attn_scores", scores.masked_fill(~visible, -math.inf))
        pattern = self(at + "hook_pattern", torch.softmax(scores.float(), dim=-1).to(q.dtype))
        z = self(at + "hook_z", (pattern @ v).transpose(1, 2))  # (B, T, nh, hd)
        return attn.o_proj(z.reshape(B, T, attn.n_heads * attn.head_dim))


def steering(config, layer: int, vector: torch.Tensor) -> list[tuple[str, HookFunction]]:
    """The hook that adds `vector`, (hidden_size,), to the residual stream entering block `layer`, at every
    position: prompt and answer alike."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < config.num_hidden_layers:
        raise SmolError(f"the steering layer must be a block, 0 to {config.num_hidden_layers - 1}, got {layer!r}")
    if not isinstance(vector, torch.Tensor) or vector.shape != (config.hidden_size,) \
            or not bool(vector.isfinite().all()):
        raise SmolError(f"a steering vector must be a tensor of {config.hidden_size} finite numbers, got "
                        f"{tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__}")
    return [(f"blocks.{layer}.hook_resid_pre", lambda x, name: x + vector.to(x))]
