"""kernels.c compiled for this machine on first use (20-60 s, once) into the user's cache, its functions declared
once; None without a working C compiler (then everything runs on torch's own kernels, only slower).

The build is the one process-wide thing here: it depends on the source, the compiler and the CPU, never on a
model, so every accelerator shares it."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

SOURCE = Path(__file__).with_name("kernels.c")
# The instruction set the kernels are built for: this CPU's own by default; SMOLLM2_MARCH=x86-64-v3 (AVX2) or
# x86-64 (SSE2) builds what a CPU of that tier runs, to test and time it here.
MARCH = os.environ.get("SMOLLM2_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smollm2"


def cpu_signature() -> str:
    """-march=native code runs only on this CPU model: a shared cache keeps one build per model."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return platform.machine() + platform.processor()


def build_key() -> str:
    """What a build of the kernels depends on: their source, the compiler and its flags, the CPU."""
    return hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join([os.environ.get("CC", "cc"), *FLAGS]).encode(),
                                      cpu_signature().encode()])).hexdigest()[:16]


def choices_file() -> Path:
    """Where measured choices between kernel and torch are kept: for this build and this torch (the other side),
    as it dispatches on this CPU (ATEN_CPU_CAPABILITY can hold it to a lower tier)."""
    return cache_dir() / (f"choices-{build_key()}-torch-{torch.__version__}-"
                          f"{torch.backends.cpu.get_cpu_capability()}.json")


class CFunction:
    """A function of kernels.c, its parameters declared once, by name; called with keywords, which are checked."""

    def __init__(self, function, restype=None, **parameters):
        function.argtypes, function.restype = list(parameters.values()), restype
        self.function, self.names = function, list(parameters)

    def __call__(self, **arguments):
        if arguments.keys() != set(self.names):
            raise TypeError(f"{self.function.__name__}() takes {self.names}, got {list(arguments)}")
        return self.function(*(arguments[name] for name in self.names))


@functools.cache
def compiled() -> SimpleNamespace | None:
    """kernels.c built for this machine, its functions declared as in kernels.c; None without a C compiler."""
    compiler = os.environ.get("CC", "cc")
    try:
        path = cache_dir() / f"kernels-{build_key()}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"smollm2: building the CPU kernels for this machine (-march={MARCH}), once: 20-60 s",
                  file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then renamed: never a half-written file
                built = Path(tmp) / path.name
                # ~20 s on an idle core; a busy laptop takes minutes, and running on without the kernels is the
                # worse outcome: the timeout only stops a compiler that hangs
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=900)
                built.replace(path)
        lib = ctypes.CDLL(str(path))  # its OpenMP is the runtime torch has loaded: one thread pool
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: no home directory
        detail = (getattr(e, "stderr", b"") or str(e).encode()).decode(errors="replace").strip().splitlines()
        warnings.warn(f"smollm2: CPU decoding kernels unavailable ({compiler}: {detail[-1] if detail else e}); "
                      "using torch's, slower", stacklevel=2)
        return None
    p, i, n, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    return SimpleNamespace(
        linear=CFunction(lib.linear, x=p, type=i, count=i, w=p, w_type=i, scale=p, y=p, B=n, N=p, K=n, int8=i),
        blocks=CFunction(lib.blocks, ctypes.c_int, w=p, layers=i, x=p, type=i, B=n, T=n, cos=p, sin=p, slots=p,
                         slot_stride=n, cache=p, mask=p, lowrank=p, adapter=p, int8=i),
        prompt_attention=CFunction(lib.prompt_attention, ctypes.c_int, q=p, k=p, v=p, out=p, type=i, B=n, T=n, H=n,
                                   KVH=n, D=n, k_stride=p, v_stride=p),
        silu_mul=CFunction(lib.silu_mul, gate=p, up=p, out=p, type=i, n=n),
        rope_rows=CFunction(lib.rope_rows, x=p, cos=p, sin=p, out=p, type=i, R=n, heads=n, D=n),
        norm_rows=CFunction(lib.norm_rows, x=p, weight=p, out=p, type=i, R=n, C=n, eps=f),
        dequantize=CFunction(lib.dequantize, ctypes.c_int, w=p, w_type=i, out=p, N=n, K=n),
        int8_prompts=CFunction(lib.int8_prompts, ctypes.c_int, w_type=i),
        repack_stripes=CFunction(lib.repack_stripes, ctypes.c_int, w=p, N=n, K=n, out=p),
        repack_across=CFunction(lib.repack_across, ctypes.c_int, w=p, type=i, N=n, K=n, out=p),
    )
