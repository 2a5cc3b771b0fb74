"""Checkpoints: HF directories (safetensors), GGUF files and hub ids -> validated plain data (config, tensors, a
GGUF file's quantized blocks), and back; LoRA adapters in PEFT's format. Building a model from them is
smollm2.loading's; nothing here knows the kernels."""

from .gguf import save_gguf
from .hf import save_hf
from .checkpoint import Checkpoint, GGUFBlocks, parameter_shapes
from .source import default_model_path, load_checkpoint, resolve
from .peft import Adapter, read_adapter, write_adapter

__all__ = ["Adapter", "Checkpoint", "GGUFBlocks", "default_model_path", "load_checkpoint", "parameter_shapes",
           "read_adapter", "resolve", "save_gguf", "save_hf", "write_adapter"]
