"""Loading and saving a model, functions over it as mlx-lm's load (smollm2.load, smollm2.save). Loading is the
one recipe every caller uses (the library, the CLI, the server): a source's checkpoint read and checked, a LoRA
adapter merged into its weights, the reference model built around its tensors (no copy), quantized where asked,
and, for CPU inference, accelerated once, after every module swap."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .checkpoints import load_checkpoint, parameter_shapes, save_gguf, save_hf
from .checkpoints.peft import merge_adapter
from .errors import SmolError
from .kernels import accelerate
from .kernels.held import HeldWeight, heap_for_loading
from .model import SmolLM2
from .quantize import quantize_int8

QUANTIZATIONS = ("int8",)


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


def load(src: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32, device="cpu",
         adapter: str | os.PathLike | None = None, quantize: str | None = None, kernels: bool = True,
         int8_activations: bool = False) -> SmolLM2:
    """The model at src: a HF directory, a .gguf file, a hub id, or None for the embedded SmolLM2-135M-Instruct.

    adapter: a LoRA directory in PEFT's format, merged into the float weights as they load, before any quantizing
    or kernel sees them. quantize: "int8" for int8 weight-only linear layers in the blocks (quantize.py).
    kernels: on the CPU, accelerated (smollm2.accelerate); False: model.py's modules alone. int8_activations: the
    kernels' decoding products of a GGUF file's blocks (a prompt's too where faster) quantize their inputs to 8
    bits, llama.cpp's way: faster for the K-quants, not exact (kernels.Accelerator); off, the default, a model's
    results are its float32 weights'."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise SmolError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, not {quantize!r}")
    accelerated = kernels and torch.device(device).type == "cpu"
    if int8_activations and not accelerated:
        raise SmolError("int8 activations run on the CPU kernels: not on another device, nor without kernels")
    # Even under inference_mode, weights of the usual kind: they can be trained, and their changes are seen.
    with torch.inference_mode(False), heap_for_loading():
        # A GGUF file's blocks hold its float32 weights' exact values: the kernels stream them, and a float32 model
        # holds them alone (kernels/held.py). A bf16 or int8 weight is rounded from their float32 values.
        ckpt = load_checkpoint(src, dtype, quantized=accelerated and dtype == torch.float32)
        ckpt.check(parameter_shapes(ckpt.config))
        if quantize == "int8":  # the blocks' linear layers become int8 from their float32 values; the embeddings and
            # output projection, kept in float32 values, stay the file's blocks: a fifth of the bytes a token reads
            for name in [name for name in ckpt.quantized if name.startswith("model.layers.")]:
                ckpt.tensors[name] = ckpt.quantized.pop(name).dequantize()
        if adapter is not None:
            merge_adapter(ckpt, adapter)
        with WithoutRandomInit():  # every weight is replaced below
            model = SmolLM2(ckpt.config)
        # already in dtype; ckpt.quantized's matrices, checked above, become parameters in accelerate()
        model.load_state_dict(ckpt.tensors, strict=not ckpt.quantized, assign=True)
        model.to(device).eval()
        if quantize == "int8":
            quantize_int8(model)
        return accelerate(model, ckpt.quantized, int8_activations=int8_activations) if accelerated else model


def save(model: SmolLM2, path: str | os.PathLike) -> None:
    """config.json + model.safetensors at path, a directory that load (and transformers' from_pretrained) reads.
    Weights held as GGUF blocks are written as the float32 values they hold."""
    save_hf(model.config, decoded_state(model), path)


def decoded_state(model: SmolLM2) -> dict:
    """model's state_dict with weights held as GGUF blocks (held.py) decoded to their float32 values."""
    return {name: t.decoded() if isinstance(t, HeldWeight) else t for name, t in model.state_dict().items()}


def export(model: SmolLM2, tokenizer, path: str | os.PathLike, gguf_type: str | None = None) -> None:
    """model with its tokenizer, for other tools: a HF directory at path (save()'s, and the tokenizer's files), or
    with gguf_type ("f32", "f16", "q8_0", "q4_1": checkpoints.gguf.SAVE_TYPES) one GGUF file for llama.cpp and
    Ollama, the tokenizer in its metadata."""
    if gguf_type is not None:
        save_gguf(model.config, decoded_state(model), tokenizer.gguf_metadata(), path, gguf_type)
    else:
        save(model, path)
        tokenizer.save_pretrained(path)
