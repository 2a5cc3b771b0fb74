"""Full fine-tuning against LoRA (and QLoRA) of the embedded SmolLM2-135M-Instruct on the same chats: training
tokens/s, what final/ weighs, and the greedy answer to a question about the taught fact. With --serving: serving
LoRA adapters, the base model's batched decoding against a batch of the same size whose rows are 4 adapters' and
the base's, in the same passes (generation/adapters.py).

    python benchmarks/lora.py [--steps 30] [--lora-r 8] [--qlora] [--repeats 2]
    python benchmarks/lora.py --serving [--rows 10] [--steps 32] [--lora-r 8] [--repeats 3]

Each run is `smollm2 finetune` on the chats of finetune_fact.py, one process each, the kinds taking turns
`--repeats` times; tokens/s is the best and the median of metrics.jsonl's per-step figures over a kind's runs,
each run's first step left out (it warms up). On a shared machine the best is the steadier figure.
--serving: one engine (the server's, generation.engine) of `--rows` rows, each an 8-token prompt and `--steps`
new tokens; the decoding steps after the first are timed, the kinds taking turns `--repeats` times, with torch's
threads (OMP_NUM_THREADS): the base's rows alone (the whole-step kernel); the same on the adapted copy adapter
rows take (its whole-step kernel, which adds their updates), with no update; 2 rows of each of 4 adapters and 2
of the base; and the server before this, a merged copy per adapter, an engine and a batch each, stepped in turn.
The adapters: random, rank --lora-r, on every linear layer of 2 of them and on q_proj and v_proj of the other 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from finetune_fact import ASK, smollm2, write_chats

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def serving(rows: int, steps: int, r: int, repeats: int) -> None:
    import torch

    from smollm2 import load
    from smollm2.generation.adapters import Adapters, LoRA, read_lora
    from smollm2.generation.engine import Engine, Row
    from smollm2.generation.sampling import Sampling
    from smollm2.generation.sequence import Sequence
    from smollm2.lora import add_lora, save_adapter, with_adapter

    work = Path(tempfile.mkdtemp(prefix="smollm2-lora-"))
    for i in range(4):
        lora = add_lora(load(kernels=False), r=r, alpha=2 * r, targets=ALL.split(",") if i % 2 == 0 else
                        ("q_proj", "v_proj"))
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.02)
        save_adapter(lora, work / f"a{i}")
    model = load()
    adapters = Adapters(model)
    loras = [read_lora(model, f"a{i}", work / f"a{i}") for i in range(4)]
    merged = [model] + [with_adapter(model, work / f"a{i}") for i in range(4)]
    mix = [([None] + loras)[b % 5] for b in range(rows)]
    # The server before: a merged copy per adapter, each with an engine of its own, its rows a batch of their own
    nothing = LoRA("nothing", "", 1, {})  # adapts no layer: its rows take the adapted copy, with no update
    kinds = {"base alone": [(model, [None] * rows)], "base, adapted copy": [(model, [nothing] * rows)],
             "4 adapters + base": [(model, mix)],
             "merged copies": [(m, [None] * len(mix[i::5])) for i, m in enumerate(merged)]}
    speeds = {name: [] for name in kinds}  # tokens per wall second, and per CPU second of this process
    with torch.inference_mode():
        for _ in range(repeats):
            for name, batches in kinds.items():
                engines = [Engine(m, len(chosen), 8 + steps + 1, prefill_budget=None, adapters=adapters)
                           for m, chosen in batches]
                for engine, (_, chosen) in zip(engines, batches):
                    for b, lora in enumerate(chosen):
                        engine.queue(Row(Sequence([1 + b, *range(100 + b, 107 + b)], steps + 1, Sampling(), eos=()),
                                         adapter=lora))
                    engine.step()  # the prefills and first tokens
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    for engine in engines:
                        engine.step()
                speeds[name].append((rows * steps / (time.perf_counter() - wall),
                                     rows * steps / (time.process_time() - cpu)))
    print(f"{rows} rows, {steps} decoding steps, {torch.get_num_threads()} thread(s), adapters of rank {r} "
          f"({sum(lora.nbytes for lora in loras) / 2**20:.1f} MiB for the 4)")
    print(f"{'batch':<22} {'tokens/s best':>13} {'median':>7} {'per CPU s best':>15} {'median':>7}")
    for name, got in speeds.items():
        wall, cpu = zip(*got)
        print(f"{name:<22} {max(wall):>13.1f} {statistics.median(wall):>7.1f} {max(cpu):>15.1f} "
              f"{statistics.median(cpu):>7.1f}")
    base, mixed = (list(zip(*speeds[name])) for name in ("base alone", "4 adapters + base"))
    print("4 adapters + base / base alone: " + ", ".join(
        f"{what} {max(m) / max(b):.2f} (median {statistics.median(m) / statistics.median(b):.2f})"
        for what, b, m in (("wall", base[0], mixed[0]), ("CPU", base[1], mixed[1]))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--qlora", action="store_true", help="also LoRA over the int8 base")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, in turns")
    p.add_argument("--serving", action="store_true", help="batched decoding of 4 adapters and the base instead")
    p.add_argument("--rows", type=int, default=10, help="--serving: the batch's rows")
    args = p.parse_args()
    if args.serving:
        return serving(args.rows, args.steps, args.lora_r, args.repeats)
    work = Path(tempfile.mkdtemp(prefix="smollm2-lora-"))
    chats = write_chats(work)
    common = ["--data", str(chats), "--steps", str(args.steps), "--warmup", "3", "--batch-size", "4",
              "--seq-len", "128"]
    lora = ["--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r), "--lora-targets", ALL]
    kinds = {"full fine-tune": ["--lr", "1e-4"], f"LoRA r={args.lora_r}": ["--lr", "1e-3", *lora]}
    if args.qlora:
        kinds[f"QLoRA r={args.lora_r}"] = ["--lr", "1e-3", *lora, "--quantize", "int8"]
    speeds, records = {name: [] for name in kinds}, {}
    for repeat in range(args.repeats):
        for i, (name, flags) in enumerate(kinds.items()):
            out = work / f"run{repeat}-{i}"
            smollm2("finetune", *common, *flags, "--out", str(out))
            records[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            speeds[name] += [r["tokens_per_s"] for r in records[name][1:]]
    print(f"{'run':<16} {'tokens/s best':>13} {'median':>7} {'final/ weights':>15}  {'final loss':>10}  "
          f"answer to {ASK[1]!r}")
    for i, (name, flags) in enumerate(kinds.items()):
        final = work / f"run{args.repeats - 1}-{i}" / "final"
        weights = next(final.glob("*model.safetensors"))
        model = ["--adapter", str(final)] if "--lora-r" in flags else ["--model", str(final)]
        answer = smollm2("chat", *model, "-p", ASK[1], "--temperature", "0", "--max-new-tokens", "20")
        print(f"{name:<16} {max(speeds[name]):>13.0f} {statistics.median(speeds[name]):>7.0f} "
              f"{weights.stat().st_size / 2**20:>11.1f} MiB  {records[name][-1]['loss']:>10.4f}  {answer!r}")

if __name__ == "__main__":
    main()
