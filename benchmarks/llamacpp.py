"""Prefill and decode speed of smollm2 beside llama.cpp at matched precision, on the CPU, in one process.

The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) is loaded as fp32 and written back as GGUF files at F32,
F16 and Q8_0 (smollm2.checkpoints.save_gguf); each file is loaded back and checked against the original's
logits. Then each pair runs the same random prompt at batch 1, 2 threads:

    f32:  smollm2 fp32 (the F32 file)  vs llama.cpp F32
    f16:  smollm2 bf16                 vs llama.cpp F16   (both 16-bit; bf16 is what torch's CPU kernels favour)
    q8_0: smollm2 --quantize int8      vs llama.cpp Q8_0  (ours keeps the tied embedding/output fp32, streamed
                                                           from the original's Q8_0 blocks, as llama.cpp's)
    q4_1: smollm2 fp32 (the original)  vs llama.cpp Q4_1, both reading the embedded file itself: ours computes
          the fp32 model exactly, streaming the file's blocks; llama.cpp rounds activations to 8 bits

Both are timed by smollm2.bench's protocol: one generation of N tokens marking each token's arrival;
prefill tok/s = T / (time to the first token), decode tok/s = (N-1) / (first token to last), best of
--repeats after a warm-up: llama-bench's pp/tg, except that decoding here continues after the prompt (as in
real use) instead of from an empty context.
llama.cpp runs with its defaults otherwise (F16 KV cache, no flash attention).

--tier names the x86 instruction set both sides are built for, to compare code a CPU of that tier runs:
native (this CPU's own, the default), x86-64-v3 (AVX2, FMA, F16C) or x86-64 (SSE2). Ours: SMOLLM2_MARCH,
the -march of the C kernels; torch's own kernels (a bf16 prompt's products among them) still pick this CPU's
widest at run time, as the header's "torch dispatch" says. llama.cpp: a llama-cpp-python compiled from source
for the tier (the native one with -march=native; the others with exactly the tier's extensions, one CPU
backend, no run-time dispatch to wider variants), each in a venv of its own under
$XDG_CACHE_HOME/smollm2/llamacpp-<tier> (~/.cache/...). llama-cpp-python is not a project dependency: --build
makes that venv (pip, CMake and a C++ compiler; minutes), then a run borrows its llama_cpp:
    .venv/bin/python benchmarks/llamacpp.py --tier x86-64-v3 --build
    .venv/bin/python benchmarks/llamacpp.py --tier x86-64-v3 [--json]
It exits 1 where a prefill or decode ratio is under --at-least (1.0).
The header prints llama.cpp's llama_print_system_info(), which names the instructions it was compiled with.

--build-server builds llama.cpp's own HTTP server, llama-server, from llama-cpp-python's source distribution (of
the version tests/llama_cpp_converter.py pins) with the same options, into
$XDG_CACHE_HOME/smollm2/llama-server-<tier>/bin (~10 minutes on 2 cores), for benchmarks/server_load.py to serve
beside `smollm2 serve`; --build-tools builds llama-bench and llama-quantize alike, into
$XDG_CACHE_HOME/smollm2/llama-tools-<tier>/bin, for benchmarks/family.py:
    .venv/bin/python benchmarks/llamacpp.py --build-server
    .venv/bin/python benchmarks/llamacpp.py --build-tools
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

# smollm2 and llama_cpp are imported inside the functions, once main has chosen the tier: smollm2.kernels reads
# SMOLLM2_MARCH when it is imported, and llama_cpp comes from the tier's venv.
if TYPE_CHECKING:
    from smollm2 import SmolLM2, bench

THREADS = 2
CHECK_IDS = [1, 504, 3458, 282, 4760, 314, 216, 1345]  # a few tokens whose logits the written files must give back
# max |logit diff| (logits span ~40; a wrong q/k order gives ~27)
TOLERANCE = {"f32": 0.0, "f16": 0.25, "q8_0": 2.0, "q4_1": 2.0}
WRITTEN = ("f32", "f16", "q8_0")  # the precisions written as GGUF files
ORIGINAL = "q4_1"  # the embedded file as it is

# llama.cpp's CMake options per tier. One CPU backend compiled in (no GGML_BACKEND_DL, no GGML_CPU_ALL_VARIANTS):
# otherwise it would load the widest variant this CPU runs, whatever the tier.
ONE_BACKEND = ["-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF"]
WIDER = ["AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_TILE", "AMX_INT8", "AMX_BF16"]
V3 = ["SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"]  # x86-64-v3, as far as ggml's options go
CMAKE_ARGS = {
    # Without AMX: ggml's AMX matrix products (Q4_1, Q8_0) died with a general protection fault at ldtilecfg on a
    # CPU that reports AMX (a Sapphire Rapids VM); an explicit -mno-* wins over -march=native in GCC.
    "native": ["-DGGML_NATIVE=ON", *ONE_BACKEND, *(f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                                                   for lang in ("C", "CXX"))],
    "x86-64-v3": ["-DGGML_NATIVE=OFF", *ONE_BACKEND, *(f"-DGGML_{x}=ON" for x in V3),
                  *(f"-DGGML_{x}=OFF" for x in WIDER)],
    "x86-64": ["-DGGML_NATIVE=OFF", *ONE_BACKEND, *(f"-DGGML_{x}=OFF" for x in V3 + WIDER)],
}
# The x86 extensions llama_print_system_info() names (those a build has, "= 1"; it leaves out the others), and
# those a tier's build may have: a check that the venv holds that tier's build.
X86_FEATURES = ["SSE3", "SSSE3", "AVX", "AVX_VNNI", "AVX2", "F16C", "FMA", "BMI2", "AVX512", "AVX512_VBMI",
                "AVX512_VNNI", "AVX512_BF16", "AMX_INT8"]
TIER_FEATURES = {"x86-64-v3": {"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"}, "x86-64": set()}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def check(who: str, got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> str:
    diff = (got - ref).abs().max().item()
    if diff > tolerance or not torch.equal(got.argmax(-1), ref.argmax(-1)):
        raise SystemExit(f"{who}: logits differ from the original's (max |diff| {diff:.4g})")
    return f"{who}: max |logit diff| {diff:.3g}"


@torch.inference_mode()
def validate(model: SmolLM2, path: Path, precision: str) -> str:
    """The written file, loaded back by smollm2, gives the original's logits: F32 exactly, the others within
    rounding."""
    from smollm2 import load
    from smollm2.kernels import accelerate

    ids = torch.tensor([CHECK_IDS])
    # both on the kernel, where the blocks give the F32 file's bits exactly
    read, original = (accelerate(m, mode="on") for m in (load(path), copy.deepcopy(model)))
    return check(f"smollm2 reading {path.name}", read(ids), original(ids), TOLERANCE[precision])


def bench_llamacpp(path: Path, prompt: torch.Tensor, new_tokens: int, repeats: int, ref: torch.Tensor,
                   tolerance: float) -> bench.Speed:
    """ref: the original model's last logits after CHECK_IDS, to check that llama.cpp reads the file alike."""
    import llama_cpp

    from smollm2 import bench

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS,
                          n_batch=512, verbose=False)
    ids = prompt[0].tolist()

    def last_logits() -> np.ndarray:  # only the last position's are computed (logits_all=False), as in ours
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))

    def greedy() -> int:
        return int(last_logits().argmax())

    llm.eval(CHECK_IDS)  # its KV cache is F16 (its default): not bit-exact even at F32
    log(check(f"llama.cpp reading {path.name}", torch.from_numpy(last_logits().copy()), ref, max(tolerance, 0.05)))

    def run(mark) -> None:
        llm.reset()
        llm.eval(ids)
        token = greedy()
        mark()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = greedy()
            mark()

    try:  # the very protocol bench_ours uses, so the two are timed alike
        return bench.timed([("llama.cpp", lambda: run)], prompt, new_tokens, repeats)[0]
    finally:
        llm.close()


def ours(precision: str, path: Path) -> SmolLM2:
    from smollm2 import load

    if precision == "f16":
        return load(dtype=torch.bfloat16)
    if precision == "f32":
        return load(path)  # F32 tensors: fp32 weights streamed as they are
    return load(quantize="int8" if precision == "q8_0" else None)


def speeds(s: bench.Speed) -> dict:  # peak memory is left out: one process holds both systems' models
    return {"prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s}


def venv_dir(tier: str) -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smollm2" / f"llamacpp-{tier}"


def site_packages(venv: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))


def system_info(tier: str) -> str:
    """llama.cpp's llama_print_system_info(), after checking that it has no extension beyond the tier; the
    extensions it leaves out are appended as "= 0", for the reader."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode().strip()
    on = set(re.findall(r"(\w+) = 1", info))
    if tier in TIER_FEATURES and (beyond := [x for x in X86_FEATURES if x in on - TIER_FEATURES[tier]]):
        raise SystemExit(f"llama.cpp was built with {', '.join(beyond)}, beyond {tier}: {info}")
    off = [x for x in X86_FEATURES if x not in on]
    return info + (f" (= 0: {', '.join(off)})" if off else "")


def build(tier: str, venv: Path) -> int:
    """A fresh venv holding llama-cpp-python compiled for the tier. The venv takes this Python's version, whose
    site-packages a run borrows."""
    log(f"building llama-cpp-python for {tier} into {venv} (CMAKE_ARGS={' '.join(CMAKE_ARGS[tier])})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    # --no-cache-dir: pip would otherwise reuse the wheel it built for another tier, cached by version alone
    subprocess.run([str(venv / "bin" / "pip"), "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                    "llama-cpp-python"], env={**os.environ, "CMAKE_ARGS": shlex.join(CMAKE_ARGS[tier])}, check=True)
    sys.path.append(str(site_packages(venv)))
    print(system_info(tier))
    return 0


def server_binary(tier: str) -> Path:
    return venv_dir(tier).with_name(f"llama-server-{tier}") / "bin" / "llama-server"


def tool_binary(tier: str, name: str) -> Path:
    """llama-bench or llama-quantize, built by --build-tools."""
    return venv_dir(tier).with_name(f"llama-tools-{tier}") / "bin" / name


def build_binaries(tier: str, build_dir: Path, targets: list[str]) -> None:
    """llama.cpp's programs compiled for the tier from llama-cpp-python's source distribution (the llama.cpp it
    vendors), of the version whose converter the tests use, without the server's web page, TLS or downloads."""
    sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
    from llama_cpp_converter import VERSION

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", tmp,
                        f"llama-cpp-python=={VERSION}"], check=True)
        (archive,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        subprocess.run(["tar", "xzf", str(archive), "-C", tmp], check=True)
        (source,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
        log(f"building {', '.join(targets)} for {tier} from {archive.name} into {build_dir}")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_CURL=OFF", *CMAKE_ARGS[tier]], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets, f"-j{os.cpu_count()}"],
                       check=True)


def build_server(tier: str) -> int:
    """llama-server: a server for the model file it is given, nothing more."""
    build_binaries(tier, server_binary(tier).parent.parent, ["llama-server"])
    print(server_binary(tier))
    return 0


def build_tools(tier: str) -> int:
    """llama-bench and llama-quantize, for benchmarks/family.py."""
    tools = ["llama-bench", "llama-quantize"]
    build_binaries(tier, tool_binary(tier, tools[0]).parent.parent, tools)
    print(*(tool_binary(tier, tool) for tool in tools), sep="\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", choices=list(CMAKE_ARGS), default="native",
                   help="the x86 instruction set both sides are built for (default: this CPU's own)")
    p.add_argument("--build", action="store_true",
                   help="build llama-cpp-python for --tier into its venv (replacing it), then exit")
    p.add_argument("--build-server", action="store_true",
                   help="build llama-server for --tier (for benchmarks/server_load.py), then exit")
    p.add_argument("--build-tools", action="store_true",
                   help="build llama-bench and llama-quantize for --tier (for benchmarks/family.py), then exit")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precisions", default="f32,f16,q8_0,q4_1", help="comma-separated subset of f32,f16,q8_0,q4_1")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--at-least", type=float, default=1.0,
                   help="exit 1 where a prefill or decode ratio (smollm2 / llama.cpp) is under this (default 1.0)")
    args = p.parse_args()
    precisions = args.precisions.split(",")
    if unknown := set(precisions) - {*WRITTEN, ORIGINAL}:
        p.error(f"unknown precisions {sorted(unknown)}; choose from {[*WRITTEN, ORIGINAL]}")
    if args.prompt_tokens + args.new_tokens > 1024:
        p.error("--prompt-tokens + --new-tokens must fit llama.cpp's 1024-token context")
    venv = venv_dir(args.tier)
    if args.build:
        return build(args.tier, venv)
    if args.build_server:
        return build_server(args.tier)
    if args.build_tools:
        return build_tools(args.tier)
    if not (site_packages(venv) / "llama_cpp").is_dir():
        p.error(f"no llama.cpp built for {args.tier} in {venv}: run {sys.argv[0]} --tier {args.tier} --build")

    os.environ["SMOLLM2_MARCH"] = args.tier  # before smollm2.kernels is imported, which reads it
    # Last on the path: the project's own packages (numpy, ...) stay first, llama_cpp comes from the venv
    sys.path.append(str(site_packages(venv)))
    import llama_cpp

    from smollm2 import Tokenizer, bench, kernels, load
    from smollm2.checkpoints import default_model_path, save_gguf

    if not Path(llama_cpp.__file__).is_relative_to(venv):
        raise SystemExit(f"llama_cpp is imported from {llama_cpp.__file__}, not from {venv}: "
                         "another installation (PYTHONPATH?) shadows the tier's")
    llamacpp_info = system_info(args.tier)
    torch.set_num_threads(THREADS)
    ours_built = f"-march={kernels.MARCH}" if kernels.compiled() else "unavailable: torch's kernels"

    original = default_model_path()
    model = load()
    tokenizer = Tokenizer.from_pretrained(original)
    prompt = bench.random_prompt(model.config.vocab_size, 1, args.prompt_tokens, "cpu")
    with torch.inference_mode():
        last_logits = model(torch.tensor([CHECK_IDS]))[0, -1]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {precision: original if precision == ORIGINAL else Path(tmp) / f"smollm2-135m-{precision}.gguf"
                 for precision in precisions}
        for precision, path in paths.items():
            if precision != ORIGINAL:
                save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), path, precision)
                log(validate(model, path, precision))
            # Our first run times kernel against torch for each kind of operation (and keeps the choices):
            # before any llama.cpp model exists, whose idle threads keep polling and would skew those times.
            bench.bench_ours(ours(precision, path), prompt, args.new_tokens, 1)
        for precision, path in paths.items():
            mine = bench.bench_ours(ours(precision, path), prompt, args.new_tokens, args.repeats)
            ref = bench_llamacpp(path, prompt, args.new_tokens, args.repeats, last_logits, TOLERANCE[precision])
            log(f"{precision}: smollm2 {mine.prefill_tok_s:.1f}/{mine.decode_tok_s:.1f}, "
                f"llama.cpp {ref.prefill_tok_s:.1f}/{ref.decode_tok_s:.1f} tok/s (prefill/decode)")
            results.append({"precision": precision, "file_mib": round(path.stat().st_size / 2**20, 1),
                            "smollm2": speeds(mine), "llama_cpp": speeds(ref),
                            "prefill_ratio": mine.prefill_tok_s / ref.prefill_tok_s,
                            "decode_ratio": mine.decode_tok_s / ref.decode_tok_s})
            if precision != ORIGINAL:
                path.unlink()

    torch_dispatch = torch.backends.cpu.get_cpu_capability()
    setup = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
             "threads": THREADS, "tier": args.tier, "smollm2_kernels": ours_built, "torch": torch.__version__,
             "torch_dispatch": torch_dispatch, "llama_cpp_python": llama_cpp.__version__,
             "llama_cpp_system_info": llamacpp_info}
    under = [f"{r['precision']} {kind} {r[kind + '_ratio']:.2f}x" for r in results for kind in ("prefill", "decode")
             if r[kind + "_ratio"] < args.at_least]
    if args.json:
        print(json.dumps({**setup, "results": results}, indent=2))
        return 1 if under else 0
    print(f"pp{args.prompt_tokens}/tg{args.new_tokens}, batch 1, {THREADS} threads, best of {args.repeats}, "
          f"tier {args.tier}; tok/s, ratio = smollm2 / llama.cpp")
    print(f"smollm2:   kernels {ours_built} (torch {torch.__version__}, torch dispatch {torch_dispatch})")
    print(f"llama.cpp: built for {args.tier} (llama-cpp-python {llama_cpp.__version__}): {llamacpp_info}")
    print(f"{'precision':<10}{'smollm2 pp':>12}{'smollm2 tg':>12}{'llama.cpp pp':>14}{'llama.cpp tg':>14}"
          f"{'pp ratio':>10}{'tg ratio':>10}")
    for r in results:
        s, l = r["smollm2"], r["llama_cpp"]
        print(f"{r['precision']:<10}{s['prefill_tok_s']:>12.1f}{s['decode_tok_s']:>12.1f}{l['prefill_tok_s']:>14.1f}"
              f"{l['decode_tok_s']:>14.1f}{r['prefill_ratio']:>9.2f}x{r['decode_ratio']:>9.2f}x")
    if under:
        print(f"under {args.at_least}x: {', '.join(under)}")
    return 1 if under else 0

if __name__ == "__main__":
    sys.exit(main())
