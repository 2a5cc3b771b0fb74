"""The model a fine-tune (SFT or DPO) starts from: the checkpoint in float32, whatever it stores, and with LoRA
frozen under a fresh adapter, over an int8 base for QLoRA."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..errors import SmolError
from ..loading import load
from ..lora import DEFAULT_TARGETS, add_lora
from ..model import SmolLM2
from ..quantize import quantize_int8


@dataclass(frozen=True)
class LoRASettings:
    r: int
    alpha: float | None = None  # the update is scaled by alpha / r; None: r (a scale of 1)
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    quantize: str | None = None  # the frozen base's weights: "int8" for QLoRA

    def __post_init__(self):
        if self.quantize not in (None, "int8"):
            raise SmolError(f"quantize must be None or 'int8', got {self.quantize!r}")

    def as_run(self) -> dict:
        """What run.json records of the adapter, so that --resume refuses other settings."""
        return {**dataclasses.asdict(self), "alpha": self.r if self.alpha is None else self.alpha,
                "targets": list(self.targets)}


def model_to_tune(src=None, lora: LoRASettings | None = None, seed: int = 0) -> SmolLM2:
    """src (as smollm2.load takes it) in float32 on the reference modules, ready to train: every weight, or with `lora`
    a fresh adapter alone over frozen weights (lora.quantize="int8": an int8 base, QLoRA). The adapter's initial A
    follows `seed`."""
    model = load(src, kernels=False)
    if lora is not None:
        if lora.quantize == "int8":
            quantize_int8(model)
        torch.manual_seed(seed)
        add_lora(model, lora.r, lora.r if lora.alpha is None else lora.alpha, lora.targets, lora.dropout)
    return model


def process_device(device: str) -> torch.device:
    """The device this process trains on: under torchrun on GPUs, its own (LOCAL_RANK)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else torch.device(device)
