"""A float32 matrix held as the GGUF blocks it was read from (packed.py), and nothing else.

A model loaded from a quantized GGUF file keeps, for each matrix the kernels stream, its blocks as the file holds
them (a copy in huge pages: packed.HugePages): 4.5-8.5 bits a weight where a float32 copy would take 32. The
matrix stays a float32 parameter to everything else (its shape, dtype and device are the float32 matrix's, and torch
code computes with it as with any tensor) because each torch operation given it decodes the blocks into a new
float32 tensor first, used once and not kept: the reference path and the inspection hooks (a layer's product at a
time), state_dict and saving, LoRA merging, int8 quantizing. That costs a decode each time: kernels.c's dequantize
(~0.2 ns a weight on 2 cores, writing float32 at memory speed; packed.unpacked's torch and numpy code, 3-14 ns,
where no C compiler is), where the kernels read the blocks as they are. An embedding lookup decodes just the rows it
looks up.

torch routes operations on such a tensor through its Python dispatch, whose first use in a process imports
torch.distributed.tensor (~45 MB and ~1.5 s, once). Inference on the kernels never takes that route: the held
parameters are made without it (parameter()), state_dict detaches them without it (__torch_function__), the
kernels read their blocks, and the accelerated embedding (accelerate.py) decodes its rows itself; only the torch
code above does. Reading a held weight's shape, dtype or version goes through __torch_function__, ~5-10 us
each: the decoding step reads none of them (accelerate.py's plan).

What cannot work on blocks is a change in place (an optimizer's step, load_state_dict into it, a .data
write): it raises, naming dequantize(model), which gives every held matrix its float32 copy (for training).
Converting the model (.to(), .half()) decodes its held matrices as well: a copy of another dtype or device.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
import torch.nn as nn

from ..errors import SmolError
from .build import compiled
from .packed import Packed, kernels_decoded, unpacked

aten = torch.ops.aten


class HeldWeight(torch.Tensor):
    """A float32 (N, K) matrix whose values are `packed`'s (packed.unpacked), decoded by every operation that
    reads them. parameter() makes one a parameter."""

    packed: Packed

    @staticmethod
    def __new__(cls, packed: Packed, shape: tuple[int, int], requires_grad: bool = False):
        held = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=packed.data.device,
                                                   requires_grad=requires_grad)
        held.packed = packed
        return held

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:  # state_dict's, the same blocks, without torch's Python dispatch (the top)
            with torch.inference_mode(False):  # a tensor of the usual kind, as torch's own detach gives
                return HeldWeight(args[0].packed, args[0].shape)
        with torch._C.DisableTorchFunctionSubclass():  # the rest reaches __torch_dispatch__, results as they are
            return func(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"HeldWeight({tuple(self.shape)}, kernels.c type {self.packed.type})"

    def decoded(self) -> torch.Tensor:
        """The float32 matrix, a new tensor: by the kernels' own decoding where they are built (the values
        packed.unpacked gives, bit for bit, many times faster)."""
        if compiled() is None:
            return unpacked(self.packed)
        return kernels_decoded(self.packed.data, self.packed.type, self.shape[1])

    def numpy(self, *, force: bool = False):  # torch refuses it for a subclass: the decoded values'
        return self.decoded().numpy(force=force)

    def __deepcopy__(self, memo):  # the blocks never change, so a copy shares them
        if isinstance(self, nn.Parameter):
            return parameter(self.packed, self.shape, self.requires_grad)
        return HeldWeight(self.packed, self.shape, self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter, state_dict: the same blocks
            with torch.inference_mode(False):  # a view of a tensor of the usual kind, as torch's own detach
                return HeldWeight(args[0].packed, args[0].shape)
        if func is aten.embedding.default and isinstance(args[0], HeldWeight):  # the rows looked up, alone
            return unpacked(args[0].packed, args[1])
        written = {spec.name for spec in func._schema.arguments if spec.alias_info and spec.alias_info.is_write}
        if any(isinstance(a, HeldWeight) for a, spec in zip(args, func._schema.arguments) if spec.name in written) \
                or any(isinstance(kwargs.get(name), HeldWeight) for name in written):
            raise SmolError(f"a weight held as its GGUF blocks cannot change in place ({func}); give the model "
                            "float32 weights first: smollm2.kernels.dequantize(model), or load it with "
                            "kernels=False")

        def plain(a):
            return a.decoded() if isinstance(a, HeldWeight) else a

        return func(*(plain(a) for a in args), **{k: plain(v) for k, v in kwargs.items()})


def parameter(packed: Packed, shape: tuple[int, int], requires_grad: bool = True) -> nn.Parameter:
    """A HeldWeight as a module's parameter. nn.Parameter(HeldWeight(...)) would do it by a detach, through
    torch's Python dispatch (see the top); this marks it as nn.Parameter marks a tensor subclass."""
    with torch.inference_mode(False):  # a parameter of the usual kind, even made under inference
        weight = HeldWeight(packed, shape, requires_grad)
    weight._is_param = True
    return weight


def held_weights(module: nn.Module):
    """(owner, name, weight) of each held matrix in `module`'s tree."""
    for owner in module.modules():
        for name, weight in owner.named_parameters(recurse=False):
            if isinstance(weight, HeldWeight):
                yield owner, name, weight


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing): passing copies (rows
    decoded to be checked, q's and k's blocks read before their rows are put in order) leave freed holes between
    what is kept, which glibc would keep resident."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
LOADING_BLOCK, RUNNING_BLOCK = 128 << 10, 32 << 20  # glibc's default, and its ceiling on 64-bit Linux
RUNNING_TRIM = 2 * RUNNING_BLOCK  # the heap's free top kept while running: glibc's own, once its threshold has risen


@contextlib.contextmanager
def heap_for_loading():
    """Inside, glibc gives every block of 128 KiB or more pages of its own (its default, held there), returned to
    the OS when freed; after, blocks of 32 MiB or more, and the heap keeps up to 64 MiB free at its top (where
    glibc's defaults would have risen to by then: twice the threshold). Process-wide, as glibc's heap is; elsewhere
    nothing.

    Why: glibc raises that threshold to the size of each large block freed, up to 32 MiB. Loading frees many (the
    rows decoded to be checked, q's and k's blocks read before their rows are put in order), so by default the
    blocks kept were laid out on the heap between freed holes, whose pages release_freed_memory gives back; a
    prompt's activations then landed in those holes one after another, and every hole they touched stayed resident:
    +45 MiB on the 360M Q4_0 model's peak over a 128-token prefill, more with each prompt. Held at 128 KiB while
    loading, nothing is laid out between holes. After, the heap serves a prompt's activations below 32 MiB (the
    1.7B's MLP over a 128-token prompt: 12 MiB) from pages it keeps, as glibc's default does by then: blocks of
    their own would fault their pages in at every use, ~0.4 ms a MiB (~10% of a 360M model's 128-token prefill).
    The top kept is 64 MiB, not 32: a batch of 16 prompts of 128 tokens (the 135M's MLP: 37 MiB) freed a top over
    32 MiB at layer after layer, which glibc handed back and faulted in again: 32k page faults a prefill on 2
    threads (2.4k with 64 MiB), 100-280k on one (~20k). What the last prompt leaves free the engine hands back
    itself (release_freed_memory)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LOADING_BLOCK), mallopt(M_TRIM_THRESHOLD, LOADING_BLOCK)
    try:
        yield
    finally:
        release_freed_memory()
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, RUNNING_BLOCK), mallopt(M_TRIM_THRESHOLD, RUNNING_TRIM)
