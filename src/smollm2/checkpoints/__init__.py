"""Checkpoints: HF directories (safetensors), GGUF files and hub ids -> config + tensors -> a model, and back."""

from .hf import save_hf
from .checkpoint import Checkpoint, parameter_shapes
from .source import default_model_path, load_checkpoint, resolve
from .loading import load_model

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint", "load_model", "parameter_shapes", "resolve",
           "save_hf"]
