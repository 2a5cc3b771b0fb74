"""Checkpoint: what every reader returns, config plus tensors named as transformers names them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..config import SmolConfig
from ..errors import SmolError


# What a weight may be stored as in a safetensors file. Anything else (integers, booleans, float8, float64) is a
# damaged or foreign file: its bytes taken as weights would answer garbage, so it is refused by name.
SAFETENSORS_FLOATS = ("F32", "F16", "BF16")


def stored_type_error(file, name: str, found: str, allowed) -> SmolError:
    """The one refusal of a tensor stored in a type the model cannot take as weights."""
    return SmolError(f"{file}: tensor {name} is stored as {found}, not a weight type ({', '.join(allowed)}): "
                     "a damaged or foreign file")


class GGUFBlocks(NamedTuple):
    """A matrix as a GGUF file stores it in a quantized type: its exact values, in a few bits each. Read from the
    mapped file when asked, a new tensor each time, so that whoever builds a model from the blocks holds one
    matrix's bytes of the file at a time beside what it makes of them."""
    type: int  # a GGMLQuantizationType
    shape: torch.Size  # the matrix's (rows, columns)
    read: Callable[[], torch.Tensor]  # its blocks, uint8 (rows, bytes a row), rows in the tensor's order (q, k
    # un-permuted)
    dequantize: Callable[[], torch.Tensor]  # its float32 values, gguf.quants.dequantize's, rows as read's
    finite: Callable[[], bool]  # whether every value is finite (no NaN or infinity)


@dataclass
class Checkpoint:
    config: SmolConfig
    tensors: dict[str, torch.Tensor]
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> where it came from, for errors
    source: str = ""
    # matrices a GGUF file stores in a quantized type -> its blocks of them, where asked for (load_checkpoint):
    # these are not in `tensors`
    quantized: dict[str, GGUFBlocks] = field(default_factory=dict)

    def check(self, expected: dict[str, torch.Size]) -> None:
        """Every tensor the model needs is here with the right shape and finite values, and nothing else is."""
        for name in sorted(expected.keys() - self.tensors.keys() - self.quantized.keys()):
            raise SmolError(f"{self.source}: missing tensor {name}")
        for name in sorted((self.tensors.keys() | self.quantized.keys()) - expected.keys()):
            raise SmolError(f"{self.files.get(name, self.source)}: unexpected tensor {name}")
        for name, tensor in self.tensors.items():  # each reader refuses these before reading; this is the floor
            if not tensor.is_floating_point():
                raise stored_type_error(self.files.get(name, self.source), name,
                                        str(tensor.dtype).removeprefix("torch."), ("float32", "float16", "bfloat16"))
        for name, shape in expected.items():
            got = (self.tensors[name] if name in self.tensors else self.quantized[name]).shape
            if got != shape:
                raise SmolError(f"{self.files.get(name, self.source)}: tensor {name} has shape {tuple(got)} "
                                f"but the config needs {tuple(shape)}")
        for name in expected:
            blocks = self.quantized.get(name)
            if not (blocks.finite() if blocks is not None else all_finite(self.tensors[name])):
                raise SmolError(f"{self.files.get(name, self.source)}: tensor {name} holds NaN or infinite values")

    def weight(self, name: str) -> torch.Tensor:
        """The tensor `name` as float values, its blocks decoded where the file quantized it."""
        return self.tensors[name] if name in self.tensors else self.quantized[name].dequantize()


def parameter_shapes(config: SmolConfig) -> dict[str, torch.Size]:
    """The state dict's shapes (SmolLM2's, model.py), from the config alone: a checkpoint is checked against
    them before any module is built, so sizes it got wrong never turn into allocations."""
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


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t: its least and largest values, which NaN and infinities become, in one pass over it
    (15x faster than torch.isfinite(t).all(), which writes a mask the size of t), checked as Python floats: torch's
    isfinite and & would fault in ~3 MB of torch's code that nothing after loading runs."""
    if t.numel() == 0:
        return True
    least, largest = torch.aminmax(t)
    return math.isfinite(least.item()) and math.isfinite(largest.item())
