"""Speed applied from outside: accelerate(model) turns model.py's reference modules, in place, into ones that run
the CPU kernels (kernels/__init__.py) wherever they are the faster on this machine, and gives the model a
decoding step that runs every block in one kernel call. Parameters, state dict and results (to float rounding,
see tests/test_fast_paths.py) stay the reference's; model.py knows nothing of it.

Each fast module is its reference class with one method replaced, so training, saving, hooks and isinstance
checks see the same modules. What the kernels keep beside the weights is kept on the modules:
- `packed`: a float32 weight read from GGUF keeps the file's packed blocks as a non-persistent buffer on its
  module, and the kernels stream those (4-5x fewer bytes, the same float32 values) while the weight is unchanged;
- the decoding step's plan (where each block's weights are, for C) is built once per dtype and kept on the
  model. It is rebuilt when a weight (or any parameter, buffer or module) was assigned anywhere since, which
  torch's registration hooks count, or when one of its tensors changed in place (trained, loaded into): each
  step compares their version counters (~30 us for 30 blocks). Moving the model (.to(), .half()) drops it.
  Changes through `.data` are not seen: assign new weights instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import MLP, Attention, RMSNorm, SmolLM2
from ..quantize import Int8Linear
from . import (LINEARS, MAX_HEAD_DIM, MAX_ROWS, TYPES, WEIGHT_FORMATS, BlockWeights, Packed, choices, compiled,
               streamed, streams)
from . import blocks as kernel_blocks
from . import linear as kernel_linear
from . import prompt_attention, rms_norm, rope, silu_mul


def version(t: torch.Tensor) -> int:
    """Counts t's in-place changes (inference tensors count none)."""
    return -1 if t.is_inference() else t._version


def attach_packed(module: nn.Module, packed: Packed) -> None:
    """Let the kernels stream module.weight from GGUF's packed copy of it, while the weight stays as it is."""
    if streams(module.weight, packed):
        module.register_buffer("packed", packed.data, persistent=False)
        module.packed_type, module.packed_from = packed.type, (module.weight, version(module.weight))


def packed_of(module: nn.Module) -> Packed | None:
    """The packed copy of module.weight, or None: it has none, or the weight has changed since (then it is
    dropped)."""
    data = module._buffers.get("packed")
    if data is None:
        return None
    weight, (source, source_version) = module.weight, module.packed_from
    if weight is not source or version(weight) != source_version or weight.device != data.device:
        module.packed = None
        return None
    return Packed(module.packed_type, data)


def products(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """The outputs of linear layers (nn.Linear, or Int8Linear with its .scale) of one input x: on the kernel,
    their weights stream in one pass (gate and up: one pass, not two)."""
    ys = kernel_linear(x, [m.weight for m in linears], [getattr(m, "scale", None) for m in linears],
                       [packed_of(m) for m in linears])
    return [y if m.bias is None else y + m.bias for y, m in zip(ys, linears)]


class FastLinear(nn.Linear):
    def forward(self, x):
        return products(x, self)[0]


class FastInt8Linear(Int8Linear):
    def forward(self, x):
        return products(x, self)[0]


class FastRMSNorm(RMSNorm):
    def forward(self, x):  # a prompt: one pass, not six
        return rms_norm(x, self.weight, self.eps, lambda: super(FastRMSNorm, self).forward(x))


class FastAttention(Attention):
    def rotate(self, x, cos, sin):  # a prompt: one pass, not five
        return rope(x, cos, sin, lambda: Attention.rotate(x, cos, sin))

    def attend(self, q, k, v, mask, is_causal: bool):  # a prompt: the causal half of the scores, not all
        plain = lambda: super(FastAttention, self).attend(q, k, v, mask, is_causal)  # noqa: E731
        return prompt_attention(q, k, v, plain) if is_causal else plain()


class FastMLP(MLP):
    def forward(self, x):  # gate and up in one pass, then SiLU*up in one
        gate, up = products(x, self.gate_proj, self.up_proj)
        return self.down_proj(silu_mul(gate, up, lambda: F.silu(gate) * up))


# Parameters, buffers and submodules registered (assigned) on any module since import, counted by torch's global
# registration hooks: one number that moves whenever a model's structure or weights are replaced, so that a plan
# can tell it still holds without walking the model each step.
registrations = 0


def count_registration(*_):
    global registrations
    registrations += 1


for register in (nn.modules.module.register_module_parameter_registration_hook,
                 nn.modules.module.register_module_buffer_registration_hook,
                 nn.modules.module.register_module_module_registration_hook):
    register(count_registration)


class DecodePlan:
    """The C view of every block's weights (struct block), for one activation dtype, with the tensors it was
    built from: it holds while nothing was assigned to any module since, and none of them changed in place."""

    def __init__(self, model: SmolLM2, dtype: torch.dtype):
        found = [block_weights(block, dtype) for block in model.model.layers]
        self.weights = None if None in found else (BlockWeights * len(found))(*(f[0] for f in found))
        self.kept = [f[1] for f in found if f is not None]  # the float32 scales that weights point into
        self.tensors = tensors_of(model)
        self.versions, self.registrations = versions(self.tensors), registrations

    def holds(self) -> bool:
        return registrations == self.registrations and versions(self.tensors) == self.versions


def block_linears(block) -> list[nn.Module]:
    attn, mlp = block.self_attn, block.mlp
    return [getattr(attn, name) for name in LINEARS[:4]] + [getattr(mlp, name) for name in LINEARS[4:]]


def tensors_of(model: SmolLM2) -> list[torch.Tensor]:
    """Every parameter and buffer of the blocks' norms and linear layers: what a decoding step's plan points at."""
    modules = [m for block in model.model.layers for m in (block.input_layernorm, block.post_attention_layernorm,
                                                           *block_linears(block))]
    return [t for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """[version(t) for t in tensors], in a third of the time when none is an inference tensor (the usual case)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # one is: it counts no changes
        return [version(t) for t in tensors]


def block_weights(block, dtype: torch.dtype) -> tuple[BlockWeights, list] | None:
    """The C view of a block's weights (and the float32 scales it points into), or None where the kernel
    cannot run the block: biases, mixed weight types, sizes off its multiples of 16."""
    norms, linears = [block.input_layernorm, block.post_attention_layernorm], block_linears(block)
    attn = block.self_attn
    C, D, I = attn.o_proj.weight.shape[0], attn.head_dim, block.mlp.down_proj.weight.shape[1]
    w_type = linears[0].weight.dtype
    if not (C % 16 == 0 and I % 16 == 0 and D % 16 == 0 and D <= MAX_HEAD_DIM and w_type in (dtype, torch.int8)
            and all(m.bias is None and m.weight.dtype == w_type and m.weight.is_contiguous()
                    and m.weight.device.type == "cpu" for m in linears)
            and all(n.weight.dtype == dtype for n in norms)):
        return None
    scales = [None if getattr(m, "scale", None) is None else m.scale.float().contiguous() for m in linears]
    kind, addresses = streamed([m.weight for m in linears], [packed_of(m) for m in linears])
    return (BlockWeights(*(n.weight.data_ptr() for n in norms), *addresses,
                         *(None if s is None else s.data_ptr() for s in scales), kind, C, attn.n_heads, attn.n_kv, D,
                         I, norms[0].eps), scales)


class FastSmolLM2(SmolLM2):
    def blocks(self, x, rope, mask, cache, slots, last_only: bool = False):
        """A decoding step of up to MAX_ROWS rows: every block in one kernel call, where it is the faster."""
        B, T, _ = x.shape
        if cache is not None and B * T <= MAX_ROWS and not torch.compiler.is_compiling():
            plan = self.decode_plan(x.dtype)
            if plan.weights is not None:
                y = kernel_blocks(plan.weights, x, rope, mask, cache, slots,
                                  lambda: super(FastSmolLM2, self).blocks(x, rope, mask, cache, slots))
                if y is not None:
                    return y[:, -1:] if last_only else y
        return super().blocks(x, rope, mask, cache, slots, last_only)

    def decode_plan(self, dtype: torch.dtype) -> DecodePlan:
        plans = self.__dict__.setdefault("decode_plans", {})
        plan = plans.get(dtype)
        if plan is None or not plan.holds():
            plan = plans[dtype] = DecodePlan(self, dtype)
        return plan

    def logits(self, h):
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return kernel_linear(h, [head.weight], packed=[packed_of(head)])[0]  # (B, T, vocab)

    def _apply(self, fn, recurse=True):  # .to(), .half(), ...: the weights move, and the plans with them
        self.__dict__.pop("decode_plans", None)
        return super()._apply(fn, recurse)

    def __getstate__(self):  # a copy's weights are elsewhere: it builds its own plans
        state = super().__getstate__().copy()
        state.pop("decode_plans", None)
        return state


FAST = {SmolLM2: FastSmolLM2, nn.Linear: FastLinear, Int8Linear: FastInt8Linear, RMSNorm: FastRMSNorm,
        Attention: FastAttention, MLP: FastMLP}


def accelerate(model: SmolLM2, packed: dict[str, Packed] | None = None) -> SmolLM2:
    """Make `model` (built on the CPU) run on the kernels where they are the faster, in place, and return it.

    packed: GGUF's packed copies of float32 weights, by parameter name (Checkpoint.packed). Apply it after
    any other module swap (quantize_int8). A model on another device, or without a C compiler, stays as it is."""
    if next(model.parameters()).device.type != "cpu" or compiled() is None:
        return model
    for module in model.modules():
        fast = FAST.get(type(module))
        if fast is not None:
            module.__class__ = fast  # the same state, one method replaced: no parameter is copied or renamed
    for name, copy in (packed or {}).items():
        owner, _, attribute = name.rpartition(".")
        if attribute == "weight":
            attach_packed(model.get_submodule(owner), copy)
    return model


def weight_format(model: SmolLM2) -> str:
    """The format the decoding step reads the blocks' linear weights in: the model's dtype, or the GGUF
    packed blocks a float32 model streams (for benchmarks to say what they measured)."""
    linears = [m for block in model.model.layers for m in block_linears(block)]
    weights = [m.weight for m in linears]
    if weights[0].device.type != "cpu" or weights[0].dtype not in TYPES or compiled() is None:
        return str(weights[0].dtype).removeprefix("torch.")
    return WEIGHT_FORMATS[streamed(weights, [packed_of(m) for m in linears])[0]]


__all__ = ["accelerate", "choices", "weight_format"]
