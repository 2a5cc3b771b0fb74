"""Hook points: the names of model.py's points between operations, where a function may read the activation or
replace it, and the functions a pass calls there. The points are named as TransformerLens names them (SAELens
and most interpretability code expect these names):

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
activation as it is. The pass is model.py's own forward given the hooks (model.hidden_states(..., hooks=)): the
model's own linear layers (quantized, adapted or accelerated, whatever they are) and RoPE tables, model.py's
norms, and attention with an explicit softmax, as transformers' eager attention, so that a pattern is there to
read. A row of the engine that has hooks (Row.hooks) runs this pass, alone; the other rows' passes never see it.
"""

from __future__ import annotations

import collections
import copy
from collections import abc

import torch

from ..errors import SmolError
from ..kv_cache import KVCache

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
    """Functions at hook points, which model.py's forward calls (see the module's docstring)."""

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
        self.prefix = ""  # where model.py's module that holds these is: its points' names are relative to it

    def at(self, prefix: str) -> Hooks:
        """These hooks as a part of the model, `prefix` ("blocks.3.", then "attn."), names its points."""
        part = copy.copy(self)
        part.prefix = self.prefix + prefix
        return part

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x through the functions at point `name` (under this part's prefix), in turn."""
        name = self.prefix + name
        for function in self.functions.get(name, ()):
            replaced = function(x, name)
            if replaced is not None:
                x = replaced
        return x

    def hidden_states(self, model, ids: torch.Tensor, slots: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """model.hidden_states(ids, slots, cache) through these hooks: the final normed hidden states, (B, T, C).
        slots: (T,) or (B, T), the tokens' positions, also their cache slots (default 0..T-1); cache: where their
        keys and values are written, beside those of the earlier slots that they attend to."""
        return model.hidden_states(ids, slots, cache, hooks=self)


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
