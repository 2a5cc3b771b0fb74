"""Where a pass's time goes (profile): per layer and operation, on model.py's reference math through its hook
points, with the bytes each reads and the products it computes, against this machine's measured memory bandwidth
and matrix-product speed (Machine), the roofline each operation is held against; beside it, the same pass as the
model serves it, its kernels fused. bench.py measures the same speed whole, beside other systems.

    found = profile(model, ids)                # found.prefill, found.decode: [Op(layer, name, kind, seconds, ...)]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
from collections import abc
from pathlib import Path

import torch

from .errors import SmolError
from .generation.hooks import Hooks, point_names
from .generation.sampling import Sampling, sample
from .generation.request import checked_rows
from .kernels.build import cache_dir, cpu_signature
from .kernels.held import HeldWeight
from .lens import reference_math


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this machine's memory and matrix products reach, measured once (measure()) and kept: the limits a
    roofline holds each operation against."""
    bandwidth: float  # bytes per second read from memory: a matrix-vector product's, over a large matrix
    flops: float  # float32 operations per second: a large matrix product's


STREAMED_SIZE = 8192  # a square float32 matrix of 256 MiB, far past any cache, multiplied by a vector
PRODUCT_SIZE = 2048  # a square float32 matrix product: 17 GFLOP


def measure(device: torch.device) -> Machine:
    """The best of a few runs of a large matrix times a vector (the matrix read once, as a decoding step reads each
    weight) and of a large matrix product, with this thread's torch threads."""
    def best(run: abc.Callable, times: int) -> float:
        seconds = []
        for _ in range(times + 1):  # the first warms up
            begin = time.perf_counter()
            run()
            synchronize(device)
            seconds.append(time.perf_counter() - begin)
        return min(seconds[1:])

    streamed, vector = torch.ones(STREAMED_SIZE, STREAMED_SIZE, device=device), torch.ones(STREAMED_SIZE, device=device)
    read_s = best(lambda: streamed @ vector, 5)
    a = torch.randn(PRODUCT_SIZE, PRODUCT_SIZE, device=device)
    product_s = best(lambda: a @ a, 3)
    return Machine(bandwidth=4 * STREAMED_SIZE ** 2 / read_s, flops=2 * PRODUCT_SIZE ** 3 / product_s)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_file() -> Path:
    """Where the measurements are kept: one file per CPU model and torch version, an entry per device and
    thread count."""
    cpu = hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]
    return cache_dir() / f"machine-{cpu}-torch-{torch.__version__}.json"


def machine(device: torch.device, file: abc.Callable[[], Path] = machine_file) -> Machine:
    """This machine's Machine for `device` with this thread's torch threads: kept in `file`, else measured (about
    a second) and added to it. A file that cannot be read is measured again; one that cannot be written, next
    time."""
    path, key = file(), f"{device.type}-{torch.get_num_threads()}-threads"
    try:
        kept = json.loads(path.read_text())
    except (OSError, RuntimeError, ValueError):  # RuntimeError: no home directory
        kept = {}
    try:
        return Machine(**kept[key])
    except (TypeError, KeyError):  # none kept, or not what this function writes
        kept = kept if isinstance(kept, dict) else {}
    found = measure(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then renamed: never a half-written file
            written = Path(tmp) / path.name
            written.write_text(json.dumps({**kept, key: dataclasses.asdict(found)}, indent=1))
            written.replace(path)
    except (OSError, RuntimeError):
        pass
    return found


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a pass: where (the block, None outside them), what, how long, and what it costs."""
    layer: int | None
    name: str  # q_proj, scores, ln1, ... (OPS)
    kind: str  # product, attention, norm, activation, residual, embedding or sampling
    seconds: float
    bytes: int  # read: weights, activations, keys and values
    flops: int  # multiplications and additions of its products (0 for the rest, which memory bounds)


# The operation that ends at each hook point: the time from the point before is its.
OPS = {"hook_embed": ("embed", "embedding"), "hook_resid_pre": ("residual", "residual"),
       "ln1.hook_scale": ("ln1", "norm"), "ln1.hook_normalized": ("ln1", "norm"),
       "attn.hook_q": ("q_proj", "product"), "attn.hook_k": ("k_proj", "product"),
       "attn.hook_v": ("v_proj", "product"), "attn.hook_rot_q": ("rope", "attention"),
       "attn.hook_rot_k": ("rope", "attention"), "attn.hook_attn_scores": ("scores", "attention"),
       "attn.hook_pattern": ("softmax", "attention"), "attn.hook_z": ("mix", "attention"),
       "hook_attn_out": ("o_proj", "product"), "hook_resid_mid": ("residual", "residual"),
       "ln2.hook_scale": ("ln2", "norm"), "ln2.hook_normalized": ("ln2", "norm"),
       "mlp.hook_pre": ("gate_proj", "product"), "mlp.hook_pre_linear": ("up_proj", "product"),
       "mlp.hook_post": ("silu_mul", "activation"), "hook_mlp_out": ("down_proj", "product"),
       "hook_resid_post": ("residual", "residual"), "ln_final.hook_scale": ("ln_final", "norm"),
       "ln_final.hook_normalized": ("ln_final", "norm")}


@dataclasses.dataclass
class Profile:
    """Where a prompt's pass (prefill) and one decoding step after it (decode, the fastest of a few) spend their
    time, op by op on the reference math; served_*: the same two as the model serves them, its kernels fused
    (the time that counts); machine: the limits."""
    tokens: int
    prefill: list[Op]
    decode: list[Op]
    served_prefill_s: float
    served_decode_s: float
    machine: Machine


class Clock:
    """Hooks at every point that note when the pass reaches it: the time since the point before is the time of
    the operation between them."""

    def __init__(self, model):
        self.device, self.marks = model.model.embed_tokens.weight.device, []
        self.hooks = [(name, self.mark) for name in point_names(model.config.num_hidden_layers)]

    def mark(self, x, name):
        synchronize(self.device)
        self.marks.append((name, time.perf_counter()))

    def start(self) -> None:
        self.marks = [("", time.perf_counter())]

    def ops(self) -> list[tuple[int | None, str, str, float]]:
        """(layer, name, kind, seconds) in the order the pass met them, each operation of a layer once."""
        spent: dict[tuple[int | None, str, str], float] = {}
        for (_, before), (name, at) in zip(self.marks, self.marks[1:]):
            layer, point = (int(name.split(".")[1]), name.split(".", 2)[2]) if name.startswith("blocks.") \
                else (None, name)
            key = (layer, *OPS[point])
            spent[key] = spent.get(key, 0.0) + at - before
        return [(*key, seconds) for key, seconds in spent.items()]


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes a pass reads of a weight: a held matrix's blocks (kernels/held.py), not the float32 values torch
    sees."""
    return t.packed.data.nbytes if isinstance(t, HeldWeight) else t.numel() * t.element_size()


def costs(model, layer: int | None, name: str, tokens: int, slots: int) -> tuple[int, int]:
    """(bytes read, flops) of one operation of a pass of `tokens` tokens attending to `slots` slots."""
    config, e = model.config, model.model.embed_tokens.weight.element_size()
    C, I, hd = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    block = model.model.layers[layer] if layer is not None else None
    linear = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}.get(name)
    if linear is not None:
        module = block.get_submodule(linear)
        weights = sum(map(stored_bytes, (*module.parameters(), *module.buffers())))
        out, inputs = module.weight.shape
        return weights + tokens * inputs * e, 2 * tokens * inputs * out
    return {"embed": (tokens * C * e, 0), "residual": (2 * tokens * C * e, 0),
            "ln1": ((tokens + 1) * C * e, 0), "ln2": ((tokens + 1) * C * e, 0), "ln_final": ((tokens + 1) * C * e, 0),
            "rope": (tokens * (heads + kv + 4) * hd * e, 0),
            "scores": ((tokens * heads + slots * kv) * hd * e, 2 * tokens * slots * heads * hd),
            "softmax": (tokens * slots * heads * e, 0),
            "mix": ((tokens * slots * heads + slots * kv * hd) * e, 2 * tokens * slots * heads * hd),
            "silu_mul": (2 * tokens * I * e, 0),
            "lm_head": (stored_bytes(model.output_weight) + C * e,
                        2 * C * model.output_weight.shape[0]),
            "sample": (4 * config.vocab_size, 0)}[name]


@torch.inference_mode()
def profile(model, ids: list[int], repeats: int = 5, file: abc.Callable[[], Path] = machine_file) -> Profile:
    """Time a prompt's pass and one decoding step after it, op by op on the reference math (each op's time is
    the time between the hook points around it; the decoding step's, the fastest of `repeats`), then the
    output projection of the last position and a sampling draw (temperature 1), as each pass ends in serving.
    file: where the Machine is kept (machine())."""
    (prompt,) = checked_rows([ids], model.config, model.config.max_position_embeddings - 1)  # and one more token
    T, device = len(prompt), model.model.embed_tokens.weight.device
    if T + 1 > model.config.max_position_embeddings:
        raise SmolError(f"{T} tokens and one more exceed the context window of {model.config.max_position_embeddings}")
    clock, draw = Clock(model), Sampling(temperature=1.0, seed=0)
    timed = Hooks(model.config.num_hidden_layers, clock.hooks)
    cache = model.new_cache(1, T + 1)
    prompt_ids, next_id = torch.tensor([prompt], device=device), torch.tensor([[prompt[-1]]], device=device)

    def run(hooks: Hooks, ids: torch.Tensor, slots: torch.Tensor) -> list[tuple]:
        clock.start()
        h = hooks.hidden_states(model, ids, slots, cache.view(length=int(slots[-1]) + 1))
        ops = clock.ops()
        begin = time.perf_counter()
        logits = model.logits(h[:, -1])
        synchronize(device)
        middle = time.perf_counter()
        sample(logits, [draw], [draw.generator(device)])
        synchronize(device)
        return ops + [(None, "lm_head", "product", middle - begin), (None, "sample", "sampling",
                                                                    time.perf_counter() - middle)]

    with reference_math(model):
        prefill = run(timed, prompt_ids, torch.arange(T, device=device))
        decodes = [run(timed, next_id, torch.tensor([T], device=device)) for _ in range(repeats)]
    decode = [(*op[:3], min(d[i][3] for d in decodes)) for i, op in enumerate(decodes[0])]

    def served(ids: torch.Tensor, slots: torch.Tensor) -> float:
        best = []
        for _ in range(2 if len(slots) > 1 else repeats):
            begin = time.perf_counter()
            model.logits(model.hidden_states(ids, slots, cache.view(length=int(slots[-1]) + 1), last_only=True))
            synchronize(device)
            best.append(time.perf_counter() - begin)
        return min(best)

    def ops(timings: list[tuple], tokens: int, slots: int) -> list[Op]:
        return [Op(layer, name, kind, seconds, *costs(model, layer, name, tokens, slots))
                for layer, name, kind, seconds in timings]

    return Profile(T, ops(prefill, T, T), ops(decode, 1, T + 1), served(prompt_ids, torch.arange(T, device=device)),
                   served(next_id, torch.tensor([T], device=device)), machine(device, file))
