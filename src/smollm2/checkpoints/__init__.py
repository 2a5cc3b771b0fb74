"""Checkpoints: HF directories (safetensors), GGUF files and hub ids -> config + tensors -> a model, and back;
LoRA adapters in PEFT's format."""

from .gguf import save_gguf
from .hf import save_hf
from .checkpoint import Checkpoint, parameter_shapes
from .source import default_model_path, load_checkpoint, resolve
from .loading import load_model
from .peft import Adapter, read_adapter, write_adapter

__all__ = ["Adapter", "Checkpoint", "default_model_path", "load_checkpoint", "load_model", "parameter_shapes",
           "read_adapter", "resolve", "save_gguf", "save_hf", "write_adapter"]
