"""Checkpoints: HF directories (safetensors), GGUF files and hub ids -> config + tensors, and back."""

from .hf import save_hf
from .checkpoint import Checkpoint
from .source import default_model_path, load_checkpoint, resolve

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint", "resolve", "save_hf"]
