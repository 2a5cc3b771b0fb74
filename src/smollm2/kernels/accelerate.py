"""Speed applied from outside: accelerate(model) gives the model an Accelerator of its own (model.accelerator)
and turns model.py's reference modules, in place, into ones that run the CPU kernels (ops.py) wherever they are
the faster on this machine, with a decoding step that runs every block in one kernel call. Parameters, state
dict and results (to float rounding, see tests/test_fast_paths.py) stay the reference's; model.py knows nothing
of it.

Each fast module is its reference class with one method replaced (Block and the containers only watched), so
training, saving, hooks and isinstance checks see the same modules. What the kernels keep for a model is its
accelerator's or its modules', never the process's, so two models (a base and its adapters, served from
threads of their own) never change each other's:
- the accelerator: its mode, its choices between kernel and torch (choosing.py), its decoding plans and the
  count of its kernels' runs;
- held weights: a float32 matrix read from a quantized GGUF file is held as the file's blocks alone, in the
  kernels' layout (a HeldWeight parameter, held.py), which the kernels stream and torch code decodes on demand;
- the decoding step's plan (where each block's weights are, for C) is built once per dtype. It is rebuilt when
  anything (a parameter, buffer or submodule) was assigned to one of the model's modules since, which they count
  in their accelerator (Watched), or when one of its tensors changed in place (trained, loaded into): each step
  compares their version counters (~15 us for the 270 tensors of the 135M model's blocks, 0.3% of its step). Moving
  the model (.to(), .half()) drops it. Changes through `.data` are not seen: assign new weights instead.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SmolError
from ..model import MLP, Attention, Block, RMSNorm, SmolLM2
from ..quantize import Int8Linear
from . import ops
from .build import choices_file, compiled
from .choosing import MODES, Choices
from .held import HeldWeight, held_weights, parameter, release_freed_memory
from .packed import HugePages, Packed, packed_layout, streams, unpacked

if TYPE_CHECKING:
    from ..checkpoints import GGUFBlocks


def mode_from_environment() -> str:
    """SMOLLM2_KERNELS: auto (the faster of kernel and torch, measured), on (the kernel wherever it runs) or off."""
    mode = os.environ.get("SMOLLM2_KERNELS", "auto")
    if mode not in MODES:
        warnings.warn(f"smollm2: SMOLLM2_KERNELS={mode!r} is none of auto, on, off; using auto", stacklevel=3)
        return "auto"
    return mode


class Accelerator:
    """What accelerate() gives a model, as model.accelerator: its mode ("auto": the faster of kernel and torch,
    measured; "on": the kernel wherever it can run; "off": torch alone), its choices, its decoding plans, and
    how many times its kernels ran (kernel_runs, by operation). Nothing here is shared with another model: the
    choices' file is read into this accelerator's own Choices.

    int8_activations: the decoding products of a GGUF file's blocks (and with AVX512-VNNI a prompt's of K-quant
    blocks) quantize their inputs to 8 bits in blocks of 32 and multiply in integers, as llama.cpp does: faster
    where decoding the blocks to float32 bounds a step (the K-quants), and not exact (README's "int8 activations"
    states the tolerance tested). Off by default: the model's results are then its float32 weights', bit for bit."""

    def __init__(self, mode: str | None = None, file: Callable[[], Path] = choices_file,
                 int8_activations: bool = False):
        self.choices = Choices(mode or mode_from_environment(), file)
        self.choices.int8_activations = int8_activations
        self.plans: dict[torch.dtype, DecodePlan] = {}
        self.changes = 0  # assignments to the model's modules (Watched): a plan holds while this has not moved

    @property
    def mode(self) -> str:
        return self.choices.mode

    @property
    def int8_activations(self) -> bool:
        return self.choices.int8_activations

    @property
    def kernel_runs(self) -> Counter[str]:
        return self.choices.kernel_runs

    def report(self) -> list[dict]:
        """The choices made so far (choosing.Choices.report), for benchmarks to show."""
        return self.choices.report()

    def __getstate__(self):  # a copy's weights are elsewhere: it builds its own plans
        return {**self.__dict__, "plans": {}}


def version(t: torch.Tensor) -> int:
    """Counts t's in-place changes (inference tensors count none)."""
    return -1 if t.is_inference() else t._version


def held(blocks: GGUFBlocks, repack: bool = False, pages: HugePages | None = None) -> nn.Parameter:
    """A GGUF file's matrix as a model's parameter: where the kernels stream its type, its blocks alone, as
    GGUFRows.blocks reads them (the file's mapped pages under 4 MiB) or with `pages` a copy in those huge pages, or
    with `repack` laid out again where the int8 tile decodes that the faster (packed_layout); else its float32
    values."""
    packed = packed_layout(blocks.type, blocks.read(), repack, pages)
    weight = None if packed is None else parameter(packed, blocks.shape)
    return weight if weight is not None and streams(weight, packed) else nn.Parameter(blocks.dequantize())


def packed_of(module: nn.Module) -> Packed | None:
    """The blocks module.weight is held as, or None."""
    weight = module.weight
    return weight.packed if isinstance(weight, HeldWeight) else None


def dequantize(model: nn.Module) -> nn.Module:
    """Give every matrix held as GGUF blocks its float32 values as a plain parameter, in place (and returns
    `model`): what training, or any change in place, needs. The same values; 4 bytes a weight from then on."""
    with torch.inference_mode(False):  # weights of the usual kind, as loading makes them, even under inference
        for owner, name, weight in list(held_weights(model)):
            setattr(owner, name, nn.Parameter(weight.decoded(), weight.requires_grad))
    return model


def products(choices: Choices, x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """The outputs of linear layers (nn.Linear, or Int8Linear with its .scale) of one input x: on the kernel,
    their weights stream in one pass (gate and up: one pass, not two), where they are of one kind. Layers swapped
    in since (a served adapter's wrappers) run their own forwards."""
    if not all(isinstance(m, (nn.Linear, Int8Linear)) for m in linears):
        return [m(x) for m in linears]
    packed = [packed_of(m) for m in linears]
    if len({None if p is None else p.type for p in packed}) > 1:  # GGUF files mix types: each streams its own
        return [y for m in linears for y in products(choices, x, m)]
    ys = ops.linear(choices, x, [m.weight for m in linears], [getattr(m, "scale", None) for m in linears],
                    packed)
    return [y if m.bias is None else y + m.bias for y, m in zip(ys, linears)]


class Watched(nn.Module):
    """A module of an accelerated model, which knows its accelerator. What is assigned to it (a parameter, buffer
    or submodule, new or replaced) moves the accelerator's count of changes, so that a decoding plan, which points
    at the weights, knows it may no longer hold without walking the model each step. Converting it (.to(),
    .half()) drops the plans, which would keep the old weights alive."""

    accelerator: Accelerator  # set by accelerate(), before the module becomes Watched

    def __setattr__(self, name, value):
        if (isinstance(value, (torch.Tensor, nn.Module)) or name in self._parameters or name in self._buffers
                or name in self._modules):
            self.accelerator.changes += 1
        super().__setattr__(name, value)

    def __delattr__(self, name):
        self.accelerator.changes += 1
        super().__delattr__(name)

    def register_parameter(self, name, param):
        self.accelerator.changes += 1
        super().register_parameter(name, param)

    def register_buffer(self, name, tensor, persistent=True):
        self.accelerator.changes += 1
        super().register_buffer(name, tensor, persistent)

    def add_module(self, name, module):
        self.accelerator.changes += 1
        super().add_module(name, module)

    def _apply(self, fn, recurse=True):
        self.accelerator.plans.clear()
        self.accelerator.changes += 1
        for name, weight in list(self._parameters.items()):  # blocks take no other dtype or device in place
            if isinstance(weight, HeldWeight) and (converted := fn(weight)) is not weight:
                self._parameters[name] = nn.Parameter(converted, weight.requires_grad)  # a copy, decoded
        return super()._apply(fn, recurse)


class FastLinear(Watched, nn.Linear):
    def forward(self, x):
        return products(self.accelerator.choices, x, self)[0]


class FastInt8Linear(Watched, Int8Linear):
    def forward(self, x):
        return products(self.accelerator.choices, x, self)[0]


class FastRMSNorm(Watched, RMSNorm):
    def forward(self, x):  # a prompt: one pass, not six
        return ops.rms_norm(self.accelerator.choices, x, self.weight, self.eps, super().forward)


class FastAttention(Watched, Attention):
    def project(self, x):  # a prompt: q, k and v in one pass, its input quantized once (int8 activations)
        return products(self.accelerator.choices, x, self.q_proj, self.k_proj, self.v_proj)

    def rotate(self, x, cos, sin):  # a prompt: one pass, not five
        return ops.rope(self.accelerator.choices, x, cos, sin, Attention.rotate)

    def attend(self, q, k, v, mask, is_causal: bool):  # a prompt: the causal half of the scores, not all
        plain = lambda q, k, v: super(FastAttention, self).attend(q, k, v, mask, is_causal)  # noqa: E731
        return ops.prompt_attention(self.accelerator.choices, q, k, v, plain) if is_causal else plain(q, k, v)


class FastMLP(Watched, MLP):
    def forward(self, x):  # gate and up in one pass, then SiLU*up in one
        choices = self.accelerator.choices
        gate, up = products(choices, x, self.gate_proj, self.up_proj)
        return self.down_proj(ops.silu_mul(choices, gate, up, lambda gate, up: F.silu(gate) * up))


class WatchedBlock(Watched, Block):
    pass


class FastEmbedding(Watched, nn.Embedding):
    def forward(self, ids):  # held weights: the rows looked up, decoded here (not through torch's dispatch)
        weight = self.weight
        if isinstance(weight, HeldWeight) and not (torch.is_grad_enabled() and weight.requires_grad):
            return unpacked(weight.packed, ids)
        return super().forward(ids)


class WatchedModuleList(Watched, nn.ModuleList):
    pass


class WatchedModuleDict(Watched, nn.ModuleDict):
    pass


class DecodePlan:
    """The C view of every block's weights (struct block), for one activation dtype, with the tensors it was
    built from: it holds while nothing was assigned to the model's modules since, and none of them changed in
    place."""

    def __init__(self, model: FastSmolLM2, dtype: torch.dtype):
        found = [block_weights(block, dtype, model.updates is not None) for block in model.model.layers]
        self.weights = None if None in found else (ops.BlockWeights * len(found))(*(f[0] for f in found))
        self.kept = [f[1] for f in found if f is not None]  # the float32 scales that weights point into
        self.tensors = tensors_of(model)
        self.versions, self.changes = versions(self.tensors), model.accelerator.changes

    def holds(self, accelerator: Accelerator) -> bool:
        return accelerator.changes == self.changes and versions(self.tensors) == self.versions


def block_linears(block, wrapped: bool = False) -> list[nn.Module]:
    """A block's linear layers, in struct block's order; wrapped: they are wrappers adding low-rank updates to
    their `base` layers (FastSmolLM2.updates), whose bases these are."""
    attn, mlp = block.self_attn, block.mlp
    found = [getattr(attn, name) for name in ops.LINEARS[:4]] + [getattr(mlp, name) for name in ops.LINEARS[4:]]
    return [m.base for m in found] if wrapped else found


def tensors_of(model: SmolLM2) -> list[torch.Tensor]:
    """Every parameter and buffer of the blocks' norms and linear layers that can change in place: what a decoding
    step's plan points at, or at a copy of (float32 scales). Held weights change only by assignment (and reading
    a version through their __torch_function__ would take ~10 us each, a step's 10%)."""
    wrapped = getattr(model, "updates", None) is not None
    modules = [m for block in model.model.layers for m in (block.input_layernorm, block.post_attention_layernorm,
                                                           *block_linears(block, wrapped))]
    return [t for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
            if not isinstance(t, HeldWeight)]


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """[version(t) for t in tensors], in a third of the time when none is an inference tensor (the usual case)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # one is: it counts no changes
        return [version(t) for t in tensors]


def block_weights(block, dtype: torch.dtype, wrapped: bool = False) -> tuple[ops.BlockWeights, list] | None:
    """The C view of a block's weights (and the float32 scales it points into), or None where the kernel
    cannot run the block: biases, mixed weight types, sizes off its multiples of 16, layers of its own forward.
    wrapped: as block_linears."""
    norms, linears = [block.input_layernorm, block.post_attention_layernorm], block_linears(block, wrapped)
    if not all(isinstance(m, (nn.Linear, Int8Linear)) for m in linears):  # swapped in since (a served adapter's)
        return None
    attn = block.self_attn
    C, D, I = linears[3].weight.shape[0], attn.head_dim, linears[6].weight.shape[1]
    w_type = linears[0].weight.dtype
    if not (C % 16 == 0 and I % 16 == 0 and D % 16 == 0 and D <= ops.MAX_HEAD_DIM and w_type in (dtype, torch.int8)
            and all(m.bias is None and m.weight.dtype == w_type and m.weight.is_contiguous()
                    and m.weight.device.type == "cpu" for m in linears)
            and all(n.weight.dtype == dtype for n in norms)):
        return None
    scales = [None if getattr(m, "scale", None) is None else m.scale.float().contiguous() for m in linears]
    kinds, addresses = zip(*(ops.streamed([m.weight], [packed_of(m)]) for m in linears))  # each its own
    return (ops.BlockWeights(*(n.weight.data_ptr() for n in norms), *(a for a, in addresses),
                             *(None if s is None else s.data_ptr() for s in scales),
                             (ctypes.c_int * len(kinds))(*kinds), C, attn.n_heads,
                             attn.n_kv, D, I, norms[0].eps), scales)


class FastSmolLM2(Watched, SmolLM2):
    # Where set (generation/adapters.py's adapted copy of a served model): every block's linear layer is a wrapper
    # adding rows' LoRA updates to its `base`'s product, and this gives a decoding step those updates (a LowRank
    # per block, each row's adapter among them): the step streams the bases and adds the updates itself.
    updates: Callable[[], tuple[ctypes.Array, torch.Tensor]] | None = None

    def blocks(self, x, rope, mask, cache, slots, last_only: bool = False):
        """A decoding step of up to MAX_ROWS rows: every block in one kernel call, where it is the faster."""
        B, T, _ = x.shape
        choices = self.accelerator.choices
        if (cache is not None and B * T <= ops.MAX_ROWS and choices.allow_kernels()
                and not torch.compiler.is_compiling()):
            plan = self.decode_plan(x.dtype)
            if plan.weights is not None:
                y = ops.blocks(choices, plan.weights, x, rope, mask, cache, slots,
                               lambda: super(FastSmolLM2, self).blocks(x, rope, mask, cache, slots),
                               None if self.updates is None else self.updates())
                if y is not None:
                    return y[:, -1:] if last_only else y
        return super().blocks(x, rope, mask, cache, slots, last_only)

    def decode_plan(self, dtype: torch.dtype) -> DecodePlan:
        plans = self.accelerator.plans
        plan = plans.get(dtype)
        if plan is None or not plan.holds(self.accelerator):
            plan = plans[dtype] = DecodePlan(self, dtype)
        return plan

    def logits(self, h):
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return ops.linear(self.accelerator.choices, h, [head.weight], packed=[packed_of(head)])[0]  # (B, T, vocab)


# What each reference module becomes: the modules on the way from the model to every weight a plan points at
# are watched.
FAST = {SmolLM2: FastSmolLM2, nn.Linear: FastLinear, Int8Linear: FastInt8Linear, RMSNorm: FastRMSNorm,
        Attention: FastAttention, MLP: FastMLP, Block: WatchedBlock, nn.Embedding: FastEmbedding,
        nn.ModuleList: WatchedModuleList, nn.ModuleDict: WatchedModuleDict}


def accelerate(model: SmolLM2, quantized: dict[str, GGUFBlocks] | None = None, *,
               mode: str | None = None, int8_activations: bool | None = None) -> SmolLM2:
    """Give `model` (built on the CPU) an Accelerator and make it run on the kernels where they are the faster,
    in place; returns it.

    quantized: the matrices a GGUF file stores in quantized types, by parameter name (Checkpoint.quantized),
    which the model does not have yet: each becomes its parameter, held as its blocks where the kernels stream
    its type (held()), else as float32. mode: "auto", "on" or "off" (default: SMOLLM2_KERNELS, else
    auto); int8_activations: as Accelerator's (default: off). Apply it after any other module swap
    (quantize_int8); again after one, it keeps the model's accelerator (its choices), and `mode` and
    `int8_activations`, where given, become its own. A model on another device, or without a C compiler, stays as
    it is (`quantized`'s matrices float32)."""
    if mode is not None and mode not in MODES:
        raise SmolError(f"kernels mode {mode!r} is none of {', '.join(MODES)}")
    if next(model.parameters()).device.type != "cpu" or compiled() is None:
        for name, blocks in (quantized or {}).items():
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, nn.Parameter(blocks.dequantize()))
        return model
    accelerator = model.__dict__.get("accelerator")
    if accelerator is None:
        accelerator = Accelerator(mode)
    elif mode is not None:
        accelerator.choices.mode = mode
    if int8_activations is not None:
        accelerator.choices.int8_activations = int8_activations
    for module in model.modules():
        fast = FAST.get(type(module))
        if fast is not None or isinstance(module, Watched):
            object.__setattr__(module, "accelerator", accelerator)  # first: a Watched module counts in it
            module.__class__ = fast or type(module)  # the same state: no parameter is copied or renamed
    pages = HugePages()  # the held matrices' room: let go with the last of them
    for name, blocks in (quantized or {}).items():  # one matrix at a time: one file's matrix read beside them
        owner, _, attribute = name.rpartition(".")
        # off: torch alone runs the model, which would decode a held matrix at every call: float32 once instead.
        # Laid out again for int8 decoding where asked for at load (exact products read that layout too, putting
        # rows back as the file's blocks first: slower); an embedding only where it is the output head too (tied),
        # its rows then looked up through the kernels' dequantize, which puts them back first.
        module = model.get_submodule(owner)
        repack = accelerator.int8_activations and (not isinstance(module, nn.Embedding) or model.lm_head is None)
        weight = held(blocks, repack, pages) if accelerator.mode != "off" else nn.Parameter(blocks.dequantize())
        setattr(module, attribute, weight)
        release_freed_memory()
    accelerator.changes += 1  # new modules swapped in, new held weights: plans built before no longer hold
    return model


def weight_format(model: SmolLM2) -> str:
    """The format the decoding step reads the blocks' linear weights in: the model's dtype, or the GGUF
    packed blocks a float32 model streams, each kind once (for benchmarks to say what they measured)."""
    linears = [m for block in model.model.layers for m in block_linears(block)]
    weights = [m.weight for m in linears]
    accelerator = model.__dict__.get("accelerator")
    if (accelerator is None or accelerator.mode == "off" or weights[0].device.type != "cpu"
            or weights[0].dtype not in ops.TYPES):
        return str(weights[0].dtype).removeprefix("torch.")
    return ops.formats(ops.streamed([m.weight], [packed_of(m)])[0] for m in linears)
