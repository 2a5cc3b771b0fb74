"""A source string -> a built model: the checkpoint read and checked, the reference model built around its
tensors (no copy), and, for CPU inference, accelerated."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..kernels import accelerate
from .checkpoint import parameter_shapes
from .peft import merge_adapter
from .source import load_checkpoint


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


def load_model(cls, src: str | os.PathLike | None, dtype: torch.dtype, device, speed_up: bool,
               adapter: str | os.PathLike | None = None):
    """cls (SmolLM2) built from the checkpoint at src, with the LoRA adapter directory `adapter` (PEFT's
    format) merged into its weights; speed_up: accelerated where it runs on the CPU."""
    speed_up = speed_up and torch.device(device).type == "cpu"
    # Even under inference_mode, weights of the usual kind: they can be trained, and their changes are seen.
    with torch.inference_mode(False):
        ckpt = load_checkpoint(src, dtype, packed=speed_up)
        ckpt.check(parameter_shapes(ckpt.config))
        if adapter is not None:
            merge_adapter(ckpt, adapter)
        with WithoutRandomInit():  # every weight is replaced below
            model = cls(ckpt.config)
        model.load_state_dict(ckpt.tensors, strict=True, assign=True)  # already in dtype
        model.to(device).eval()
    return accelerate(model, ckpt.packed) if speed_up else model
