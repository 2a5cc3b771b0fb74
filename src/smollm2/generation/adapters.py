"""LoRA adapters served over one base model, rows of different adapters (and of the base) in one pass, as vLLM's
punica kernels batch them: every linear layer's base product once for all the rows, then each row's own low-rank
update, x A_i^T (s B_i)^T, added (Pass: the engine selects each pass's rows' adapters, the layers read them).

An adapter is held as its A and B matrices alone (the model's dtype, B scaled), never merged into a copy of the
weights. The engine runs a pass on the base model itself where no row has an adapter (the accelerator's whole-step
decode kernel, where it runs, the same bits as without adapters), and on `adapted` where one does: a copy of the
model sharing every tensor, whose blocks' linear layers are AdaptedLinear wrappers, each its own forward (the
accelerator's per-layer products, then the update), except in a decoding step the accelerator's whole-step kernel
runs: it streams the wrappers' bases and adds each adapter row's update itself (Pass.updates), its base rows'
bits those of the base model's own step. Against the model with the adapter merged (lora.with_adapter)
the answers agree to float rounding, not to the bit: merging rounds W + s B A once, here the update is a
product of its own (tests/test_adapters.py states the tolerance).
"""

from __future__ import annotations

import copy
import ctypes
from collections import abc
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..kernels import ops
from ..lora import read_for

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(eq=False)
class LoRA:
    """A loaded adapter: its name, where it was read from, and per adapted layer (model.layers.0.self_attn.q_proj)
    A^T, (in, r), and (scaling * B)^T, (r, out). Rows hold it (Row.adapter), so unloading it frees it once the last
    row using it has ended."""
    name: str
    path: str
    rank: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers.values() for t in pair)


def read_lora(model: nn.Module, name: str, path: str | Path) -> LoRA:
    """The adapter at `path` (PEFT's format), checked against `model`'s layers (checkpoints/peft.py: one SmolError
    line for a bad one), in the model's float dtype and on its device: its memory is its matrices'."""
    adapter = read_for(model, path)
    weight = model.model.embed_tokens.weight
    layers = {}
    for key, a in adapter.tensors.items():
        if key.endswith(".lora_A.weight"):
            layer = key.removesuffix(".lora_A.weight")
            b = adapter.tensors[f"{layer}.lora_B.weight"]
            layers[layer] = (a.to(weight.device, weight.dtype).t().contiguous(),
                             (b.float() * adapter.scaling).to(weight.device, weight.dtype).t().contiguous())
    return LoRA(name, str(path), adapter.r, layers)


class Pass:
    """The adapters of the pass being run, per adapted layer as punica's segmented products, on the CPU as two
    dense ones: the A^T of every adapter of the pass that adapts the layer side by side, (in, R), every row's
    input multiplied by all of them at once, each row then keeping its own adapter's columns (a 0/1 mask, (B, R):
    a row without one keeps none, its update exactly 0), multiplied by their (s B)^T stacked, (R, out). Two
    products of the whole batch, not one per adapter: at decoding's few rows, the products' calls cost more than
    their arithmetic."""

    def __init__(self, layers: int):
        self.layers = layers
        self.adapters: tuple[LoRA, ...] = ()  # the last pass's, in its order
        self.joined: dict[str, tuple[tuple[LoRA, ...], torch.Tensor, torch.Tensor]] = {}  # layer -> its adapters,
        # their A^T side by side and (s B)^T stacked
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # layer -> A^T, (s B)^T, mask
        self.stacked: tuple[ctypes.Array, list[torch.Tensor]] | None = None  # the decoding step's, once asked for
        self.index = torch.empty(0, dtype=torch.int32)  # each row's adapter among self.adapters, -1: none

    def select(self, row_adapters: abc.Sequence[LoRA | None], device: torch.device) -> None:
        """Each row's mask for every layer; the joined matrices are rebuilt only when the pass's adapters differ
        from the last's (a server's mix changes as requests come and go, not every pass)."""
        adapters = tuple(dict.fromkeys(a for a in row_adapters if a is not None))
        if adapters != self.adapters:
            self.adapters, self.joined, self.stacked = adapters, joined(adapters), None
        self.index = torch.tensor([-1 if a is None else adapters.index(a) for a in row_adapters], dtype=torch.int32)
        masks, self.rows = {}, {}
        for layer, (among, a, b) in self.joined.items():
            if among not in masks:  # the layers adapted by the same adapters share one
                masks[among] = mask(row_adapters, among, device, a.dtype)
            self.rows[layer] = a, b, masks[among]


    def updates(self) -> tuple[ctypes.Array, torch.Tensor]:
        """The pass's updates as the accelerator's decoding step adds them (FastSmolLM2.updates): a LowRank per
        block, each row's adapter among them. Stacked on the first step of a mix of adapters, kept while it
        lasts."""
        if self.stacked is None:
            self.stacked = stacked(self.adapters, self.layers)
        return self.stacked[0], self.index


def stacked(adapters: tuple[LoRA, ...], layers: int) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """Per block an ops.LowRank: per linear layer some adapter adapts, every adapter's A, (r, in), and (s B)^T,
    (r, out), stacked in float32, zeros for one that does not adapt it and past one's rank (0 + 0 x: its row's
    update is 0); with the tensors it points into."""
    out, kept = (ops.LowRank * layers)(), []
    for i in range(layers):
        for j, name in enumerate(LINEARS):
            layer = f"model.layers.{i}.{'self_attn' if j < 4 else 'mlp'}.{name}"
            held = [a.layers[layer] for a in adapters if layer in a.layers]
            if not held:
                continue
            r, (a_t, b_t) = max(a.shape[1] for a, _ in held), held[0]
            a = torch.zeros(len(adapters), r, a_t.shape[0])
            b = torch.zeros(len(adapters), r, b_t.shape[1])
            for n, adapter in enumerate(adapters):
                if layer in adapter.layers:
                    a_t, b_t = adapter.layers[layer]
                    a[n, :a_t.shape[1]], b[n, :b_t.shape[0]] = a_t.t(), b_t
            out[i].a[j], out[i].b[j], out[i].r[j] = a.data_ptr(), b.data_ptr(), r
            kept += [a, b]
    return out, kept


def joined(adapters: tuple[LoRA, ...]) -> dict[str, tuple[tuple[LoRA, ...], torch.Tensor, torch.Tensor]]:
    """Per layer some adapter adapts: those adapters, their A^T side by side and their (s B)^T stacked."""
    out = {}
    for layer in sorted({layer for a in adapters for layer in a.layers}):
        among = tuple(a for a in adapters if layer in a.layers)
        out[layer] = (among, torch.cat([a.layers[layer][0] for a in among], 1),
                      torch.cat([a.layers[layer][1] for a in among], 0))
    return out


def mask(row_adapters: abc.Sequence[LoRA | None], among: tuple[LoRA, ...], device, dtype) -> torch.Tensor:
    """(B, 1, R): 1 over the columns of each row's adapter among `among`, else 0."""
    ends = torch.tensor([a.rank for a in among]).cumsum(0).tolist()
    spans = {a: (end - a.rank, end) for a, end in zip(among, ends)}
    out = torch.zeros(len(row_adapters), 1, ends[-1], dtype=dtype)
    for b, adapter in enumerate(row_adapters):
        if adapter in spans:
            out[b, 0, slice(*spans[adapter])] = 1
    return out.to(device)


class AdaptedLinear(nn.Module):
    """A linear layer of the adapted copy: its base's product for every row, then each row's update from the
    current Pass (none where no adapter of the pass adapts this layer)."""

    def __init__(self, base: nn.Module, name: str, current: Pass):
        super().__init__()
        self.base, self.name, self.current = base, name, current

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (B, T, out)
        rows = self.current.rows.get(self.name)
        if rows is None:
            return y
        a, b, keep = rows
        update = (x @ a).mul_(keep)  # (B, T, R): each row's own adapter's columns
        return y.view(-1, y.shape[-1]).addmm_(update.view(-1, update.shape[-1]), b).view(y.shape)


class Adapters:
    """The adapters one engine serves over its model, by name, and the adapted copy its passes with adapter rows
    run on. Loading and unloading happen on the server's event loop (the engine thread only sees the LoRA each
    row holds); a row keeps its LoRA to its end, whatever is unloaded meanwhile."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.loaded: dict[str, LoRA] = {}
        self.current = Pass(len(model.model.layers))
        # The copy shares every parameter and buffer, a GGUF file's blocks among them; what running it changes is
        # its own (its accelerator's plans and choices, its RoPE tables as they grow). Each block's linear layers
        # are wrapped, which the accelerator's whole-step kernel and fused MLP leave to their own forward.
        self.adapted = copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})
        for i, block in enumerate(self.adapted.model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, child in list(owner.named_children()):
                    if name in LINEARS:
                        full = f"model.layers.{i}.{'self_attn' if owner is block.self_attn else 'mlp'}.{name}"
                        setattr(owner, name, AdaptedLinear(child, full, self.current))
        if "accelerator" in vars(self.adapted):  # its decoding step adds the updates itself (kernels/accelerate.py)
            self.adapted.updates = self.current.updates

    def model_for(self, row_adapters: abc.Sequence[LoRA | None]) -> nn.Module:
        """The model a pass of rows with these adapters runs on: the base itself where none has one."""
        if all(a is None for a in row_adapters):
            return self.model
        self.current.select(row_adapters, self.model.model.embed_tokens.weight.device)
        return self.adapted
