"""LoRA adapters in PEFT's format: a directory of adapter_config.json + adapter_model.safetensors, read,
checked against a base model and written back, with tensors named as PEFT names them:
base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (r, in) and .lora_B.weight (out, r).

An adapter says `W x + (lora_alpha / r) * B A x` for each targeted linear layer W. Features of PEFT that
would change that sum (DoRA, rsLoRA, per-layer ranks, biases, extra trained modules, initialisations that
also change the base weights) are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SmolError
from .checkpoint import SAFETENSORS_FLOATS, Checkpoint, all_finite, parameter_shapes, stored_type_error
from .hf import read_json

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper, then LlamaForCausalLM's own names
# Off when false, null or empty; anything else is a feature this reader does not implement.
UNSUPPORTED = ("use_dora", "use_rslora", "use_qalora", "lora_bias", "fan_in_fan_out", "rank_pattern",
               "alpha_pattern", "modules_to_save", "layers_to_transform", "layer_replication", "exclude_modules",
               "target_parameters", "trainable_token_indices", "alora_invocation_tokens", "loftq_config")
INITS = (True, False, "gaussian")  # the others (pissa, olora, loftq, eva, corda, ...) also rewrite the base


@dataclass
class Adapter:
    r: int
    alpha: float
    dropout: float
    targets: list[str]  # module names within a block: q_proj, v_proj, ...
    tensors: dict[str, torch.Tensor]  # our names: model.layers.0.self_attn.q_proj.lora_A.weight, ...

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def block_linears(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """Parameter shapes -> each block's linear layer (model.layers.0.self_attn.q_proj) -> its weight's shape."""
    return {name.removesuffix(".weight"): shape for name, shape in shapes.items()
            if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2}


def shown(value) -> str:
    """A config value as Python writes it, cut short: it may be anything."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _settings(config: dict, known: set[str], where: Path) -> tuple[int, float, float, list[str]]:
    """(r, alpha, dropout, targets) of an adapter_config.json, every field checked."""
    if config.get("peft_type") != "LORA":
        raise SmolError(f"{where}: peft_type must be 'LORA', got {shown(config.get('peft_type'))}")
    if config.get("task_type") not in ("CAUSAL_LM", None):
        raise SmolError(f"{where}: task_type must be 'CAUSAL_LM', got {shown(config['task_type'])}")
    for field in UNSUPPORTED:
        if config.get(field):
            raise SmolError(f"{where}: {field} is not supported (got {shown(config[field])})")
    if config.get("bias", "none") != "none":
        raise SmolError(f"{where}: bias must be 'none' (trained biases are not supported), got "
                        f"{shown(config['bias'])}")
    if config.get("init_lora_weights", True) not in INITS:
        raise SmolError(f"{where}: init_lora_weights {shown(config['init_lora_weights'])} is not supported "
                        "(it changes the base weights too)")
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if type(r) is not int or r < 1:
        raise SmolError(f"{where}: r must be a whole number >= 1, got {shown(r)}")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise SmolError(f"{where}: lora_alpha must be a finite number, got {shown(alpha)}")
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise SmolError(f"{where}: lora_dropout must be a number in [0, 1), got {shown(dropout)}")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = sorted(known)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise SmolError(f"{where}: target_modules must be a list of module names (regular expressions are not "
                        f"supported), got {shown(targets)}")
    for target in targets:
        if target not in known:
            raise SmolError(f"{where}: target module {target[:40]!r} is not a linear layer of this model's blocks "
                            f"({', '.join(sorted(known))})")
    return r, float(alpha), float(dropout), sorted(set(targets))


def read_adapter(path: str | Path, linears: dict[str, torch.Size]) -> Adapter:
    """The adapter in directory `path`, checked against a base whose blocks' linear layers have these weight
    shapes (block_linears()): its config, then every tensor's name, shape and dtype from the file's header,
    before any tensor is read."""
    from safetensors import SafetensorError, safe_open  # (as write_adapter's)

    path = Path(path)
    if not (path / CONFIG).is_file():
        raise SmolError(f"{path}: no {CONFIG} (not a PEFT adapter directory)")
    weights = path / WEIGHTS
    if not weights.is_file():
        if (path / "adapter_model.bin").exists():
            raise SmolError(f"{path / 'adapter_model.bin'}: refusing to load a pickle adapter, which can run "
                            f"arbitrary code; save it as {WEIGHTS} (PEFT's default)")
        raise SmolError(f"{path}: no {WEIGHTS}")
    known = {name.rpartition(".")[2] for name in linears}
    r, alpha, dropout, targets = _settings(read_json(path / CONFIG), known, path / CONFIG)

    expected = {}  # PEFT's names -> shapes
    for module, (out_features, in_features) in linears.items():
        if module.rpartition(".")[2] in targets:
            expected[f"{PREFIX}{module}.lora_A.weight"] = torch.Size((r, in_features))
            expected[f"{PREFIX}{module}.lora_B.weight"] = torch.Size((out_features, r))
    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in sorted(expected.keys() - set(f.keys())):
                raise SmolError(f"{weights}: missing tensor {name}")
            for name in sorted(set(f.keys()) - expected.keys()):
                raise SmolError(f"{weights}: unexpected tensor {name}")
            for name, shape in expected.items():
                piece = f.get_slice(name)
                got = torch.Size(piece.get_shape())
                if got != shape:
                    a = name.endswith("lora_A.weight")  # A is (r, in), B is (out, r)
                    if len(got) == 2 and (got[1] == shape[1] if a else got[0] == shape[0]):  # this base, another r
                        raise SmolError(f"{weights}: tensor {name} has rank {got[0] if a else got[1]}, but "
                                        f"{CONFIG} says r={r}")
                    raise SmolError(f"{weights}: tensor {name} has shape {tuple(got)}, but this base model needs "
                                    f"{tuple(shape)} (an adapter for another base model?)")
                if piece.get_dtype() not in SAFETENSORS_FLOATS:
                    raise stored_type_error(weights, name, piece.get_dtype(), SAFETENSORS_FLOATS)
            tensors = {name: f.get_tensor(name) for name in expected}
    except (SafetensorError, OSError) as e:
        raise SmolError(f"{weights}: truncated or corrupt safetensors file ({e})") from None
    for name, tensor in tensors.items():
        if not all_finite(tensor):
            raise SmolError(f"{weights}: tensor {name} holds NaN or infinite values")
    tensors = {name.removeprefix(PREFIX): tensor for name, tensor in tensors.items()}
    return Adapter(r, alpha, dropout, targets, tensors)


def write_adapter(path: str | Path, adapter: Adapter, base: str | None = None) -> None:
    """Write `adapter` as PEFT writes one; base: the base model's name or path, where known."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base, r=adapter.r,
                  lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, target_modules=adapter.targets, bias="none",
                  fan_in_fan_out=False, init_lora_weights=True, inference_mode=True, modules_to_save=None,
                  use_dora=False, use_rslora=False, rank_pattern={}, alpha_pattern={}, layers_to_transform=None,
                  layers_pattern=None, revision=None)
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {PREFIX + name: t.detach().contiguous().cpu() for name, t in adapter.tensors.items()}
    from safetensors.torch import save_file  # here: ~0.75 MiB resident a GGUF run never reads

    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """weight + scaling * B A, computed in float32 and given back in the weight's dtype and device."""
    update = b.float().to(weight.device) @ a.float().to(weight.device)
    return (weight.float() + scaling * update).to(weight.dtype)


def merge_adapter(ckpt: Checkpoint, path: str | Path) -> None:
    """Fold the adapter at `path` into the checkpoint's weights, in place: a model built from them then needs
    no adapter modules, and any fast path runs it as it runs the base."""
    adapter = read_adapter(path, block_linears(parameter_shapes(ckpt.config)))
    for name, tensor in adapter.tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            ckpt.tensors[f"{module}.weight"] = merged(ckpt.weight(f"{module}.weight"), tensor,
                                                      adapter.tensors[f"{module}.lora_B.weight"], adapter.scaling)
            ckpt.quantized.pop(f"{module}.weight", None)  # GGUF's blocks hold the weight before the merge
