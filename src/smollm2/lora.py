"""LoRA: a trainable low-rank update beside each targeted linear layer of a frozen model; QLoRA when that
layer is int8 (quantize.py). Saved and loaded in PEFT's format (checkpoints/peft.py).

Like quantize_int8, a module swap applied from outside. It comes before smollm2.accelerate, whose fast
modules read the linear layers' weights directly: to run an adapter fast, merge it first (merge(), or
smollm2.load(..., adapter=DIR), which merges as it loads).
"""

from __future__ import annotations

import math
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoints.peft import Adapter, merged, read_adapter, write_adapter
from .errors import SmolError
from .quantize import Int8Linear

DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for llama models
BASES = (nn.Linear, Int8Linear)


class LoRALinear(nn.Module):
    """base(x) + (alpha / r) * B(A(dropout(x))), with base frozen. Named as PEFT names its layers, so the state
    dict's keys are PEFT's without its prefix."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        out_features, in_features = base.weight.shape
        # an int8 base keeps its float dtype in its scales
        dtype = next(t.dtype for t in (*base.parameters(), *base.buffers()) if t.is_floating_point())
        self.base_layer = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.lora_dropout = nn.Dropout(dropout)
        # nn.Linear's own initialisation, kaiming-uniform with a=sqrt(5), is PEFT's for A
        self.lora_A = nn.Linear(in_features, r, bias=False, device=base.weight.device, dtype=dtype)
        self.lora_B = nn.Linear(r, out_features, bias=False, device=base.weight.device, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)  # so the model starts as the base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def linear_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Each block's linear layer, adapted or not (model.layers.0.self_attn.q_proj) -> its weight's shape."""
    return {name.removesuffix(".base_layer"): module.weight.shape for name, module in model.named_modules()
            if name.startswith("model.layers.") and isinstance(module, BASES)}


def add_lora(model: nn.Module, r: int = 8, alpha: float = 8.0, targets=DEFAULT_TARGETS,
             dropout: float = 0.0) -> nn.Module:
    """Freeze every weight of `model` and wrap the linear layers named `targets` (q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj) of every block in LoRALinear, in place. The defaults are PEFT's."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise SmolError("the model has LoRA adapters already; merge them first")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise SmolError(f"LoRA r must be a whole number >= 1, got {r!r}")
    if not math.isfinite(alpha):
        raise SmolError(f"LoRA alpha must be a finite number, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise SmolError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    known = {name.rpartition(".")[2] for name in linear_shapes(model)}
    for target in targets:
        if target not in known:
            raise SmolError(f"LoRA target {target!r} is not a linear layer of the model's blocks "
                            f"({', '.join(sorted(known))})")
    chosen = [(module, name, child) for block in model.model.layers for module in block.modules()
              for name, child in module.named_children() if name in targets]
    for _, _, child in chosen:
        if type(child) not in BASES:  # smollm2.accelerate's modules read the weight itself, not through forward
            raise SmolError(f"cannot add LoRA to a {type(child).__name__}: add it before smollm2.accelerate "
                            "(smollm2.load(..., kernels=False))")
    model.requires_grad_(False)
    for module, name, child in chosen:
        setattr(module, name, LoRALinear(child, r, alpha, dropout))
    return model


def adapter_of(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> Adapter:
    """The model's adapter: its settings, and its tensors from `state_dict` (default: the model's own; a
    training loop passes the one it gathered across processes)."""
    found = {name.rpartition(".")[2]: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not found:
        raise SmolError("the model has no LoRA adapters")
    first = next(iter(found.values()))  # add_lora gives every one the same settings
    tensors = {name: t for name, t in (state_dict or model.state_dict()).items()
               if name.endswith((".lora_A.weight", ".lora_B.weight"))}
    return Adapter(first.r, first.alpha, first.lora_dropout.p, sorted(found), tensors)


def save_adapter(model: nn.Module, path: str | Path, base: str | None = None,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the model's adapter in PEFT's format; base: the base model's name or path, where known."""
    write_adapter(path, adapter_of(model, state_dict), base)


def read_for(model: nn.Module, path: str | Path) -> Adapter:
    """The adapter at `path`, checked against `model`'s layers before any of its tensors is read."""
    return read_adapter(path, linear_shapes(model))


def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Add the adapter at `path` (PEFT's format) to `model` (float or int8 linear layers), unmerged, in place."""
    adapter = read_for(model, path)
    add_lora(model, adapter.r, adapter.alpha, adapter.targets, adapter.dropout)
    model.load_state_dict(adapter.tensors, strict=False)  # the adapter's tensors alone, every one checked
    return model


@torch.no_grad()
def with_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """A copy of `model` with the adapter at `path` merged into the layers it adapts. Every other tensor is the
    base's own, shared, not copied: each adapter served over one base costs its adapted layers alone. The copy
    may be accelerated as the base is (the merged layers' GGUF blocks, which hold the base's weights, go)."""
    adapter = read_for(model, path)
    adapted = {name.removesuffix(".lora_A.weight") for name in adapter.tensors if name.endswith(".lora_A.weight")}
    shared = {id(t): t for name, t in (*model.named_parameters(), *model.named_buffers())
              if name.rpartition(".")[0] not in adapted}
    copy = deepcopy(model, memo=shared)
    for name in adapted:
        layer = copy.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise SmolError(f"cannot merge LoRA into a {type(layer).__name__}: merging needs a float base")
        weight = merged(layer.weight, adapter.tensors[f"{name}.lora_A.weight"],
                        adapter.tensors[f"{name}.lora_B.weight"], adapter.scaling)
        layer.weight = nn.Parameter(weight, requires_grad=False)
    return copy


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer's weight and put the base layer back in its place, in place.

    An int8 base cannot take the update without rounding it away: load the adapter onto the float model
    instead, merge, then quantize."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                base = child.base_layer
                if not isinstance(base, nn.Linear):
                    raise SmolError(f"cannot merge LoRA into a {type(base).__name__}: merging needs a float base; "
                                    "load the adapter onto the unquantized model, merge, then quantize")
                # a new parameter, not an in-place change, so nothing keeps a copy of the old weight for it
                base.weight = nn.Parameter(merged(base.weight, child.lora_A.weight, child.lora_B.weight,
                                                  child.scaling), requires_grad=False)
                setattr(module, name, base)
    return model
