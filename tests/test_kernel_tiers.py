"""kernels.c checked by tests/kernels_check.c on every instruction-set tier it has code for: x86-64 (SSE2),
x86-64-v3 (AVX2, FMA) and this CPU's own, natively; AArch64 (NEON, then dot products and bf16) cross-compiled
and run under qemu. Each tier compiles its own code paths, which only running them checks; the Python tests
only ever run this machine's. `make test-arm` installs the cross compiler and qemu (Debian) where missing."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from smollm2 import kernels

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # a compiler, then a program per tier
CHECK = Path(__file__).with_name("kernels_check.c")
# Spinning OpenMP threads on cores shared with other work turned the check's ~0.5 s into 5-20 s: it makes
# thousands of small calls, each a parallel region. Two threads still split every call's work.
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}


def flags(march: str) -> list[str]:
    """The project's build (kernels.FLAGS) as a program for `march`. At -O2, which forms the same fused
    multiply-adds as -O3 (-O1 forms none: other roundings than users get) and compiles 3-4x faster (SSE2:
    ~15 s against ~50 s)."""
    kept = [f for f in kernels.FLAGS if f not in ("-shared", "-fPIC") and not f.startswith("-march=")]
    return [("-O2" if f.startswith("-O") else f) for f in kept] + [f"-march={march}"]


@functools.cache
def cannot_build(compiler: str, *extra: str) -> str | None:
    """Why `compiler` cannot build an OpenMP program with these flags, or None where it can."""
    if shutil.which(compiler) is None:
        return f"no {compiler}"
    try:
        built = subprocess.run([compiler, "-x", "c", "-", "-fopenmp", *extra, "-o", os.devnull],
                               input="#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n",
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{compiler}: {e}"
    if built.returncode:
        return f"{compiler} {' '.join(extra)} cannot build an OpenMP program: {built.stderr.strip()[-300:]}"
    return None


def check(compiler: str, march: str, tmp_path: Path, extra: tuple[str, ...] = (), runner: tuple[str, ...] = ()):
    """Builds kernels_check.c with kernels.c for `march` and runs it (under `runner`): every check must pass."""
    program = tmp_path / "kernels_check"
    built = subprocess.run([compiler, *flags(march), *extra, str(CHECK), str(kernels.SOURCE), "-o", str(program),
                            "-lm"], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([*runner, str(program)], capture_output=True, text=True, timeout=300, env=RUN_ENV)
    lines = ran.stdout.splitlines()
    failures = "\n".join(line for line in lines if line.startswith("FAIL")) or ran.stdout[-2000:] + ran.stderr[-2000:]
    assert ran.returncode == 0 and lines and re.fullmatch(r"[1-9]\d* passed, 0 failed", lines[-1]), failures


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


X86_TIERS = {"x86-64": set(), "x86-64-v3": {"avx2", "fma", "bmi2", "f16c"}, "native": set()}  # what running needs


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 tiers run on x86-64 hosts")
@pytest.mark.parametrize("march", X86_TIERS)
def test_kernels_on_x86_tier(march, tmp_path):
    compiler = os.environ.get("CC", "cc")
    if reason := cannot_build(compiler, f"-march={march}"):
        pytest.skip(reason)
    if missing := X86_TIERS[march] - cpu_flags():
        pytest.skip(f"this CPU cannot run {march} code (no {', '.join(sorted(missing))})")
    check(compiler, march, tmp_path)


# The NEON baseline every AArch64 CPU has, and the ARMv8.2 extensions (dot products, bf16) newer cores add.
ARM_TIERS = ["armv8-a", "armv8.2-a+dotprod+bf16"]


@pytest.mark.parametrize("march", ARM_TIERS)
def test_kernels_on_aarch64_tier(march, tmp_path):
    if platform.machine() == "aarch64":  # an AArch64 host runs them itself
        compiler, extra, runner = os.environ.get("CC", "cc"), (), ()
    else:  # static: qemu-user then needs no AArch64 libraries installed
        compiler, extra = "aarch64-linux-gnu-gcc", ("-static",)
        qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
        if qemu is None:
            pytest.skip("no qemu-aarch64 to run AArch64 code (Debian: qemu-user; or `make test-arm`)")
        runner = (qemu, "-cpu", "max")  # max: with the dot product and bf16 instructions
    if reason := cannot_build(compiler, f"-march={march}", *extra):
        pytest.skip(f"{reason} (Debian: gcc-aarch64-linux-gnu; or `make test-arm`)")
    check(compiler, march, tmp_path, extra, runner)
