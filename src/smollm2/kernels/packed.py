"""GGUF's quantized blocks in the layout the kernels stream, and decoded from it (unpacked). A float32 model read
from a GGUF file holds its matrices as these alone (held.py; Checkpoint.quantized gives the file's blocks), and
the decoding kernels read those few bits a weight, the float32 values gguf decodes.

The K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights with 6- or 8-bit sub-block scales) stream as the file
holds them, not copied: the kernels unpack a super-block's scales once and multiply them as
gguf.quants.dequantize does, in float32. The others are laid out again (kernels.c's block types), blocks of 32
weights each opening with float32 scales (GGUF's float16 ones converted exactly), then the integers: 4-bit ones two
a byte (byte j: weight j low, j + 16 high), a fifth bit as a 32-bit word (bit j for weight j), Q8_0's int8 as they
are. Bits a weight streamed: Q4_0 5, Q4_1 6, Q5_0 6, Q5_1 7, Q8_0 9 (the files': 4.5, 5, 5.5, 6, 8.5); Q4_K 4.5,
Q5_K 5.5, Q6_K 6.56, the file's. Q5_0 and Q5_1 are what llama-quantize writes for Q4_K and Q5_K matrices whose rows
are not whole super-blocks (SmolLM2-135M's and -360M's widths, 576 and 960), Q8_0 for Q6_K ones."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

Q = GGMLQuantizationType
PACKED_TYPES = {Q.Q4_1: 3, Q.Q8_0: 4, Q.Q4_0: 5, Q.Q4_K: 6, Q.Q5_K: 7, Q.Q6_K: 8, Q.Q5_0: 9,
                Q.Q5_1: 10}  # GGUF's kind -> kernels.c's
# kernels.c's type -> weights and bytes of a block (a K-quant's super-block)
PACKED_BLOCKS = {3: (32, 24), 4: (32, 36), 5: (32, 20), 6: (256, 144), 7: (256, 176), 8: (256, 210), 9: (32, 24),
                 10: (32, 28)}
AS_IN_THE_FILE = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


class Packed(NamedTuple):
    """A float32 weight's exact values as GGUF packed them, in the layout the kernels stream (packed_layout)."""
    type: int  # kernels.c's block type
    data: torch.Tensor  # uint8 (N, K / weights * bytes), PACKED_BLOCKS[type]


def half(bytes_: np.ndarray) -> np.ndarray:
    """Float16s (as pairs of bytes, last axis) as float32, exactly."""
    return np.ascontiguousarray(bytes_).view(np.float16).astype(np.float32)


def words(values: np.ndarray) -> np.ndarray:
    """float32 (..., n) as their bytes (..., 4n)."""
    return np.ascontiguousarray(values).view(np.uint8)


def blocks_of(kind: Q, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks of 32 weights of `kind` (n, block bytes) as kernels.c's (n, block bytes)."""
    if kind in (Q.Q4_1, Q.Q8_0):
        scales = 2 if kind == Q.Q4_1 else 1
        return np.concatenate([words(half(blocks[:, :2 * scales])), blocks[:, 2 * scales:]], axis=-1)
    if kind == Q.Q4_0:
        return np.concatenate([words(half(blocks[:, :2])), blocks[:, 2:]], axis=-1)
    # Q5_0, Q5_1: float16 scale (and min), the 32 fifth bits as one word, then 16 bytes of 4 bits
    scales = 2 if kind == Q.Q5_1 else 1
    fifth, low = blocks[:, 2 * scales:2 * scales + 4], blocks[:, 2 * scales + 4:]
    return np.concatenate([words(half(blocks[:, :2 * scales])), low, fifth], axis=-1)


def packed_layout(kind: int, blocks: torch.Tensor) -> Packed | None:
    """GGUF blocks of `kind`, uint8 (rows, bytes a row), in the layout the kernels stream; None for kinds they do
    not stream. The K-quants' are the blocks themselves (no copy, where contiguous); the others are laid out by
    numpy, which asks Linux for huge pages for its large arrays (the embeddings'), where torch does not: the
    decoding step streams them once a token, with fewer TLB misses."""
    if kind not in PACKED_TYPES:
        return None
    kind = Q(kind)
    if kind in AS_IN_THE_FILE:
        return Packed(PACKED_TYPES[kind], blocks.contiguous())
    data = blocks.numpy()
    ours = blocks_of(kind, data.reshape(-1, GGML_QUANT_SIZES[kind][1]))
    return Packed(PACKED_TYPES[kind], torch.from_numpy(np.ascontiguousarray(ours).reshape(data.shape[0], -1)))


def streams(weight: torch.Tensor, packed: Packed | None) -> bool:
    """Whether the kernels can stream `weight` (float32 decoded from GGUF) from `packed` instead."""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    if packed is None:
        return False
    size, nbytes = PACKED_BLOCKS[packed.type]
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and K % size == 0
            and packed.data.shape == (N, K // size * nbytes) and packed.data.is_contiguous())


def unpacked(packed: Packed, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights `packed` holds, (N, K), or only `rows` of them (row indices, any shape: (*rows.shape,
    K)), each the value kernels.c computes from its block (load_block), which is gguf.quants.dequantize's bit
    for bit. The K-quants' blocks are the file's, so gguf decodes them itself (numpy); the others' layout is ours,
    decoded by torch as gguf does: a * q or a * q + b, rounded once each (no fused multiply-add). A new tensor
    each call (~3-14 ns a weight on one core: 0.1-0.2 s for a 1536 x 576 matrix of the 135M model at the worst)."""
    data = packed.data if rows is None else packed.data[rows]
    kind = next(kind for kind, ours in PACKED_TYPES.items() if ours == packed.type)
    if kind in AS_IN_THE_FILE:
        return torch.from_numpy(dequantize(data.numpy(), kind))
    size = PACKED_BLOCKS[packed.type][1]
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // size, size)  # (..., K / 32, bytes)
    a = blocks[..., 0:4].contiguous().view(torch.float32)  # (..., K / 32, 1)
    if kind == Q.Q8_0:
        return blocks[..., 4:].contiguous().view(torch.int8).float().mul_(a).reshape(*data.shape[:-1], -1)
    start = 8 if kind in (Q.Q4_1, Q.Q5_1) else 4  # past a, or a and b
    nibbles = blocks[..., start:start + 16]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # weight j low in byte j, weight j + 16 high
    if kind in (Q.Q5_0, Q.Q5_1):
        word = blocks[..., start + 16:start + 20, None]  # bit j of this little-endian word is weight j's fifth
        q |= ((word >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(q.shape) << 4
    w = q.float()
    if kind in (Q.Q4_0, Q.Q5_0):
        w.sub_(8 if kind == Q.Q4_0 else 16).mul_(a)
    else:  # Q4_1, Q5_1
        w.mul_(a).add_(blocks[..., 4:8].contiguous().view(torch.float32))
    return w.reshape(*data.shape[:-1], -1)
