"""GGUF's Q4_1 and Q8_0 blocks in the layout the kernels stream. A float32 weight decoded from them keeps them
beside it (Checkpoint.quantized gives the file's blocks), and the decoding kernels read those few bits a weight
instead of its float32 copy: 4-5x fewer bytes, the same values."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

PACKED_TYPES = {GGMLQuantizationType.Q4_1: 3, GGMLQuantizationType.Q8_0: 4}  # GGUF's kind -> kernels.c's type
SCALES = {GGMLQuantizationType.Q4_1: 2, GGMLQuantizationType.Q8_0: 1}  # float16s that open each block of 32
# kernels.c's type -> bytes a block of 32 weights, its scales widened to float32
PACKED_BYTES = {PACKED_TYPES[kind]: GGML_QUANT_SIZES[kind][1] + 2 * SCALES[kind] for kind in PACKED_TYPES}


class Packed(NamedTuple):
    """A float32 weight's exact values as GGUF packed them, in the layout the kernels stream (packed_layout)."""
    type: int  # kernels.c's Q4_1 or Q8_0
    data: torch.Tensor  # uint8 (N, K / 32 * PACKED_BYTES[type])


def packed_layout(kind: int, blocks: torch.Tensor) -> Packed | None:
    """GGUF blocks of `kind`, uint8 (rows, bytes a row), in the layout the kernels stream; None for kinds they do
    not stream. Their float16 scales become float32 (exactly), which the CPU broadcasts for free. Laid out by
    numpy, which asks Linux for huge pages for its large arrays (the embeddings'), where torch does not: the
    decoding step streams them once a token, with fewer TLB misses."""
    kind = GGMLQuantizationType(kind)
    if kind not in PACKED_TYPES:
        return None
    data = blocks.numpy()
    rows = data.reshape(data.shape[0], -1, GGML_QUANT_SIZES[kind][1])  # (N, K / 32, block size)
    scales = np.ascontiguousarray(rows[..., :2 * SCALES[kind]]).view(np.float16).astype(np.float32)
    ours = np.concatenate([scales.view(np.uint8), rows[..., 2 * SCALES[kind]:]], axis=-1)
    return Packed(PACKED_TYPES[kind], torch.from_numpy(ours.reshape(data.shape[0], -1)))


def streams(weight: torch.Tensor, packed: Packed | None) -> bool:
    """Whether the kernels can stream `weight` (float32 decoded from GGUF) from `packed` instead."""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    return (packed is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and K % 32 == 0
            and packed.data.shape == (N, K // 32 * PACKED_BYTES[packed.type]))
