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

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
MAX_ROWS = 16  # beyond this many rows, a product is bound by arithmetic, where BLAS is the faster
MAX_HEAD_DIM = 256  # as kernels.c
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}

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
def library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join([compiler, *FLAGS]).encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    path = cache_dir() / f"kernels-{key}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then renamed: never a half-written file
                built = Path(tmp) / path.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                built.replace(path)
        lib = ctypes.CDLL(str(path))  # its OpenMP is the runtime torch has loaded: one thread pool
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or str(e).encode()
        warnings.warn(f"smollm2: CPU decoding kernels unavailable ({compiler}: "
                      f"{detail.decode(errors='replace').strip().splitlines()[-1:]}); using torch's, slower",
                      stacklevel=2)
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    n = ctypes.c_long
    lib.linear.argtypes = [p, i, p, i, p, p, i, n, n, n]
    lib.attention.argtypes = [p, p, p, p, i, n, n, n, n, n, n, n, n, p]
    lib.rms_norm.argtypes = [p, p, p, i, n, n, ctypes.c_float]
    lib.rope.argtypes = [p, p, p, i, n, n, n]
    return lib


def usable(x: torch.Tensor, rows: int) -> bool:
    """Whether x, holding `rows` rows (tokens), goes to the kernels: decoding (a few rows) on the CPU.

    Many rows (a prompt) stay on torch: its products are faster there, and its results are transformers'
    to the last bit (the kernels' differ in the last bits: another order of summation)."""
    return (enabled and rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
            and library() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T, times scale per output channel (int8 weights), (..., K) -> (..., N) in x's dtype."""
    N, K = weight.shape
    rows = x.numel() // K
    if (K % 16 or N % 4 or not usable(x, rows) or weight.requires_grad and torch.is_grad_enabled()
            or weight.dtype not in (x.dtype, torch.int8) or not weight.is_contiguous()):
        y = F.linear(x, weight.to(x.dtype))
        return y if scale is None else y * scale.to(x.dtype)
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    scale = None if scale is None else scale.float().contiguous()
    if library().linear(x.data_ptr(), TYPES[x.dtype], weight.data_ptr(), TYPES[weight.dtype],
                        None if scale is None else scale.data_ptr(), y.data_ptr(), TYPES[x.dtype], rows, N, K):
        raise MemoryError("out of memory in the linear kernel")
    return y


def attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q: (B, T, H, D) a few new queries; k: (B, KVH, S, D) a cache view, its slots contiguous."""
    B, T, H, D = q.shape
    return (D % 16 == 0 and D <= MAX_HEAD_DIM and H % k.shape[1] == 0 and k.dtype == q.dtype
            and k.stride(-1) == 1 and k.stride(-2) == D and usable(q, B * T))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float32, q: (B, T, H, D), k, v: (B, KVH, S, D) -> (B, T, H, D).

    mask: (B, 1, T, S) True where a query sees a slot; None: causal, the queries being the last T slots."""
    B, T, H, D = q.shape
    S = k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    if mask is not None:
        mask = mask.expand(B, 1, T, S).contiguous()
    assert k.stride() == v.stride()
    if library().attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), TYPES[q.dtype], B, T, H,
                           k.shape[1], S, D, k.stride(0), k.stride(1), None if mask is None else mask.data_ptr()):
        raise MemoryError("out of memory in the attention kernel")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, as the model's RMSNorm computes it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), TYPES[x.dtype], x.numel() // x.shape[-1],
                       x.shape[-1], eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, hd) contiguous, rotated in place; cos, sin: (B, T, 1, hd) contiguous, in x's dtype."""
    B, T, H, D = x.shape
    library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), TYPES[x.dtype], B * T, H, D)
    return x
