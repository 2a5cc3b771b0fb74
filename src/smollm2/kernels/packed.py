"""GGUF's quantized blocks as the kernels stream them, and decoded from them (unpacked). A float32 model read from a
GGUF file holds its matrices as these alone (held.py; Checkpoint.quantized gives the file's blocks), and the
decoding kernels read those few bits a weight, the float32 values gguf decodes.

Every type streams as the file holds it, nothing laid out again: the blocks are the file's own bytes (q and k,
whose rows llama.cpp permuted, in the model's order), a model's copy of them in huge pages (HugePages, below):
not the file's mapped pages, whose 4 KiB pages the decoding step streamed slower. Blocks of 32
weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) open with a float16 scale (Q4_1's, Q5_1's: and a float16 minimum), which
kernels.c converts as it reads a block (exactly: every float16 is a float32), then the integers: 4-bit ones two a
byte (byte j: weight j low, j + 16 high), Q5's fifth bits a 32-bit word before them (bit j for weight j), Q8_0's
int8 as they are. The K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights with 6- or 8-bit sub-block scales):
the kernels unpack a super-block's scales once and multiply them as gguf.quants.dequantize does, in float32. Bits a
weight streamed, the file's: Q4_0 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q8_0 8.5, Q4_K 4.5, Q5_K 5.5, Q6_K 6.56. Q5_0 and
Q5_1 are what llama-quantize writes for Q4_K and Q5_K matrices whose rows are not whole super-blocks (SmolLM2-135M's
and -360M's widths, 576 and 960), Q8_0 for Q6_K ones.

The exceptions, where asked (packed_layout's repack), with AVX-512 VNNI: Q4_0 is laid out again once, at load, as
rows of stripes (kernels.c's Q4_0_STRIPES, repack_stripes: the same bytes, each stripe of 16 blocks' 4-bit q
transposed into its int8 tile's lanes, then the row's scales), which that tile decodes in about half the
instructions a stripe of the file's blocks: the 1.7B's Q4_0 int8 decoding was under llama.cpp's, which lays Q4_0 out
again at load as well. And the K-quants (kernels.c's Q4_K_ACROSS, Q5_K_ACROSS, Q6_K_ACROSS, repack_across: each
super-block's bytes in place, its scales where the file has them, its q in the order of the int8 tile's steps), so
that a step's integers are a load, a shift and a mask, not a permutation and variable shifts of the file's bytes.
With AVX2 (kernels.c's eights_block), every block type (Q4_0, Q8_0_EIGHTS, Q4_1_EIGHTS.., the K-quants) is laid
out as groups of 8 rows
side by side instead, each block's q a row a 32-bit lane, then the group's scales: a step multiplies 4 weights of 8
rows, and a block's sums are converted and scaled once for all 8 (llama.cpp lays Q4_0 and Q4_K out so at AVX2);
the same bytes, whole groups of rows (GROUP). A copy of the matrix's bytes, made one matrix at a time (a pass over
its bytes); the file's pages it was made from are let go. The exact products and dequantize put its rows back as
the file's blocks first; rows looked up (an embedding's) are decoded a group at a time."""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .build import compiled

Q = GGMLQuantizationType
PACKED_TYPES = {Q.Q4_1: 3, Q.Q8_0: 4, Q.Q4_0: 5, Q.Q4_K: 6, Q.Q5_K: 7, Q.Q6_K: 8, Q.Q5_0: 9,
                Q.Q5_1: 10}  # GGUF's kind -> kernels.c's
STRIPES = 11  # kernels.c's Q4_0_STRIPES: Q4_0 laid out again (repack_stripes)
# kernels.c's Q4_K_ACROSS..., and Q8_0_EIGHTS..: laid out again by repack_across (the K-quants with AVX-512 VNNI;
# with AVX2 those and the other block types but Q4_0)
ACROSS = {Q.Q4_K: 12, Q.Q5_K: 13, Q.Q6_K: 14, Q.Q8_0: 15, Q.Q4_1: 16, Q.Q5_0: 17, Q.Q5_1: 18}
LAID_OUT = {STRIPES: Q.Q4_0} | {ours: kind for kind, ours in ACROSS.items()}  # laid out again -> the file's kind
# kernels.c's type -> weights and bytes of a block (a K-quant's super-block), GGUF's
PACKED_BLOCKS = {ours: GGML_QUANT_SIZES[kind] for kind, ours in PACKED_TYPES.items()} | {
    ours: GGML_QUANT_SIZES[kind] for ours, kind in LAID_OUT.items()}


class Packed(NamedTuple):
    """A float32 weight's exact values as GGUF packed them: the file's blocks, which the kernels stream."""
    type: int  # kernels.c's block type
    data: torch.Tensor  # uint8 (N, K / weights * bytes), PACKED_BLOCKS[type]


GROUP = 16  # rows laid out again together at most (AVX2's Q4_0: 8), the kernels' rows a step at most (LANES)
LOOKED_UP = 8  # groups of rows unpacked() decodes at a time
HUGE = 2 << 20  # a huge page (x86-64's, AArch64's with 4 KiB pages)
NUMPYS = 4 << 20  # numpy asks Linux for huge pages itself for arrays from this size on


class HugePages:
    """Room for a model's matrices in huge pages, where Linux gives them (transparent huge pages, asked for with
    madvise): side by side in rooms of ROOM bytes, which a matrix alone would not fill (a 360M model's are 0.3-2.6
    MiB, all of them), a larger one in a room of its own, each room starting at a huge page's start (numpy's arrays
    start anywhere, their first and last pages small). A decoding step streams every matrix
    once a token: from 4 KiB pages (a GGUF file's mapped ones, the page cache's, as held before) the 360M Q8_0 and
    Q6_K files decoded 0.88x and 0.90x as fast as from huge pages, the embedded one 0.94x, two models of one file in
    one process taking turns (benchmarks/huge_pages.py). The cost: a copy at load (the file's pages read, copied,
    let go), and pages no longer shared between processes that map one file. A room is let go when the last matrix
    in it is: one for each model loaded (accelerate())."""

    ROOM = 64 << 20

    def __init__(self):
        self.free = np.empty(0, np.uint8)  # what is left of the newest room

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized uint8 tensor of `shape` in huge pages: in a room of its own where larger than one."""
        n = math.prod(shape)
        if n > self.free.size:
            size = max(self.ROOM, n)
            # Private and anonymous: untouched pages are never resident, and huge ones are had (a shared mapping,
            # mmap's default, is shared memory, which Linux gives huge pages only where set to: by default never).
            private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
            pages = mmap.mmap(-1, size + HUGE, flags=private) if private else mmap.mmap(-1, size + HUGE)
            with contextlib.suppress(AttributeError, OSError):  # no THP (not Linux, or turned off): small pages
                pages.madvise(mmap.MADV_HUGEPAGE)
            room = np.frombuffer(pages, np.uint8)  # keeps the mapping while any matrix in it lives
            first = -room.ctypes.data % HUGE  # huge pages start at multiples of their size
            self.free = room[first:first + size]
        taken, self.free = self.free[:n], self.free[(n + 63) // 64 * 64:]  # each matrix 64-byte aligned
        return torch.from_numpy(taken).view(shape)

    def copy(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks in huge pages: a copy, unless numpy's own from 4 MiB (the loader's copies of those: most of their
        pages are huge already, and a second copy would cost as much time again)."""
        if blocks.numel() >= NUMPYS and blocks.is_contiguous():
            return blocks
        return self.empty(tuple(blocks.shape)).copy_(blocks)


def lays_out(lib, kind: int) -> bool:
    """Whether this CPU's kernels lay `kind` out again (a call for no rows: 1 where that code is built, else 0)."""
    if kind == Q.Q4_0:
        return bool(lib.repack_stripes(w=None, N=0, K=0, out=None))
    return bool(lib.repack_across(w=None, type=PACKED_TYPES[Q(kind)], N=0, K=0, out=None))


def packed_layout(kind: int, blocks: torch.Tensor, repack: bool = False,
                  pages: HugePages | None = None) -> Packed | None:
    """GGUF blocks of `kind`, uint8 (rows, bytes a row), as the kernels stream them: the blocks themselves (no
    copy, where contiguous) or with `pages`, a copy in those huge pages; None for kinds they do not stream.
    repack: Q4_0 laid out again as rows of stripes (AVX2: groups of 8 rows), a K-quant as its int8 tile's steps,
    where the kernels decode those the faster (see the top), a copy (in `pages`, else numpy's: huge pages from 4
    MiB); for whole groups of rows (GROUP), the matrices a model has."""
    if kind not in PACKED_TYPES:
        return None
    lib = compiled() if repack and (kind == Q.Q4_0 or kind in ACROSS) and blocks.shape[0] % GROUP == 0 else None
    if lib is not None and lays_out(lib, kind):  # asked first: room taken for nothing held a matrix twice (SSE2)
        shape = tuple(blocks.shape)
        again = pages.empty(shape) if pages is not None else torch.from_numpy(np.empty(shape, np.uint8))
        rows = blocks.contiguous()
        size, nbytes = GGML_QUANT_SIZES[Q(kind)]
        N, K = rows.shape[0], rows.shape[1] // nbytes * size
        if kind == Q.Q4_0:
            lib.repack_stripes(w=rows.data_ptr(), N=N, K=K, out=again.data_ptr())
            return Packed(STRIPES, again)
        lib.repack_across(w=rows.data_ptr(), type=PACKED_TYPES[Q(kind)], N=N, K=K, out=again.data_ptr())
        return Packed(ACROSS[Q(kind)], again)
    return Packed(PACKED_TYPES[Q(kind)], blocks.contiguous() if pages is None else pages.copy(blocks))


def streams(weight: torch.Tensor, packed: Packed | None) -> bool:
    """Whether the kernels can stream `weight` (float32 decoded from GGUF) from `packed` instead."""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    if packed is None:
        return False
    size, nbytes = PACKED_BLOCKS[packed.type]
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and K % size == 0
            and packed.data.shape == (N, K // size * nbytes) and packed.data.is_contiguous())


def kernels_decoded(data: torch.Tensor, w_type: int, K: int) -> torch.Tensor:
    """Blocks data (N, bytes a row) of kernels.c's w_type as float32 (N, K), by kernels.c's dequantize (built)."""
    out = torch.empty(data.shape[0], K)
    if compiled().dequantize(w=data.data_ptr(), w_type=w_type, out=out.data_ptr(), N=data.shape[0], K=K):
        raise MemoryError(f"out of memory decoding a {data.shape[0]} x {K} matrix (a copy of its blocks)")
    return out


def unpacked(packed: Packed, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights `packed` holds, (N, K), or only `rows` of them (row indices, any shape: (*rows.shape,
    K)), each the value kernels.c computes from its block (load_block), which is gguf.quants.dequantize's bit
    for bit. The K-quants gguf decodes itself (numpy); blocks of 32 torch decodes as gguf does: a * q or a * q + b,
    rounded once each (no fused multiply-add). A new tensor each call (~3-14
    ns a weight on one core: 0.1-0.2 s for a 1536 x 576 matrix of the 135M model at the worst)."""
    # Laid out again (made only where the kernels are built): theirs. Rows looked up (an embedding's, each
    # decoding step) theirs too where built: one call, not torch's ~10 operations.
    if packed.type in LAID_OUT or (rows is not None and compiled() is not None):
        K = packed.data.shape[1] // PACKED_BLOCKS[packed.type][1] * PACKED_BLOCKS[packed.type][0]
        if rows is None:
            return kernels_decoded(packed.data, packed.type, K)
        flat = rows.reshape(-1)
        if packed.type in LAID_OUT:  # rows laid out together (AVX2: 8 side by side): their groups decoded,
            # LOOKED_UP at a time (a 128-token prompt's groups at once were 8 MiB of float32 at the 360M's width,
            # a process's peak)
            groups, which = torch.unique(flat // GROUP, return_inverse=True)
            out = torch.empty(flat.numel(), K)
            for first in range(0, len(groups), LOOKED_UP):
                data = packed.data.view(-1, GROUP * packed.data.shape[1])[groups[first:first + LOOKED_UP]]
                decoded = kernels_decoded(data.view(-1, packed.data.shape[1]), packed.type, K).view(-1, GROUP, K)
                these = (which >= first) & (which < first + LOOKED_UP)
                out[these] = decoded[which[these] - first, flat[these] % GROUP]
            return out.reshape(*rows.shape, K)
        return kernels_decoded(packed.data[flat], packed.type, K).reshape(*rows.shape, K)
    data = packed.data if rows is None else packed.data[rows]
    kind = next(kind for kind, ours in PACKED_TYPES.items() if ours == packed.type)
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return torch.from_numpy(dequantize(data.numpy(), kind))
    size = PACKED_BLOCKS[packed.type][1]
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // size, size)  # (..., K / 32, bytes)
    a = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (..., K / 32, 1): float16's value, exactly
    if kind == Q.Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).float().mul_(a).reshape(*data.shape[:-1], -1)
    fifth = 4 if kind == Q.Q5_1 else 2  # past a, or a and b
    start = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q5_0: 6, Q.Q5_1: 8}[kind]  # the 4-bit q: past the scales and fifth bits
    nibbles = blocks[..., start:start + 16]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # weight j low in byte j, weight j + 16 high
    if kind in (Q.Q5_0, Q.Q5_1):
        word = blocks[..., fifth:fifth + 4, None]  # bit j of this little-endian word is weight j's fifth
        q |= ((word >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(q.shape) << 4
    w = q.float()
    if kind in (Q.Q4_0, Q.Q5_0):
        w.sub_(8 if kind == Q.Q4_0 else 16).mul_(a)
    else:  # Q4_1, Q5_1
        w.mul_(a).add_(blocks[..., 2:4].contiguous().view(torch.float16).float())
    return w.reshape(*data.shape[:-1], -1)
