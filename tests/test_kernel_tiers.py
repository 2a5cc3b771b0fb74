"""kernels.c checked by tests/kernels_check.c on every instruction-set tier it has code for: x86-64 (SSE2),
x86-64-v3 (AVX2, FMA), x86-64-v4 (AVX-512) and this CPU's own, natively; AArch64 (NEON, then dot products and
bf16) cross-compiled and run under qemu. Each tier compiles its own code paths, which only running them checks;
the Python tests only ever run this machine's. Every tier is built for several CPU models' tunings, and every
build of a tier must give the same bits. `make test-arm` installs the cross compiler and qemu (Debian) where
missing."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from smollm2 import kernels

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # a compiler, then a program per tier
CHECK = Path(__file__).with_name("kernels_check.c")
# Spinning OpenMP threads on cores shared with other work turned the check's ~0.5 s into 5-20 s: it makes
# thousands of small calls, each a parallel region. Two threads still split every call's work.
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}


def flags(march: str) -> list[str]:
    """The project's build (kernels.FLAGS) as a program for `march`. At -O2, which compiles 3-4x faster than -O3
    (SSE2: ~15 s against ~50 s) and gives the same bits (the matrix below builds -O3 too)."""
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


def harness(compiler: str, march: str, tmp_path: Path) -> None:
    """kernels_check.c built for `march` once, an object every build of the tier by `compiler` links: only
    kernels.c's own tuning is under test, and the check's compile is then saved 10-30 times a tier."""
    built = subprocess.run([compiler, *flags(march), "-c", str(CHECK), "-o", str(object_of(compiler, tmp_path))],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr


def object_of(compiler: str, tmp_path: Path) -> Path:  # each compiler's own: each links its own OpenMP runtime
    return tmp_path / f"check-{Path(compiler).name}.o"


def check(compiler: str, march: str, tmp_path: Path, extra: tuple[str, ...] = (), runner: tuple[str, ...] = (),
          name: str = "kernels_check") -> str:
    """Builds kernels.c for `march` with `extra` flags, links it with the tier's harness() and runs it (under
    `runner`): every check must pass. Returns the hash of every result's bits it prints."""
    program = tmp_path / name
    built = subprocess.run([compiler, *flags(march), *extra, str(object_of(compiler, tmp_path)), str(kernels.SOURCE),
                            "-o", str(program), "-lm"], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([*runner, str(program)], capture_output=True, text=True, timeout=300, env=RUN_ENV)
    lines = ran.stdout.splitlines()
    failures = "\n".join(line for line in lines if line.startswith("FAIL")) or ran.stdout[-2000:] + ran.stderr[-2000:]
    assert ran.returncode == 0 and len(lines) > 1 and re.fullmatch(r"[1-9]\d* passed, 0 failed", lines[-1]), \
        f"{compiler} -march={march} {' '.join(extra)}:\n{failures}"
    return lines[-2]


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


# What running each x86 tier needs, and the CPU models whose tuning a build for it may carry (GCC's -mtune names;
# one a compiler does not know is left out): those whose best tier it is, since a build for this machine
# (-march=native) carries its own CPU's tuning with its own tier (an AVX-512 CPU's with x86-64-v4's code). Tuning decides instruction choice and scheduling, and must never
# change a result's bits: it once did, where GCC fused multiply-adds differently per CPU model (-mtune=znver2 keeps
# reduction chains unfused, for a lone row differently than for a tile of rows). With contraction off and every
# fused multiply-add written as one, every build of a tier gives the bits of every other, whatever the tuning, the
# optimization level (-O2, -O3) or the compiler (GCC, Clang where installed): each tier's builds are checked and
# their hashes of every result compared.
X86_TIERS = {"x86-64": (set(), ["generic"]),
             "x86-64-v3": ({"avx2", "fma", "bmi2", "f16c"}, ["generic", "haswell", "znver2"]),
             "x86-64-v4": ({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
                           ["generic", "skylake-avx512", "znver4"]),
             "native": (set(), ["generic", "native"])}


@functools.cache
def knows_tuning(compiler: str, tune: str) -> bool:
    return subprocess.run([compiler, "-x", "c", "-", f"-mtune={tune}", "-c", "-o", os.devnull], input="",
                          capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 tiers run on x86-64 hosts")
@pytest.mark.parametrize("march", X86_TIERS)
def test_kernels_on_x86_tier_give_the_same_bits_at_every_tuning(march, tmp_path):
    needs, tunings = X86_TIERS[march]
    gcc = os.environ.get("CC", "cc")
    if reason := cannot_build(gcc, f"-march={march}"):
        pytest.skip(reason)
    if missing := needs - cpu_flags():  # users' CPUs may: the source must still build for it
        built = subprocess.run([gcc, *flags(march), "-c", str(kernels.SOURCE), "-o", str(tmp_path / "kernels.o")],
                               capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr
        pytest.skip(f"built, not run: this CPU cannot run {march} code (no {', '.join(sorted(missing))})")
    # The generic tuning's build at -O3, the level users' builds have (the others at -O2: 3-4x faster to compile)
    builds = [(gcc, (f"-mtune={tune}", *(["-O3"] if tune == "generic" else []))) for tune in tunings
              if knows_tuning(gcc, tune)]
    assert len(builds) >= len(tunings) - 1, builds  # GCC 12 knows every model but znver4
    if march == "native" and "avx512vbmi" in cpu_flags():  # the int8 tile as Cascade Lake runs it (VNNI, no VBMI)
        builds.append((gcc, ("-mno-avx512vbmi",)))
    if shutil.which("clang"):  # Clang rejects code GCC accepts (an intrinsic's index that is not a constant)
        assert not (reason := cannot_build("clang", f"-march={march}")), f"{reason} (make check-tools)"
        builds.append(("clang", ("-mtune=generic",)))
    for compiler in {compiler for compiler, _ in builds}:
        harness(compiler, march, tmp_path)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the builds take most of the time: side by side
        bits = dict(zip(builds, pool.map(lambda build: check(build[0], march, tmp_path, build[1],
                                                              name="-".join([Path(build[0]).name, *build[1]])),
                                          builds)))
    assert len(set(bits.values())) == 1, "\n".join(f"{c} {' '.join(f)}: {b}" for (c, f), b in bits.items())


# The NEON baseline every AArch64 CPU has, and the ARMv8.2 extensions (dot products, bf16) newer cores add; each
# built for the tunings of cores that run it, which must give the same bits as on x86.
ARM_TIERS = {"armv8-a": ["generic", "cortex-a53"],
             "armv8.2-a+dotprod+bf16": ["generic", "cortex-a76"]}


@pytest.mark.parametrize("march", ARM_TIERS)
def test_kernels_on_aarch64_tier_give_the_same_bits_at_every_tuning(march, tmp_path):
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
    builds = [(*extra, f"-mtune={tune}") for tune in ARM_TIERS[march] if knows_tuning(compiler, tune)]
    assert len(builds) == len(ARM_TIERS[march]), builds
    harness(compiler, march, tmp_path)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        bits = dict(zip(builds, pool.map(lambda flags: check(compiler, march, tmp_path, flags, runner,
                                                              name=flags[-1].removeprefix("-mtune=")), builds)))
    assert len(set(bits.values())) == 1, "\n".join(f"{' '.join(f)}: {b}" for f, b in bits.items())
