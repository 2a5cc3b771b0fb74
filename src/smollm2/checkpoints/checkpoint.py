"""Checkpoint: what every reader returns, config plus tensors named as transformers names them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import SmolConfig
from ..errors import SmolError


@dataclass
class Checkpoint:
    config: SmolConfig
    tensors: dict[str, torch.Tensor]
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> where it came from, for errors
    source: str = ""
    # float32 tensors decoded from GGUF blocks that the kernels stream -> those blocks, as kernels.block_layout
    # gives them, rows in the tensor's order: their exact values, in a few bits each
    blocks: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def check(self, expected: dict[str, torch.Size]) -> None:
        """Every tensor the model needs is here with the right shape and finite values, and nothing else is."""
        for name in sorted(expected.keys() - self.tensors.keys()):
            raise SmolError(f"{self.source}: missing tensor {name}")
        for name in sorted(self.tensors.keys() - expected.keys()):
            raise SmolError(f"{self.files.get(name, self.source)}: unexpected tensor {name}")
        for name, shape in expected.items():
            got = self.tensors[name].shape
            if got != shape:
                raise SmolError(f"{self.files.get(name, self.source)}: tensor {name} has shape {tuple(got)} "
                                f"but the config needs {tuple(shape)}")
        for name, tensor in self.tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise SmolError(f"{self.files.get(name, self.source)}: tensor {name} holds NaN or infinite values")
