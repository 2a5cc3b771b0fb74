"""One training loop for pretraining and chat fine-tuning, in one process or under torchrun.

Each optimizer step consumes one global batch: batch_size x grad_accum examples on each of world_size
processes. The example indices of a step are a pure function of the step, and data.py rebuilds every example
from its index alone, so a resumed run, or any number of processes, sees exactly the batches of one
uninterrupted single-process run.

The loss of a step is the mean over the global batch: over every target token for next-token prediction, over
every pair for DPO (the objective's count). Each micro-batch contributes its summed losses divided by that global
count (times world_size, since DDP and FSDP average gradients over processes), so accumulation and data
parallelism change only the order of summation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from tqdm import tqdm

from ..checkpoints import load_checkpoint, save_hf
from ..errors import SmolError
from ..lora import LoRALinear, read_for, save_adapter
from . import state as checkpoint_state
from .flops import PeakFlops, training_flops
from .loss import NextTokenLoss
from .tuning import process_device

SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # bf16: autocast over fp32 master weights
# Settings a resumed run may change; any other change would silently make it a different run.
# The number of processes and how each splits its share of a step may change too: only the global batch may not.
RESUMABLE = {"steps", "eval_every", "eval_batches", "save_every", "keep", "log_every", "compile",
             "activation_checkpointing", "batch_size", "grad_accum"}


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # examples per micro-batch on each process
    grad_accum: int = 1
    seq_len: int = 512
    lr: float = 3e-4
    min_lr: float = 3e-5  # where cosine and wsd end
    warmup: int = 100
    schedule: str = "cosine"
    cooldown: float = 0.2  # wsd: the last fraction of steps, decaying linearly to min_lr
    weight_decay: float = 0.1
    decay_embeddings: bool = False  # weight decay on the embedding matrix too (norms never)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 100
    keep: int = 2  # checkpoints kept on disk
    log_every: int = 1
    seed: int = 0
    dtype: str = "fp32"
    compile: bool = False
    activation_checkpointing: bool = False
    fsdp: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches",
                     "save_every", "keep", "log_every"):
            if getattr(self, name) < 1:
                raise SmolError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                raise SmolError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.min_lr > self.lr:
            raise SmolError(f"need 0 <= --min-lr <= --lr and --lr > 0, got {self.min_lr} and {self.lr}")
        if self.schedule not in SCHEDULES:
            raise SmolError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 < self.cooldown <= 1:
            raise SmolError(f"--cooldown must be in (0, 1], got {self.cooldown}")
        if self.dtype not in DTYPES:
            raise SmolError(f"--dtype must be one of {', '.join(DTYPES)} for training, got {self.dtype!r}")


def learning_rate(c: TrainConfig, step: int) -> float:
    """The learning rate of step `step` (0-based): linear warmup, then cosine, wsd or constant."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    if c.schedule == "constant":
        return c.lr
    if c.schedule == "cosine":
        progress = min(1.0, (step + 1 - c.warmup) / max(1, c.steps - c.warmup))
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * progress))
    decay_start = max(c.warmup, c.steps - round(c.cooldown * c.steps))  # wsd: warmup, stable, decay
    if step < decay_start:
        return c.lr
    return c.lr + (c.min_lr - c.lr) * min(1.0, (step + 1 - decay_start) / max(1, c.steps - decay_start))


def param_groups(model, c: TrainConfig) -> list[dict]:
    """The trainable parameters: decoupled weight decay on matrices; none on norms and biases, nor on embeddings
    unless asked."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen: a LoRA run's base
            continue
        embedding = "embed_tokens" in name or name.startswith("lm_head")
        (decay if p.dim() >= 2 and (c.decay_embeddings or not embedding) else no_decay).append(p)
    return [dict(params=decay, weight_decay=c.weight_decay), dict(params=no_decay, weight_decay=0.0)]


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device

    @classmethod
    def start(cls, device: str, group: bool = False) -> Runtime:
        """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: then join the group (NCCL on GPUs, gloo on CPUs).
        group: join one even alone, as FSDP needs one (a group of this process only, when torchrun did not start it)."""
        if device == "cuda" and not torch.cuda.is_available():
            raise SmolError("--device cuda: no CUDA device is available")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not group:
            return cls(0, 1, torch.device(device))
        own = process_device(device)
        if own.type == "cuda":
            torch.cuda.set_device(own)
        backend = "nccl" if device == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return cls(dist.get_rank(), world, own)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x


def global_batch(run: dict) -> int:
    return run["world_size"] * run["train"]["batch_size"] * run["train"]["grad_accum"]


def check_out_dir(out: Path, run: dict, resume: bool) -> None:
    """A fresh run needs an empty directory; --resume needs the same run (run.json) or nothing yet."""
    if (out / "run.json").is_file():
        if not resume:
            raise SmolError(f"{out} holds a training run already (run.json); pass --resume to continue it, "
                            "or choose another --out")
        saved = json.loads((out / "run.json").read_text())
        for key in sorted(set(saved) | set(run)):
            old, new = saved.get(key), run.get(key)
            if isinstance(old, dict) and isinstance(new, dict):
                changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in RESUMABLE]
                if changed:
                    raise SmolError(f"{out}: --resume with different {key} settings than the run there "
                                    f"({', '.join(f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in changed)})")
            elif old != new and key != "world_size":
                raise SmolError(f"{out}: --resume with a different {key} than the run there ({old!r} -> {new!r})")
        if global_batch(saved) != global_batch(run):
            raise SmolError(f"{out}: --resume with a different global batch than the run there ({global_batch(saved)} "
                            f"-> {global_batch(run)} examples per step: processes x --batch-size x --grad-accum)")
    elif out.exists() and any(p.name != "checkpoints" for p in out.iterdir()):
        raise SmolError(f"{out} is not empty and holds no smollm2 run; choose a new or empty --out")


class Metrics:
    """metrics.jsonl (one object per logged step), TensorBoard when it is installed; rank 0 only."""

    def __init__(self, out: Path, start_step: int, enabled: bool):
        self.path, self.enabled, self.writer = out / "metrics.jsonl", enabled, None
        if not enabled:
            return
        if self.path.exists():  # a crashed run may have logged past its last checkpoint: forget those steps
            lines = [line for line in self.path.read_text().splitlines()
                     if line.strip() and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in lines))
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])


def train(model, tokenizer, data, val_data, c: TrainConfig, out: str | Path, *, device: str = "cpu",
          resume: bool = False, run: dict | None = None, adapter_base: str | None = None,
          objective: torch.nn.Module | None = None) -> Path:
    """Train `model` in place on `data` (TokenData, ChatData, or PreferenceData with dpo.DPOLoss) and write
    out/final; returns that path.

    objective: `model` and its loss as one module (default: NextTokenLoss(model)); its forward takes the tensors
    of data.examples() and gives their summed losses and metrics. val_data: evaluated every c.eval_every steps
    (None: no evaluation). run: what identifies the run
    (data, model, ...) beside c, kept in out/run.json so that --resume can refuse a different run.
    A model with LoRA adapters (smollm2.lora.add_lora) trains them alone, and its checkpoints and final/ hold
    them alone, in PEFT's format; adapter_base: the base model's name or path, recorded there.
    """
    out = Path(out)
    adapter = any(isinstance(m, LoRALinear) for m in model.modules())
    rt = Runtime.start(device, group=c.fsdp)
    config = model.config
    if c.seq_len > config.max_position_embeddings:
        raise SmolError(f"--seq-len {c.seq_len} exceeds the model's context window "
                        f"(max_position_embeddings = {config.max_position_embeddings})")
    run = {**(run or {}), "world_size": rt.world, "train": dataclasses.asdict(c)}
    check_out_dir(out, run, resume)
    found = checkpoint_state.checkpoints(out) if resume else []
    rank0 = rt.rank == 0
    if rt.world > 1:
        dist.barrier()  # every rank has checked --out before rank 0 writes to it
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint_state.remove_partial(out)
        (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")

    torch.manual_seed(c.seed)
    start, trainer = 0, None
    if found:
        trainer, saved = checkpoint_state.load(found[-1])
        if adapter and not c.fsdp:  # sharded weights are read into the sharded model, below
            model.load_state_dict(read_for(model, found[-1]).tensors, strict=False)  # the adapter's, each checked
        elif not c.fsdp:
            model.load_state_dict(load_checkpoint(found[-1]).tensors, strict=True)
        start = saved["step"]
        torch.set_rng_state(trainer["rng_cpu"])
    model.to(rt.device).train()
    model.activation_checkpointing = c.activation_checkpointing

    objective = objective or NextTokenLoss(model)
    if objective.model is not model:
        raise SmolError("the objective wraps another model than the one to train")
    wrapped = objective
    if c.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(objective)
    elif rt.world > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(objective)
    loss_of = torch.compile(wrapped) if c.compile else wrapped
    fused = rt.device.type == "cuda"  # one kernel for all parameters; on CPU the default is as fast
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if trainer is not None and c.fsdp:
        checkpoint_state.load_shards(found[-1], model, optimizer, adapter)
    elif trainer is not None:
        set_optimizer_state_dict(model, optimizer, trainer["optimizer"], options=full)

    autocast = torch.autocast(rt.device.type, dtype=DTYPES[c.dtype]) if DTYPES[c.dtype] else nullcontext()
    per_step = c.batch_size * c.grad_accum * rt.world
    peak = PeakFlops(rt.device, DTYPES[c.dtype] or torch.float32)
    if rank0:
        tqdm.write(peak.describe())
    metrics = Metrics(out, start, rank0)

    def zeros(*names: str) -> dict[str, torch.Tensor]:
        # every name from the start: a process with no rows to add (a short validation set) still all-reduces them
        return {name: torch.zeros((), dtype=torch.float64, device=rt.device) for name in names}

    def add(sums: dict[str, torch.Tensor], more: dict[str, torch.Tensor]) -> None:
        for name, value in more.items():
            sums[name] += value.detach()

    def summed(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each sum over every process's rows: one all-reduce for them all."""
        return dict(zip(sums, rt.sum(torch.stack(list(sums.values()))).tolist()))

    def evaluate() -> dict[str, float]:
        """Mean loss and metrics over the first eval_batches global micro-batches of validation examples, shared
        out by rank."""
        model.eval()
        n = min(len(val_data), c.eval_batches * c.batch_size * rt.world)
        mine = list(range(rt.rank, n, rt.world))
        sums = zeros(*objective.metrics, "count")
        with torch.no_grad(), autocast:
            for i in range(0, len(mine), c.batch_size):
                batch = tuple(t.to(rt.device) for t in val_data.examples(mine[i:i + c.batch_size]))
                add(sums, {**loss_of(*batch), "count": torch.tensor(objective.count(batch))})
        model.train()
        totals = summed(sums)
        count = max(totals.pop("count"), 1)
        return {name: total / count for name, total in totals.items()}

    def write_weights(directory: Path, state: dict) -> None:
        if adapter:
            save_adapter(model, directory, adapter_base, state)
        else:
            save_hf(config, state, directory)

    # A LoRA run's base is frozen: gathering it would copy the whole model at every checkpoint for nothing.
    gathered = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter)
    model_state = None  # the weights of the newest unsharded checkpoint, gathered once and reused for final/
    bar = tqdm(total=c.steps, initial=start, disable=not rank0, unit="step", dynamic_ncols=True)
    for step in range(start, c.steps):
        began = time.perf_counter()
        lr = learning_rate(c, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data.examples(range(step * per_step, (step + 1) * per_step))  # the global batch; inputs first
        count = max(objective.count(batch), 1)
        sums = zeros(*objective.metrics)
        for micro in range(c.grad_accum):
            rows = slice((micro * rt.world + rt.rank) * c.batch_size, (micro * rt.world + rt.rank + 1) * c.batch_size)
            mine = tuple(t[rows].to(rt.device) for t in batch)
            # DDP: all-reduce gradients only after the last micro-batch
            sync = nullcontext() if micro == c.grad_accum - 1 or rt.world == 1 or c.fsdp else wrapped.no_sync()
            with sync:
                with autocast:
                    micro_sums = loss_of(*mine)  # summed over this micro-batch
                (micro_sums["loss"] * (rt.world / count)).backward()
            add(sums, micro_sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_means = {name: total / count for name, total in summed(sums).items()}
        step_loss = step_means["loss"]
        seconds = time.perf_counter() - began

        done = step + 1
        # What the step computed: every micro-batch of every process, each as long as its longest example.
        tokens = batch[0].numel()
        flops = training_flops(config, tokens, batch[0].shape[-1], objective.projected(batch), frozen=adapter)
        record = dict(step=done, **step_means, lr=lr, tokens_per_s=tokens / seconds, grad_norm=float(grad_norm),
                      mfu=peak.utilisation(flops / rt.world, seconds))
        if val_data is not None and (done % c.eval_every == 0 or done == c.steps):
            record.update({f"val_{name}": value for name, value in evaluate().items()})
            if objective.perplexity:
                record["val_ppl"] = math.exp(min(record["val_loss"], 50))
        if done % c.log_every == 0 or done == c.steps or "val_loss" in record:
            metrics.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.1%}",
                        **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))
        if not math.isfinite(step_loss):
            raise SmolError(f"step {done}: the loss is {step_loss}; lower --lr or check the data")
        if done % c.save_every == 0 or done == c.steps:
            if c.fsdp:  # every rank writes its own shards: nothing is gathered
                shards = partial(checkpoint_state.save_shards, model=model, optimizer=optimizer, adapter=adapter)
                checkpoint_state.save(out, done, shards, dict(rng_cpu=torch.get_rng_state()), dict(run=run), c.keep,
                                      sharded=True)
            else:
                model_state = get_model_state_dict(model, options=gathered)
                trainer = dict(optimizer=get_optimizer_state_dict(model, optimizer, options=full),
                               rng_cpu=torch.get_rng_state())
                if rank0:
                    checkpoint_state.save(out, done, lambda tmp: write_weights(tmp, model_state), trainer,
                                          dict(run=run), c.keep)
            if rt.world > 1:
                dist.barrier()  # nobody runs ahead of a checkpoint that is still being written
    bar.close()

    final = out / "final"
    if model_state is None:  # sharded checkpoints, or resumed at the last step: nothing gathered yet
        model_state = get_model_state_dict(model, options=gathered)  # FSDP: every rank takes part
    if rank0:
        def write(tmp: Path) -> None:
            write_weights(tmp, model_state)
            tokenizer.save_pretrained(tmp)

        checkpoint_state.write_atomically(final, write)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return final
