"""HF model directories: config.json + model.safetensors (or a sharded index), read and written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..config import SmolConfig
from ..errors import SmolError
from .checkpoint import SAFETENSORS_FLOATS, Checkpoint, stored_type_error

INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SmolError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise SmolError(f"{path}: expected a JSON object")
    return data


def _inside(directory: Path, name) -> Path:
    """A shard the index names, which must lie in the checkpoint's directory: an index must not make us read
    other files. The error does not say whether the file it names exists. The name is normalised, not
    resolved: in the Hugging Face cache every file is a link to a blob outside its snapshot's directory."""
    here = os.path.normpath(directory)
    if not isinstance(name, str) or not Path(os.path.normpath(directory / name)).is_relative_to(here):
        raise SmolError(f"{directory / INDEX}: shard {str(name)[:200]!r} lies outside the checkpoint's directory")
    return directory / name


def _shards(directory: Path) -> list[Path]:
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    if (directory / INDEX).is_file():
        weight_map = read_json(directory / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SmolError(f"{directory / INDEX}: no weight_map")
        return sorted({_inside(directory, name) for name in weight_map.values()})
    for name in PICKLES:
        if (directory / name).exists():
            raise SmolError(f"{directory / name}: refusing to load a pickle checkpoint, which can run "
                            "arbitrary code; convert it to safetensors")
    raise SmolError(f"{directory}: no model.safetensors or {INDEX}")


def sanitize(config: SmolConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop what some checkpoints carry but the model computes: rotary tables and a tied lm_head copy."""
    return {k: v for k, v in tensors.items()
            if not k.endswith("rotary_emb.inv_freq") and not (config.tie_word_embeddings and k == "lm_head.weight")}


def read_hf(directory: Path, dtype: torch.dtype | None = None) -> Checkpoint:
    if not (directory / "config.json").is_file():
        raise SmolError(f"{directory}: no config.json")
    from safetensors import SafetensorError, safe_open  # here: ~0.75 MiB resident a GGUF run never reads

    config = SmolConfig.from_json(directory / "config.json")
    tensors, files = {}, {}
    for shard in _shards(directory):
        if not shard.is_file():
            raise SmolError(f"{shard}: listed in {INDEX} but missing")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # every type from the header, before any tensor is read
                    if (stored := f.get_slice(name).get_dtype()) not in SAFETENSORS_FLOATS:
                        raise stored_type_error(shard, name, stored, SAFETENSORS_FLOATS)
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    tensors[name], files[name] = tensor if dtype is None else tensor.to(dtype), str(shard)
        except (SafetensorError, OSError) as e:
            raise SmolError(f"{shard}: truncated or corrupt safetensors file ({e})") from None
    return Checkpoint(config, sanitize(config, tensors), files, str(directory))


def save_hf(config: SmolConfig, state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    if not all(t.is_floating_point() for t in state_dict.values()):
        raise SmolError("a quantized model cannot be saved as a HF checkpoint; save it before quantizing")
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the directory or one of its parents should be
        raise SmolError(f"{path}: cannot create the checkpoint's directory ({e.strerror})") from None
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps({**config.to_hf(), "torch_dtype": dtype}, indent=2) + "\n")
    from safetensors.torch import save_file  # (as read_hf's)

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
