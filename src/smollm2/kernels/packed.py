"""GGUF's quantized blocks in the layout the kernels stream, and decoded from it (unpacked). A float32 model read
from a GGUF file holds its matrices as these alone (held.py; Checkpoint.quantized gives the file's blocks), and
the decoding kernels read those few bits a weight, the float32 values gguf decodes.

The layout (kernels.c's block types) is blocks of 32 weights, each opening with float32 scales: GGUF's float16
ones converted exactly, or for the K-quants (super-blocks of 256 with 6- or 8-bit sub-block scales) each sub-block's
scale and min already multiplied by its super-block's, as gguf.quants.dequantize multiplies them, in float32 (exact
products: 11 bits times 6 or 8). Then the integers: 4-bit ones two a byte (byte j: weight j low, j + 16 high), a
fifth and sixth bit as 32-bit words (bit j for weight j), Q8_0's int8 as they are. Bits a weight streamed:
Q4_0 5, Q4_1 and Q4_K 6, Q5_K 7, Q6_K 8, Q8_0 9 (the files': 4.5, 5, 4.5, 5.5, 6.6, 8.5)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

Q = GGMLQuantizationType
PACKED_TYPES = {Q.Q4_1: 3, Q.Q8_0: 4, Q.Q4_0: 5, Q.Q4_K: 6, Q.Q5_K: 7, Q.Q6_K: 8}  # GGUF's kind -> kernels.c's
# kernels.c's type -> bytes a block of 32 weights
PACKED_BYTES = {3: 24, 4: 36, 5: 20, 6: 24, 7: 28, 8: 32}


class Packed(NamedTuple):
    """A float32 weight's exact values as GGUF packed them, in the layout the kernels stream (packed_layout)."""
    type: int  # kernels.c's block type
    data: torch.Tensor  # uint8 (N, K / 32 * PACKED_BYTES[type])


def half(bytes_: np.ndarray) -> np.ndarray:
    """Float16s (as pairs of bytes, last axis) as float32, exactly."""
    return np.ascontiguousarray(bytes_).view(np.float16).astype(np.float32)


def words(values: np.ndarray) -> np.ndarray:
    """float32 (..., n) as their bytes (..., 4n)."""
    return np.ascontiguousarray(values).view(np.uint8)


def nibbles(q: np.ndarray) -> np.ndarray:
    """Integers (..., 32) below 16 as 16 bytes: byte j holds weight j low, j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def bit_word(q: np.ndarray, bit: int) -> np.ndarray:
    """Bit `bit` of each of 32 integers (..., 32), uint8, as the 4 bytes of one little-endian 32-bit word: its
    bit j is weight j's."""
    return np.packbits(q >> bit & 1, axis=-1, bitorder="little")


def k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's super-blocks (n, bytes): each sub-block's d * sc and dmin * m (n, 8, 1), float32 as
    gguf computes them."""
    d, dmin = half(blocks[:, 0:2]), half(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return (d * sc.astype(np.float32))[..., None], (dmin * m.astype(np.float32))[..., None]


def low_bits(qs: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 128 bytes of 4-bit q (n, 128) as each sub-block's (n, 8, 32): bytes 32p..32p+31 hold
    sub-block 2p low, 2p + 1 high."""
    pairs = qs.reshape(len(qs), 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (pairs & 15).reshape(len(qs), 8, 32)


def blocks_of(kind: Q, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks of `kind` (n, block bytes) as kernels.c's blocks of 32 (n, 256 / 32 or 1, PACKED_BYTES)."""
    n = len(blocks)
    if kind in (Q.Q4_1, Q.Q8_0):
        scales = 2 if kind == Q.Q4_1 else 1
        return np.concatenate([words(half(blocks[:, :2 * scales])), blocks[:, 2 * scales:]], axis=-1)[:, None]
    if kind == Q.Q4_0:
        return np.concatenate([words(half(blocks[:, :2])), blocks[:, 2:]], axis=-1)[:, None]
    if kind in (Q.Q4_K, Q.Q5_K):
        scaled, least = k_scales(blocks)
        q = low_bits(blocks[:, -128:])
        parts = [words(scaled), words(-least), nibbles(q)]
        if kind == Q.Q5_K:  # 32 bytes from byte 16: bit i of byte j is sub-block i's weight j's fifth bit
            high = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            parts.append(bit_word(high, 0))
        return np.concatenate(parts, axis=-1)
    # Q6_K: 128 bytes of low 4 bits, 64 of high 2, 16 int8 scales (one per 16 weights), float16 d
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low & 15).reshape(n, 8, 32) | ((high & 3).reshape(n, 8, 32) << 4)
    scaled = half(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    return np.concatenate([words(scaled.reshape(n, 8, 2)), nibbles(q & 15), bit_word(q, 4), bit_word(q, 5)],
                          axis=-1)


def packed_layout(kind: int, blocks: torch.Tensor) -> Packed | None:
    """GGUF blocks of `kind`, uint8 (rows, bytes a row), in the layout the kernels stream; None for kinds they do
    not stream. Laid out by numpy, which asks Linux for huge pages for its large arrays (the embeddings'), where
    torch does not: the decoding step streams them once a token, with fewer TLB misses."""
    if kind not in PACKED_TYPES:
        return None
    kind = Q(kind)
    data = blocks.numpy()
    ours = blocks_of(kind, data.reshape(-1, GGML_QUANT_SIZES[kind][1]))
    return Packed(PACKED_TYPES[kind], torch.from_numpy(np.ascontiguousarray(ours).reshape(data.shape[0], -1)))


def streams(weight: torch.Tensor, packed: Packed | None) -> bool:
    """Whether the kernels can stream `weight` (float32 decoded from GGUF) from `packed` instead."""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    return (packed is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and K % 32 == 0
            and packed.data.shape == (N, K // 32 * PACKED_BYTES[packed.type]))


# kernels.c's types whose layout unpacked() decodes: a type the kernels stream is held as its blocks alone only
# once it is here (held.py), else kept as float32 values
UNPACKED = {PACKED_TYPES[kind] for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)}


def unpacked(packed: Packed, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights `packed` holds, (N, K), or only `rows` of them (row indices, any shape: (*rows.shape,
    K)), each the value kernels.c computes from its block (load_block), which is gguf.quants.dequantize's bit
    for bit: a * q or a * q + b, rounded once each (no fused multiply-add), Q6_K's second half b * q. A new
    tensor each call, decoded by torch (~3-6 ns a weight on one core: 0.1 s for a 1536 x 576 matrix of the
    135M model at the worst)."""
    if packed.type not in UNPACKED:
        raise ValueError(f"no decoding of kernels.c's block type {packed.type}")
    data = packed.data if rows is None else packed.data[rows]
    size = PACKED_BYTES[packed.type]
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // size, size)  # (..., K / 32, bytes)
    a = blocks[..., 0:4].contiguous().view(torch.float32)  # (..., K / 32, 1)
    if packed.type == PACKED_TYPES[Q.Q8_0]:
        return blocks[..., 4:].contiguous().view(torch.int8).float().mul_(a).reshape(*data.shape[:-1], -1)
    start = 4 if packed.type == PACKED_TYPES[Q.Q4_0] else 8
    nibbles = blocks[..., start:start + 16]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # weight j low in byte j, weight j + 16 high
    for bit, at in ((4, 24), (5, 28))[:{PACKED_TYPES[Q.Q5_K]: 1, PACKED_TYPES[Q.Q6_K]: 2}.get(packed.type, 0)]:
        word = blocks[..., at:at + 4, None]  # bit j of this little-endian word is weight j's
        q |= ((word >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(q.shape) << bit
    w = q.float()
    b = blocks[..., 4:8].contiguous().view(torch.float32)
    if packed.type == PACKED_TYPES[Q.Q4_0]:
        w.sub_(8).mul_(a)
    elif packed.type == PACKED_TYPES[Q.Q6_K]:
        w.sub_(32)
        w[..., :16].mul_(a)
        w[..., 16:].mul_(b)
    else:  # Q4_1, Q4_K, Q5_K
        w.mul_(a).add_(b)
    return w.reshape(*data.shape[:-1], -1)
