"""CPU kernels for decoding (kernels.c): few-row matrix products and attention of a few queries.

They stream bf16 and int8 weights at close to the memory's speed, where torch's BLAS calls reach a
fraction of it, and a row's result does not depend on how many rows share the call. The C source is
compiled for this machine on first use (a second or so) into the user's cache; without a working C
compiler everything runs on torch's own kernels, only slower. Everything else (many rows, gradients,
torch.compile, other devices) runs on torch as well.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
MAX_ROWS = 16  # decoding steps of up to 16 rows; a prompt's many rows are bound by arithmetic: BLAS tiles those
MAX_HEAD_DIM = 256  # as kernels.c
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}

NATIVE_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
enabled = True  # False: torch's kernels everywhere (the plain path, which tests compare against)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smollm2"


def cpu_signature() -> str:
    """-march=native code runs only on this CPU model: a shared cache keeps one build per model."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return platform.machine() + platform.processor()


@functools.cache
def compiled_library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join([compiler, *FLAGS]).encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    try:
        path = cache_dir() / f"kernels-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then renamed: never a half-written file
                built = Path(tmp) / path.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                built.replace(path)
        lib = ctypes.CDLL(str(path))  # its OpenMP is the runtime torch has loaded: one thread pool
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: no home directory
        detail = (getattr(e, "stderr", b"") or str(e).encode()).decode(errors="replace").strip().splitlines()
        warnings.warn(f"smollm2: CPU decoding kernels unavailable ({compiler}: {detail[-1] if detail else e}); "
                      "using torch's, slower", stacklevel=2)
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    n = ctypes.c_long
    lib.linear.argtypes = [p, i, i, p, i, p, p, i, n, p, n]  # as kernels.c
    lib.swiglu.argtypes = [p, i, p, p, i, p, p, p, i, n, n, n]
    lib.attention.argtypes = [p, p, p, p, i, n, n, n, n, n, n, n, n, p]
    lib.rms_norm.argtypes = [p, p, p, i, n, n, ctypes.c_float]
    lib.rope.argtypes = [p, p, p, i, n, n, n]
    return lib


def usable(x: torch.Tensor, rows: int) -> bool:
    """Whether x, holding `rows` rows (tokens), goes to the kernels: decoding (a few rows) on the CPU.

    Many rows (a prompt) stay on torch: its products are faster there, and its results are transformers'
    to the last bit (the kernels' differ in the last bits: another order of summation). So do gradients."""
    return (enabled and rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and compiled_library() is not None)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T on torch. Where the CPU has no bf16 arithmetic, torch emulates a bf16 product of many
    rows (a prompt) several times slower than widening both sides to float32 first; a bf16 product sums
    in float32 anyway, so inference does that (one rounding at the end, as a bf16 product has)."""
    if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not NATIVE_BF16 and not torch.is_grad_enabled()
            and x.numel() > MAX_ROWS * x.shape[-1]):
        y = F.linear(x.float(), weight.float())
        return (y if scale is None else y * scale.float()).to(x.dtype)
    y = F.linear(x, weight.to(x.dtype))  # under autocast, in its dtype
    return y if scale is None else y * scale.to(y.dtype)


def pointers(tensors, kind=ctypes.c_void_p):
    return (kind * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


class Plan(NamedTuple):
    """The C call's view of a set of weights."""
    weights: ctypes.Array  # their addresses
    scales: ctypes.Array  # the addresses of their float32 scales, or NULL
    sizes: list[int]  # their output sizes N
    c_sizes: ctypes.Array  # the same, for C
    weight_type: int
    float_scales: list  # what `scales` points into, kept alive here


plans: dict[tuple, Plan | None] = {}  # by where the weights are


def plan(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None]) -> Plan | None:
    """How the kernel multiplies x by these weights, or None when it cannot. Built once per set: a model's
    weights stay where they are, and the per-call checks and ctypes arrays would cost more than a small
    product."""
    key = (x.shape[-1], x.dtype, *((w.data_ptr(), w.shape, w.stride(0), w.dtype, s if s is None else
                                   (s.data_ptr(), s.dtype)) for w, s in zip(weights, scales)))
    if key not in plans:
        K, w_type = x.shape[-1], weights[0].dtype
        found = None
        if K % 16 == 0 and w_type in (x.dtype, torch.int8) and all(
                w.dtype == w_type and w.shape[1] == K and w.shape[0] % 4 == 0 and w.is_contiguous() for w in weights):
            scales = [None if s is None else s.float().contiguous() for s in scales]
            sizes = [w.shape[0] for w in weights]
            found = Plan(pointers(weights), pointers(scales), sizes, (ctypes.c_long * len(sizes))(*sizes),
                         TYPES[w_type], scales)
        if len(plans) > 4096:  # weights come and go (models loaded, converted): forget old sets now and then
            plans.clear()
        plans[key] = found
    return plans[key]


def linear(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None] | None = None):
    """[x @ w.T (* scale per output channel, for int8 weights) for each w], (..., K) -> (..., N) in x's dtype.

    Several weights of one input (q, k and v) stream in one pass."""
    scales = scales or [None] * len(weights)
    rows = x.numel() // x.shape[-1]
    found = plan(x, weights, scales) if usable(x, rows) else None
    if found is None:
        return [torch_linear(x, w, s) for w, s in zip(weights, scales)]
    sizes = found.sizes
    x = x.contiguous()
    y = torch.empty(rows * sum(sizes), dtype=x.dtype)
    if compiled_library().linear(x.data_ptr(), TYPES[x.dtype], len(sizes), found.weights, found.weight_type,
                                 found.scales, y.data_ptr(), TYPES[x.dtype], rows, found.c_sizes, x.shape[-1]):
        raise MemoryError("out of memory in the linear kernel")
    if len(sizes) == 1:
        return [y.view(*x.shape[:-1], sizes[0])]
    return [part.view(*x.shape[:-1], n) for part, n in zip(y.split([rows * n for n in sizes]), sizes)]


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_scale: torch.Tensor | None = None,
           up_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), the two products streamed together; scales as in linear."""
    rows = x.numel() // x.shape[-1]
    found = plan(x, [gate, up], [gate_scale, up_scale]) if usable(x, rows) else None
    if found is None:
        g, u = linear(x, [gate, up], [gate_scale, up_scale])
        return F.silu(g) * u
    N = found.sizes[0]
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    if compiled_library().swiglu(x.data_ptr(), TYPES[x.dtype], gate.data_ptr(), up.data_ptr(), found.weight_type,
                                 found.scales[0], found.scales[1], y.data_ptr(), TYPES[x.dtype], rows, N,
                                 x.shape[-1]):
        raise MemoryError("out of memory in the swiglu kernel")
    return y


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q: (B, T, H, D) a few new queries; k, v: (B, KVH, S, D) views of a cache, their slots contiguous."""
    B, T, H, D = q.shape
    return (D % 16 == 0 and D <= MAX_HEAD_DIM and H % k.shape[1] == 0 and k.dtype == v.dtype == q.dtype
            and k.stride(-1) == 1 and k.stride(-2) == D and k.stride() == v.stride() and usable(q, B * T))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float32, q: (B, T, H, D), k, v: (B, KVH, S, D) -> (B, T, H, D).

    mask: (B, 1, T, S) True where a query sees a slot; None: causal, the queries being the last T slots."""
    B, T, H, D = q.shape
    S = k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    if mask is not None:
        mask = mask.expand(B, 1, T, S).contiguous()
    if compiled_library().attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), TYPES[q.dtype], B, T,
                                    H, k.shape[1], S, D, k.stride(0), k.stride(1),
                                    None if mask is None else mask.data_ptr()):
        raise MemoryError("out of memory in the attention kernel")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, as the model's RMSNorm computes it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    compiled_library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), TYPES[x.dtype],
                                x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, hd) contiguous, rotated in place; cos, sin: (B, T, 1, hd)."""
    B, T, H, D = x.shape
    cos, sin = (t.to(x.dtype).expand(B, T, 1, D).contiguous() for t in (cos, sin))
    compiled_library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), TYPES[x.dtype], B * T, H, D)
    return x
