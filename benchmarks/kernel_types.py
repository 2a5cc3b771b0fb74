"""How fast the decoding products stream each GGUF block type: bytes of weights read per second at a 1.7B's
shapes, beside Q8_0's, torch's float32 F.linear and the machine's plain read rate.

    .venv/bin/python benchmarks/kernel_types.py [--rows 1 4 16] [--seconds 1] [--types Q4_K Q6_K ...] [--int8]

A 1.7B layer's products (q_proj 2048 -> 2048, gate_proj and up_proj 2048 -> 8192, down_proj 8192 -> 2048) are
built from random blocks of each type (random bytes are valid blocks; float16 scales set finite), laid out as
the kernels stream them (packed.py), in enough copies that they never fit in the CPU's caches: each call reads
its weights from memory, as a decoding step does. Each type's products run through kernels.c's linear() for
--seconds at each row count; GB/s counts the bytes the kernel reads (its layout's, a little more than the
file's for the K-quants), tokens' worth of rows at once. "read" is torch summing a 512 MB float32 array on the
same threads: what memory gives a plain stream. torch's float32 F.linear reads 4 bytes a weight. --int8 times
each type's exact products and its int8-activation ones (kernels.c's rows_times) in turns, and their ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from smollm2.kernels import compiled
from smollm2.kernels.ops import TYPES
from smollm2.kernels.packed import PACKED_TYPES, packed_layout

SHAPES = [(2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]  # (out, in): q_proj, gate, up, down
SCALES_AT = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
             Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # where each type's float16 scales are, in its GGUF block
LEAST_BYTES = 96 * 2**20  # copies of the layer until they outgrow the caches (a 32 MB L3 here)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in SCALES_AT[qtype]:
        scale = rng.uniform(2e-4, 2e-3, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def rate(run, nbytes: int, seconds: float) -> float:
    """GB/s of nbytes read by each run(), its best of repeated passes over --seconds."""
    run()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def layers(make, nbytes_of_one: int) -> list:
    return [make() for _ in range(max(1, -(-LEAST_BYTES // nbytes_of_one)))]


def kernel_runs(qtype: Q, rows: int, rng: np.random.Generator) -> tuple[dict, int]:
    """run(int8) for a type's products (exact, or against int8 activations), and the bytes each run reads."""
    kind = PACKED_TYPES[qtype]
    one = sum(packed_layout(qtype, random_blocks(qtype, 1, k, rng)).data.numel() * n for n, k in SHAPES)
    copies = layers(lambda: [packed_layout(qtype, random_blocks(qtype, n, k, rng)).data for n, k in SHAPES], one)
    lib, x = compiled(), torch.randn(rows, 8192)
    y = torch.empty(rows * 8192)

    def run(int8: bool):
        for layer in copies:
            for (n, k), w in zip(SHAPES, layer):
                lib.linear(x=x.data_ptr(), type=TYPES[torch.float32], count=1, w=(ctypes.c_void_p * 1)(w.data_ptr()),
                           w_type=kind, scale=(ctypes.c_void_p * 1)(None), y=y.data_ptr(), B=rows,
                           N=(ctypes.c_long * 1)(n), K=k, int8=int8)

    return run, one * len(copies)


def kernel_rate(qtype: Q, rows: int, seconds: float, rng: np.random.Generator) -> float:
    run, nbytes = kernel_runs(qtype, rows, rng)
    return rate(lambda: run(False), nbytes, seconds)


def exact_and_int8(qtype: Q, rows: int, seconds: float, rng: np.random.Generator) -> tuple[float, float]:
    """GB/s of the exact products and of the int8-activation ones, each the best of its runs taken in turns (a
    busy machine slows both alike)."""
    run, nbytes = kernel_runs(qtype, rows, rng)
    best = {False: float("inf"), True: float("inf")}
    start = time.perf_counter()
    run(False), run(True)
    while time.perf_counter() - start < 2 * seconds:
        for int8 in best:
            t = time.perf_counter()
            run(int8)
            best[int8] = min(best[int8], time.perf_counter() - t)
    return nbytes / best[False] / 1e9, nbytes / best[True] / 1e9


def torch_rate(rows: int, seconds: float) -> float:
    one = sum(n * k * 4 for n, k in SHAPES)
    copies = layers(lambda: [torch.randn(n, k) for n, k in SHAPES], one)
    x = torch.randn(rows, 8192)

    def run():
        for layer in copies:
            for (n, k), w in zip(SHAPES, layer):
                F.linear(x[:, :k], w)

    with torch.inference_mode():
        return rate(run, one * len(copies), seconds)


def read_rate(seconds: float) -> float:
    a = torch.ones(2**27)
    return rate(lambda: a.sum(), a.numel() * 4, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                                       "Q6_K"])
    parser.add_argument("--int8", action="store_true", help="each type exact and against int8 activations, in turns")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.int8:
        print(f"{torch.get_num_threads()} threads; GB/s of weights read by a 1.7B layer's decoding products, "
              "exact / int8 activations (their ratio):")
        print(f"{'type':>8}" + "".join(f"{f'{r} rows':>24}" for r in args.rows))
        for name in args.types:
            rates = [exact_and_int8(Q[name], rows, args.seconds, rng) for rows in args.rows]
            print(f"{name:>8}" + "".join(f"{e:8.1f} / {i:5.1f} ({i / e:.2f}x)" for e, i in rates))
        return
    print(f"{torch.get_num_threads()} threads; read (torch sum of 512 MB float32): {read_rate(args.seconds):.1f} GB/s")
    print("GB/s of weights read by the decoding products of a 1.7B layer (q_proj, gate, up, down), x Q8_0's:")
    print(f"{'type':>8}" + "".join(f"{f'{r} rows':>18}" for r in args.rows))
    q8 = {}
    for name in dict.fromkeys(["Q8_0", *args.types]):
        rates = [kernel_rate(Q[name], rows, args.seconds, rng) for rows in args.rows]
        q8 = q8 or dict(zip(args.rows, rates))
        if name in args.types:
            print(f"{name:>8}" + "".join(f"{g:10.1f} ({g / q8[r]:.2f}x)" for r, g in zip(args.rows, rates)))
    print(f"{'torch':>8}" + "".join(f"{torch_rate(r, args.seconds):10.1f}        " for r in args.rows)
          + "(float32 F.linear)")


if __name__ == "__main__":
    main()
