"""SmolLM2-360M and -1.7B in the GGUF files people download, smollm2 beside llama.cpp: speed, memory, bandwidth.

No real weights reach this machine, so each size is built from its published config.json (below, as data) with
random weights (seeded), saved as a HF directory (bf16 safetensors, as published), converted by llama.cpp's own
convert_hf_to_gguf.py (tests/llama_cpp_converter.py) to f16 and q8_0, and the f16 file quantized by llama.cpp's
llama-quantize to Q4_K_M, Q5_K_M, Q6_K and Q4_0: the types most published for SmolLM2. All of it is kept in
$XDG_CACHE_HOME/smollm2/family (~/.cache/...; ~16 GB for both sizes) and made only where missing.

Then, for each file, the two take turns (--rounds): llama.cpp's llama-bench (pp128 and tg32, -r --repeats, -o
json) and `smollm2 bench` (a 128-token prompt, then 32 decoded tokens, best of --repeats), both at --threads,
each a process of its own under /usr/bin/time, whose maximum resident set size is the process's peak memory
(load included; a file mapped counts its pages read). Decode and prefill tok/s are each side's best; beside
them, the spread of each round's decode ratio (ours over the llama.cpp turn just before it): this VM's memory
moves a process's decoding by up to 30%, for both sides, so the rounds show how far one pair of turns reads.

Bandwidth: a decoding step of these models reads every matrix once (the tied embedding as the output head), so
the file's tensor bytes per token times decode tok/s is the rate it reads at; it is given as a share of this
machine's measured read rate (smollm2.roofline.measure, as the page's Time view measures it: a 256 MiB float32 matrix
times a vector, with --threads threads), measured before and after the runs, the better kept.

The machine is sampled for a second before each turn: where other processes used over a tenth of its CPUs, the
row is marked busy (its figures are then lower bounds for both sides alike).

Bars (the issue's; --bars exits 1 under any): decode and prefill >= 1.0x llama.cpp on the same file; peak
resident <= 1.2x the file + the runtime (a Python that imported torch and smollm2, measured alike).

--tier runs both sides built for one x86 tier (ours with SMOLLM2_MARCH, llama-bench from
benchmarks/llamacpp.py --build-tools --tier): the code a CPU of that tier runs, on this machine.

    .venv/bin/python benchmarks/llamacpp.py --build-tools          # llama-bench and llama-quantize, once
    .venv/bin/python benchmarks/family.py --sizes 360m --json family.json
    .venv/bin/python benchmarks/family.py --sizes 1.7b --types q8_0,q4_k_m --bars
    .venv/bin/python benchmarks/family.py --int8-activations     # smollm2's opt-in mode, not exact
    .venv/bin/python benchmarks/family.py --sizes 360m --types q4_k_m --tier x86-64 --int8-activations --bars
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from llamacpp import CMAKE_ARGS, tool_binary

ROOT = Path(__file__).resolve().parent.parent
CONVERTER = ROOT / "tests" / "llama_cpp_converter.py"

# The published config.json of each, as HuggingFaceTB/SmolLM2-360M-Instruct and -1.7B-Instruct hold it.
PUBLISHED = {
    "360m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 960,
        "initializer_range": 0.02, "intermediate_size": 2560, "is_llama_config": True,
        "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 15,
        "num_hidden_layers": 32, "num_key_value_heads": 5, "pad_token_id": 2, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
        "use_cache": True, "vocab_size": 49152,
    },
    "1.7b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 8192,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 24,
        "num_key_value_heads": 32, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 130000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152,
    },
}
CONVERTED = ("f16", "q8_0")  # written by convert_hf_to_gguf.py
QUANTIZED = ("q4_k_m", "q5_k_m", "q6_k", "q4_0")  # by llama-quantize, from the f16 file
DEFAULT_TYPES = ("q8_0", "q4_k_m", "q5_k_m", "q6_k", "q4_0")  # the issue's
PROMPT, DECODED = 128, 32  # llama-bench's pp128 and tg32
BUSY = 0.1  # the share of the CPUs other processes used, over which a turn is marked busy
RSS_BAR, SPEED_BAR = 1.2, 1.0


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smollm2" / "family"


def build_hf(size: str, directory: Path) -> None:
    """The size's published config with seeded random weights, saved as the hub holds it (bf16 safetensors, the
    tokenizer beside). Normal at the config's initializer_range, norms around 1."""
    from safetensors.torch import save_file

    from smollm2 import SmolConfig, Tokenizer
    from smollm2.checkpoints import parameter_shapes

    config = SmolConfig.from_hf(PUBLISHED[size])
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in parameter_shapes(config).items():
        mean, std = (1.0, 0.1) if "norm" in name else (0.0, config.initializer_range)
        tensors[name] = torch.normal(mean, std, shape, generator=generator).to(torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:  # then renamed: whole or not at all
        save_file(tensors, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(PUBLISHED[size], indent=2))
        Tokenizer.from_pretrained().save_pretrained(tmp)
        os.replace(tmp, directory)


def gguf_files(size: str, types: list[str]) -> dict[str, Path]:
    """The size's GGUF file of each type, made where missing: the HF directory, llama.cpp's converter (f16 always,
    the quantizer's source), llama-quantize."""
    folder = cache_dir() / size
    folder.mkdir(parents=True, exist_ok=True)
    hf, files = folder / "hf", {type: folder / f"{size}-{type}.gguf" for type in {"f16", *types}}
    if not hf.exists() and not all(files[type].exists() for type in CONVERTED if type in files):
        log(f"{size}: random weights of the published shape into {hf}")
        build_hf(size, hf)
    converting = [type for type in CONVERTED if type in files and not files[type].exists()]
    if converting:
        log(f"{size}: convert_hf_to_gguf.py to {', '.join(converting)}")
        subprocess.run([sys.executable, str(CONVERTER)], check=True)  # fetches the converter, once
        jobs = [str(arg) for type in converting for arg in (hf, type, files[type].with_suffix(".part"))]
        subprocess.run([sys.executable, str(CONVERTER), "convert", *jobs], check=True, stdout=subprocess.DEVNULL)
        for type in converting:
            files[type].with_suffix(".part").replace(files[type])
    for type in QUANTIZED:
        if type in files and not files[type].exists():
            log(f"{size}: llama-quantize to {type.upper()}")
            part = files[type].with_suffix(".part")
            subprocess.run([str(tool_binary("native", "llama-quantize")), str(files["f16"]), str(part), type.upper()],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            part.replace(files[type])
    return {type: files[type] for type in types}


def tensor_bytes(path: Path) -> int:
    """The bytes of the file's tensors: what a decoding step reads (SmolLM2 ties the output head to the
    embedding, so all of it, but the norms, which are negligible)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def cpu_times() -> tuple[float, float]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # all, idle + iowait


def others_load(seconds: float = 1.0) -> float:
    """The share of the CPUs busy over `seconds` while this script waits: other processes' load."""
    total, idle = cpu_times()
    time.sleep(seconds)
    total2, idle2 = cpu_times()
    return 1 - (idle2 - idle) / max(total2 - total, 1)


def timed_process(command: list[str], env: dict | None = None) -> tuple[str, float]:
    """The command's stdout and its peak resident set (MiB), from /usr/bin/time (its children included)."""
    with tempfile.NamedTemporaryFile("r") as peak:
        done = subprocess.run(["/usr/bin/time", "-o", peak.name, "-f", "%M", *command], capture_output=True,
                              text=True, env=env)
        if done.returncode:
            raise SystemExit(f"{command[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout, int(peak.read().split()[-1]) / 1024


def llama_bench(path: Path, tier: str, threads: int, repeats: int) -> dict:
    out, peak = timed_process([str(tool_binary(tier, "llama-bench")), "-m", str(path), "-t", str(threads),
                               "-p", str(PROMPT), "-n", str(DECODED), "-r", str(repeats), "-o", "json"])
    tests = json.loads(out)
    best = {("prefill" if t["n_prompt"] else "decode"): max(t["samples_ts"]) for t in tests}
    return {"prefill_tok_s": best["prefill"], "decode_tok_s": best["decode"], "peak_mib": peak,
            "build": tests[0].get("build_commit"), "cpu": tests[0].get("cpu_info")}


def smollm2_bench(path: Path, tier: str, threads: int, repeats: int, int8: bool = False) -> dict:
    march = {} if tier == "native" else {"SMOLLM2_MARCH": tier}  # the kernels' build for the tier
    out, peak = timed_process([sys.executable, "-m", "smollm2", "bench", "--model", str(path), "--threads",
                               str(threads), "--prompt-tokens", str(PROMPT), "--new-tokens", str(DECODED + 1),
                               "--repeats", str(repeats), "--json", *(["--int8-activations"] if int8 else [])],
                              env={**os.environ, **march})
    report = json.loads(out)
    (ours,) = report["results"]
    return {"prefill_tok_s": ours["prefill_tok_s"], "decode_tok_s": ours["decode_tok_s"], "peak_mib": peak,
            "weights_read": report["weights_read"], "kernels": report["kernels"]}


def runtime_mib() -> float:
    """What the runtime holds before any model: a Python that imported torch and smollm2 and its kernels."""
    return timed_process([sys.executable, "-c", "import torch, smollm2.cli, smollm2.kernels"])[1]


def read_rate(threads: int) -> float:
    from smollm2.roofline import measure

    torch.set_num_threads(threads)
    return measure(torch.device("cpu")).bandwidth


def compare(size: str, type: str, path: Path, args) -> dict:
    best = {"smollm2": {}, "llama.cpp": {}}
    load, rounds = [], []  # rounds: each round's decode ratio, ours over the llama.cpp turn just before it
    for _ in range(args.rounds):
        for name, bench in (("llama.cpp", llama_bench), ("smollm2", smollm2_bench)):
            load.append(others_load())
            got = bench(path, args.tier, args.threads, args.repeats,
                        *([args.int8_activations] if name == "smollm2" else []))
            kept = best[name]
            for key, value in got.items():
                better = max if key.endswith("tok_s") or key == "peak_mib" else (lambda a, b: b)
                kept[key] = better(kept[key], value) if key in kept else value
            if name == "llama.cpp":
                theirs_now = got["decode_tok_s"]
            else:
                rounds.append(got["decode_tok_s"] / theirs_now)
            log(f"{size} {type} {name}: prefill {got['prefill_tok_s']:.1f}, decode {got['decode_tok_s']:.1f} tok/s, "
                f"peak {got['peak_mib']:.0f} MiB (others' load {load[-1]:.0%})")
    ours, theirs = best["smollm2"], best["llama.cpp"]
    file_mib = path.stat().st_size / 2**20  # MiB, as the peaks (/usr/bin/time's KiB / 1024)
    return {"size": size, "type": type, "file_mib": round(file_mib, 1), "tensor_bytes": tensor_bytes(path),
            "smollm2": ours, "llama_cpp": theirs,
            "decode_ratio": ours["decode_tok_s"] / theirs["decode_tok_s"], "decode_ratio_by_round": rounds,
            "prefill_ratio": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
            "rss_per_file": ours["peak_mib"] / file_mib, "llama_cpp_rss_per_file": theirs["peak_mib"] / file_mib,
            "others_load": round(max(load), 3), "busy": max(load) > BUSY}


def with_bars(row: dict, runtime: float, rate: float) -> dict:
    gbs = {name: row["tensor_bytes"] * row[key]["decode_tok_s"] / 1e9 for name, key in
           (("smollm2", "smollm2"), ("llama_cpp", "llama_cpp"))}
    rss_limit = RSS_BAR * row["file_mib"] + runtime
    failed = [what for what, ok in (("decode", row["decode_ratio"] >= SPEED_BAR),
                                    ("prefill", row["prefill_ratio"] >= SPEED_BAR),
                                    ("memory", row["smollm2"]["peak_mib"] <= rss_limit)) if not ok]
    return {**row, "read_gb_s": gbs, "read_share": {k: v * 1e9 / rate for k, v in gbs.items()},
            "rss_limit_mib": round(rss_limit), "failed": failed}


def table(rows: list[dict], setup: dict) -> str:
    lines = [f"{setup['cpu']}, {setup['threads']} threads, pp{PROMPT}/tg{DECODED}, in turns ({setup['rounds']} "
             f"rounds, best of {setup['repeats']}); read rate {setup['read_gb_s']:.1f} GB/s; runtime "
             f"{setup['runtime_mib']:.0f} MiB; llama.cpp {setup['llama_cpp_build']}; smollm2's activations "
             f"{setup['activations']}; built for {setup['tier']}",
             f"{'model, type':<15}{'file MiB':>9}{'smollm2 tg/pp':>16}{'llama.cpp tg/pp':>18}{'tg x':>7}{'pp x':>7}"
             f"{'tg x by round':>15}{'RSS MiB (/file)':>17}{'llama RSS':>11}{'GB/s (of read)':>16}  weights read"]
    for r in rows:
        s, l = r["smollm2"], r["llama_cpp"]
        lines.append(f"{r['size'] + ' ' + r['type'].upper():<15}{r['file_mib']:>9.0f}"
                     f"{s['decode_tok_s']:>8.1f}/{s['prefill_tok_s']:<7.1f}{l['decode_tok_s']:>9.1f}/"
                     f"{l['prefill_tok_s']:<8.1f}{r['decode_ratio']:>6.2f}x{r['prefill_ratio']:>6.2f}x"
                     f"{min(r['decode_ratio_by_round']):>9.2f}-{max(r['decode_ratio_by_round']):.2f}"
                     f"{s['peak_mib']:>9.0f} ({r['rss_per_file']:.1f}x){l['peak_mib']:>10.0f}"
                     f"{r['read_gb_s']['smollm2']:>9.1f} ({r['read_share']['smollm2']:>3.0%})"
                     f"  {s['weights_read']}{' busy' if r['busy'] else ''}"
                     f"{' FAILS ' + ','.join(r['failed']) if r['failed'] else ''}")
    return "\n".join(lines)


def choices(text: str, allowed: tuple, flag: str, p: argparse.ArgumentParser) -> list[str]:
    chosen = [x.strip().lower() for x in text.split(",") if x.strip()]
    if unknown := [x for x in chosen if x not in allowed]:
        p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="360m,1.7b", help="comma-separated: 360m, 1.7b")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES),
                   help=f"comma-separated, of {', '.join(CONVERTED + QUANTIZED)} (default: {','.join(DEFAULT_TYPES)})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="turns each side takes per file; the best counts")
    p.add_argument("--repeats", type=int, default=3, help="timed runs within each turn (llama-bench's -r)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the setup and rows as JSON to FILE")
    p.add_argument("--bars", action="store_true", help="exit 1 where a row misses the issue's bars")
    p.add_argument("--int8-activations", action="store_true",
                   help="smollm2 in its opt-in int8-activation mode (not exact), as llama.cpp computes")
    p.add_argument("--tier", choices=list(CMAKE_ARGS), default="native",
                   help="the x86 tier both sides are built for (default: this CPU's own)")
    args = p.parse_args()
    sizes = choices(args.sizes, tuple(PUBLISHED), "--sizes", p)
    types = choices(args.types, CONVERTED + QUANTIZED, "--types", p)
    if args.threads < 1 or args.rounds < 1 or args.repeats < 1:
        p.error("--threads, --rounds and --repeats must be at least 1")
    for tier, tool in (("native", "llama-quantize"), (args.tier, "llama-bench")):
        if not tool_binary(tier, tool).exists():
            p.error(f"no {tool_binary(tier, tool)}: run benchmarks/llamacpp.py --build-tools --tier {tier}")

    files = {size: gguf_files(size, types) for size in sizes}  # all made first: the timings then run alone
    rate, runtime, rows = read_rate(args.threads), runtime_mib(), []

    def report(final: bool) -> list[dict]:  # the JSON written after each file too: a long run cut short keeps it
        done = [with_bars(row, runtime, rate) for row in rows]
        setup = {"cpu": rows[0]["llama_cpp"]["cpu"], "threads": args.threads, "rounds": args.rounds,
                 "repeats": args.repeats, "read_gb_s": rate / 1e9, "runtime_mib": runtime,
                 "llama_cpp_build": rows[0]["llama_cpp"]["build"], "torch": torch.__version__, "complete": final,
                 "activations": "int8" if args.int8_activations else "exact", "tier": args.tier}
        if args.json:
            args.json.write_text(json.dumps({**setup, "rows": done}, indent=1))
        if final:
            print(table(done, setup))
        return done

    for size in sizes:
        for type, path in files[size].items():
            rows.append(compare(size, type, path, args))
            report(final=False)
    rate = max(rate, read_rate(args.threads))
    done = report(final=True)  # the table and the JSON, bars or not
    return 1 if args.bars and any(row["failed"] for row in done) else 0


if __name__ == "__main__":
    sys.exit(main())
