"""CPU kernels (kernels.c): for decoding, few-row matrix products and all the transformer blocks of a
decoding step in one call; for prompts, float32 matrix products, the causal attention and the elementwise steps.

Decoding streams fp32, bf16 and int8 weights at close to the memory's speed, where torch's BLAS calls reach a
fraction of it, with no Python and no thread wake-ups between the ~10 operations of each layer; a float32
model read from GGUF Q4_1 / Q8_0 blocks streams those blocks instead, to the same bits. A row's result does
not depend on how many rows share the call, a prompt's included. A prompt's attention computes only the
causal half that torch's kernel computes whole, and its RMSNorm, RoPE and SiLU*up take one pass each. The C
source is compiled for this machine on first use (a few seconds) into the user's cache; without a working C
compiler everything runs on torch's own kernels, only slower. Everything else (a bf16 prompt's products,
gradients, torch.compile, other devices) runs on torch as well.

Where a kernel is slower than torch's code on this machine, torch's runs instead: the first call of each kind
times both (choosing.py). SMOLLM2_KERNELS=on runs the kernels wherever they can run, =off never.
"""

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
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.utils.weak import WeakIdKeyDictionary

from .choosing import DECODING_ROWS, Choices, Key, rows_bucket

SOURCE = Path(__file__).with_name("kernels.c")
# The instruction set the kernels are built for: this CPU's own by default; SMOLLM2_MARCH=x86-64-v3 (AVX2) or
# x86-64 (SSE2) builds what a CPU of that tier runs, to test and time it here.
MARCH = os.environ.get("SMOLLM2_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
MAX_ROWS = DECODING_ROWS  # decoding steps of up to 16 rows (one kernel call for all the blocks)
# Past this many inputs a prompt's products go to BLAS, which splits them: the kernel's 4 weight rows outgrow L1
# and its 64 activation rows L2 (K = 4096 and 8192 ran at 70-85% of sgemm's speed, K <= 2560 at 100-125%).
MAX_PROMPT_K = 2560
MAX_HEAD_DIM = 256  # as kernels.c
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
BLOCK_TYPES = {GGMLQuantizationType.Q4_1: 3, GGMLQuantizationType.Q8_0: 4}  # GGUF blocks of 32 it streams
SCALES = {GGMLQuantizationType.Q4_1: 2, GGMLQuantizationType.Q8_0: 1}  # float16s that open each block
# kernels.c's type -> bytes a block of 32, its scales widened to float32
BLOCK_BYTES = {BLOCK_TYPES[kind]: GGML_QUANT_SIZES[kind][1] + 2 * SCALES[kind] for kind in BLOCK_TYPES}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # as struct block
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "Q4_1 blocks", "Q8_0 blocks")  # by kernels.c's type
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the activations the kernels take

# bf16 arithmetic in torch's own kernels: the CPU has it, and torch dispatches to it (ATEN_CPU_CAPABILITY=avx2
# holds torch to an AVX2 CPU's code, whose bf16 products are emulated).
NATIVE_BF16 = ((torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
               and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2"))


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


def initial_mode() -> str:
    """SMOLLM2_KERNELS: auto (the faster of kernel and torch, measured), on (the kernel wherever it runs) or off."""
    mode = os.environ.get("SMOLLM2_KERNELS", "auto")
    if mode not in ("auto", "on", "off"):
        warnings.warn(f"smollm2: SMOLLM2_KERNELS={mode!r} is none of auto, on, off; using auto", stacklevel=2)
        return "auto"
    return mode


# Which operations run on the kernels; measured choices are kept for this build and this torch (the other side),
# as it dispatches on this CPU (ATEN_CPU_CAPABILITY can hold it to a lower tier).
choices = Choices(initial_mode(), lambda: cache_dir() / (f"choices-{build_key()}-torch-{torch.__version__}-"
                                                         f"{torch.backends.cpu.get_cpu_capability()}.json"))


@functools.cache
def compiled_library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    try:
        path = cache_dir() / f"kernels-{build_key()}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"smollm2: building the CPU kernels for this machine (-march={MARCH}), once: a few seconds",
                  file=sys.stderr, flush=True)
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
    lib.linear.argtypes = [p, i, i, p, i, p, p, n, p, n]  # as kernels.c
    lib.blocks.argtypes = [p, i, p, i, n, n, p, p, p, n, p, p, n, n, n, p]
    lib.prompt_attention.argtypes = [p, p, p, p, i, n, n, n, n, n, p, p]
    lib.silu_mul.argtypes = [p, p, p, i, n]
    lib.rope_rows.argtypes = [p, p, p, p, i, n, n, n]
    lib.norm_rows.argtypes = [p, p, p, i, n, n, ctypes.c_float]
    return lib


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can compute with x: inference (no gradients, no torch.compile) on the CPU, in float32
    or bf16, unless they are off."""
    return (choices.mode != "off" and x.device.type == "cpu" and x.dtype in DTYPES
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and compiled_library() is not None)


def multiplies(x: torch.Tensor, rows: int) -> bool:
    """Whether the kernel multiplies x, holding `rows` rows (tokens), by weights: a decoding step's few rows; a
    prompt's many rows in float32 with up to MAX_PROMPT_K inputs, where it runs ~15% faster than BLAS (sgemm
    reaches ~85 of a 2-core Zen 4's 117 GMAC/s, the kernel ~100). A bf16 prompt stays on torch, whose bf16
    BLAS is as fast."""
    return (rows <= MAX_ROWS or (x.dtype == torch.float32 and x.shape[-1] <= MAX_PROMPT_K)) and usable(x)


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


def version(t: torch.Tensor) -> int:
    """Counts t's in-place changes (inference tensors count none)."""
    return -1 if t.is_inference() else t._version


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """[version(t) for t in tensors], in half the time when none is an inference tensor (the usual case)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # one is: it counts no changes
        return [version(t) for t in tensors]


class Blocks(NamedTuple):
    type: int  # kernels.c's Q4_1 or Q8_0
    data: torch.Tensor  # uint8 (N, K / 32 * block size), in kernels.c's layout
    version: int  # the weight's, and where it was, when they were kept: an in-place change makes them stale
    address: int


kept_blocks = WeakIdKeyDictionary()  # float32 weight -> Blocks holding its exact values


def block_layout(kind: int, data: np.ndarray) -> tuple[int, torch.Tensor] | None:
    """GGUF blocks of `kind` (rows, bytes) in the layout the kernels stream, with kernels.c's type for them;
    None for kinds they do not stream. Their float16 scales become float32 (exactly), which the CPU
    broadcasts for free."""
    kind = GGMLQuantizationType(kind)
    if kind not in BLOCK_TYPES:
        return None
    blocks = data.reshape(data.shape[0], -1, GGML_QUANT_SIZES[kind][1])  # (N, K / 32, block size)
    scales = np.ascontiguousarray(blocks[..., :2 * SCALES[kind]]).view(np.float16).astype(np.float32)
    ours = np.concatenate([scales.view(np.uint8), blocks[..., 2 * SCALES[kind]:]], axis=-1)
    return BLOCK_TYPES[kind], torch.from_numpy(ours.reshape(data.shape[0], -1))


def keep_blocks(weight: torch.Tensor, kind: int, blocks: torch.Tensor) -> None:
    """Stream `weight` (float32, decoded from GGUF blocks) from those blocks, (kind, blocks) as block_layout
    gives them, while it stays as it is: the same float32 products from 4-5x fewer bytes, so a quantized GGUF
    decoded to float32 decodes a token nearly at the speed of its own format. (Changes through .data are
    not counted: assign new weights, or change them in place, instead.)"""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    if (weight.dtype == torch.float32 and weight.device.type == "cpu" and K % 32 == 0
            and blocks.shape == (N, K // 32 * BLOCK_BYTES[kind])
            and not weight.is_inference()):  # an inference tensor counts no changes
        kept_blocks[weight] = Blocks(kind, blocks, version(weight), weight.data_ptr())


def streamed(weights: list[torch.Tensor]) -> tuple[int, list[int]]:
    """The type and addresses of what the kernel reads for these weights: their blocks when all have blocks of
    one type, still theirs; else the weights themselves."""
    kept = [kept_blocks.get(w) for w in weights]
    for w, b in zip(weights, kept):
        if b is not None and (b.version, b.address) != (version(w), w.data_ptr()):
            del kept_blocks[w]  # changed in place (trained, loaded into): the blocks no longer hold its values
    if all(b is not None and w in kept_blocks and b.type == kept[0].type for b, w in zip(kept, weights)):
        return kept[0].type, [b.data.data_ptr() for b in kept]
    return TYPES[weights[0].dtype], [w.data_ptr() for w in weights]


class Plan(NamedTuple):
    """The C call's view of a set of weights."""
    weights: ctypes.Array  # their addresses
    scales: ctypes.Array  # the addresses of their float32 scales, or NULL
    sizes: list[int]  # their output sizes N
    c_sizes: ctypes.Array  # the same, for C
    weight_type: int
    float_scales: list  # what `scales` points into, kept alive here


plans: dict[tuple, tuple[list, object]] = {}  # by where the weights are: (weak references to them, plan)


def cached(key: tuple, weights: list[torch.Tensor], build):
    """plans[key], from build() the first time: unless it was built for other tensors, freed since, that sat
    at the same addresses (its pointers, to kept blocks say, would be stale)."""
    entry = plans.get(key)
    if entry is None or any(ref() is not w for ref, w in zip(entry[0], weights)):
        if len(plans) > 4096:  # weights come and go (models loaded, converted): forget old sets now and then
            plans.clear()
        entry = plans[key] = ([weakref.ref(w) for w in weights], build())
    return entry[1]


def plan(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None]) -> Plan | None:
    """How the kernel multiplies x by these weights, or None when it cannot. Built once per set: a model's
    weights stay where they are, and the per-call checks and ctypes arrays would cost more than a small
    product."""
    def build():
        K, w_type = x.shape[-1], weights[0].dtype
        if not (K % 16 == 0 and w_type in (x.dtype, torch.int8) and all(
                w.dtype == w_type and w.shape[1] == K and w.shape[0] % 16 == 0 and w.is_contiguous() for w in weights)):
            return None
        float_scales = [None if s is None else s.float().contiguous() for s in scales]
        sizes = [w.shape[0] for w in weights]
        kind, addresses = streamed(weights)
        return Plan((ctypes.c_void_p * len(addresses))(*addresses), pointers(float_scales), sizes,
                    (ctypes.c_long * len(sizes))(*sizes), kind, float_scales)

    key = (x.shape[-1], x.dtype, *((w.data_ptr(), version(w), w.shape, w.stride(0), w.dtype, s if s is None else
                                   (s.data_ptr(), s.dtype)) for w, s in zip(weights, scales)))
    return cached(key, weights, build)


def linear(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None] | None = None):
    """[x @ w.T (* scale per output channel, for int8 weights) for each w], (..., K) -> (..., N) in x's dtype.

    Several weights of one input (q, k and v) stream in one pass. Torch multiplies (torch_linear) where the
    kernel cannot or is the slower."""
    scales = scales or [None] * len(weights)
    rows = x.numel() // x.shape[-1]
    found = plan(x, weights, scales) if multiplies(x, rows) else None

    def plain():
        return [torch_linear(x, w, s) for w, s in zip(weights, scales)]

    if found is None:
        return plain()
    sizes, contiguous = found.sizes, x.contiguous()

    def kernel():
        y = torch.empty(rows * sum(sizes), dtype=x.dtype)
        compiled_library().linear(contiguous.data_ptr(), TYPES[x.dtype], len(sizes), found.weights, found.weight_type,
                                  found.scales, y.data_ptr(), rows, found.c_sizes, x.shape[-1])
        if len(sizes) == 1:
            return [y.view(*x.shape[:-1], sizes[0])]
        return [part.view(*x.shape[:-1], n) for part, n in zip(y.split([rows * n for n in sizes]), sizes)]

    return choices.pick(Key("linear", DTYPES[x.dtype], WEIGHT_FORMATS[found.weight_type], rows_bucket(rows),
                            torch.get_num_threads(), (x.shape[-1], *sizes)), kernel, plain)


class BlockWeights(ctypes.Structure):
    """kernels.c's struct block: where a transformer block's weights are, and its sizes."""
    _fields_ = ([(name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", *LINEARS)]
                + [(name + "_scale", ctypes.c_void_p) for name in LINEARS]
                + [("w_type", ctypes.c_int)] + [(name, ctypes.c_long) for name in ("C", "H", "KVH", "D", "I")]
                + [("eps", ctypes.c_float)])


def block_modules(block) -> tuple[list, list]:
    """A transformer block's two RMSNorms and seven linear layers, in struct block's order. Read from the
    modules' own dicts: nn.Module's attribute lookup costs about a microsecond, and this runs every step."""
    modules = block._modules
    attn, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
    return ([modules["input_layernorm"], modules["post_attention_layernorm"]],
            [attn[name] for name in LINEARS[:4]] + [mlp[name] for name in LINEARS[4:]])


def weight_of(module) -> torch.Tensor:
    """module.weight: a parameter, or a buffer (int8 weights), without nn.Module's attribute lookup."""
    weight = module._parameters.get("weight")
    return module._buffers["weight"] if weight is None else weight


def streamed_format(layers) -> str:
    """The format decoding on the CPU reads the blocks' linear weights in: the model's dtype, or the GGUF
    blocks a float32 model keeps (for benchmarks to say what they measured)."""
    weights = [weight_of(m) for block in layers for m in block_modules(block)[1]]
    if weights[0].device.type != "cpu" or weights[0].dtype not in TYPES or compiled_library() is None:
        return str(weights[0].dtype).removeprefix("torch.")
    return WEIGHT_FORMATS[streamed(weights)[0]]


def block_weights(block, dtype: torch.dtype) -> tuple[BlockWeights, list] | None:
    """The C view of a block's weights (and the float32 scales it points into), or None where the kernel
    cannot run the block: biases, mixed weight types, sizes off its multiples of 16."""
    norms, linears = block_modules(block)
    attn = block.self_attn
    C, D, I = attn.o_proj.weight.shape[0], attn.head_dim, block.mlp.down_proj.weight.shape[1]
    w_type = linears[0].weight.dtype
    if not (C % 16 == 0 and I % 16 == 0 and D % 16 == 0 and D <= MAX_HEAD_DIM and w_type in (dtype, torch.int8)
            and all(m.bias is None and m.weight.dtype == w_type and m.weight.is_contiguous() for m in linears)
            and all(n.weight.dtype == dtype for n in norms)):
        return None
    scales = [None if getattr(m, "scale", None) is None else m.scale.float().contiguous() for m in linears]
    kind, addresses = streamed([m.weight for m in linears])
    return (BlockWeights(*(n.weight.data_ptr() for n in norms), *addresses,
                         *(None if s is None else s.data_ptr() for s in scales), kind, C, attn.n_heads, attn.n_kv, D,
                         I, norms[0].eps), scales)


def blocks_plan(layers, dtype: torch.dtype) -> tuple[ctypes.Array, list] | None:
    """struct block for every layer (and what they point into), or None where the kernel cannot run one.
    Built once per set of weights; checking that they are still the model's (the same tensors, where they were,
    unchanged) costs ~0.3 ms a step."""
    def build():
        found = [block_weights(block, dtype) for block in layers]
        return None if None in found else ((BlockWeights * len(found))(*(f[0] for f in found)), [f[1] for f in found])

    weights = [weight_of(m) for block in layers for modules in block_modules(block) for m in modules]
    # Flat: a tuple of ~800 numbers hashes in a third of the time of ~270 small tuples.
    key = (dtype, *[t.data_ptr() for t in weights], *versions(weights), *[t.shape for t in weights])
    return cached(key, weights, build)


def blocks(layers, x: torch.Tensor, rope, mask: torch.Tensor | None, cache, slots: torch.Tensor,
           plain: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The model's blocks, one after another, for a few rows decoding against a KV cache: one call, one
    parallel region for all of them (norms, products, RoPE, cache writes, attention). None where the
    kernel cannot run them. plain() is the model's own loop over the blocks (the same residual stream and
    cache writes): on torch's kernels alone, it runs instead where it is the faster.

    x: (B, T, C); rope: cos, sin (B, T, 1, hd) in x's dtype; mask: (B, 1, T, S) or None for causal;
    slots: (T,) or (B, T) cache slots of the rows."""
    B, T, C = x.shape
    k, v = cache.k, cache.v  # (L, B, KVH, S, D), in place: a view's rows and slots of a larger cache, say
    S = cache.max_len
    cos, sin = rope
    if B * T > MAX_ROWS or not usable(x) or not (
            k.dtype == x.dtype and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and k.stride() == v.stride()
            and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()):
        return None
    found = blocks_plan(layers, x.dtype)
    if found is None:
        return None
    weights = found[0]
    if k.shape[0] < len(layers) or (k.shape[1], k.shape[2], k.shape[4], C) != (B, weights[0].KVH, weights[0].D,
                                                                                 weights[0].C):
        return None  # a cache or input of another shape than the model's
    slots = slots.to(torch.int64).contiguous()
    if slots.numel() and not 0 <= slots.min() <= slots.max() < S:  # torch raises the IndexError
        return None
    full_mask = None if mask is None else mask.expand(B, 1, T, S).contiguous()
    k_rows, v_rows = ((ctypes.c_void_p * len(layers))(*[t.data_ptr() + n * t.stride(0) * t.element_size()
                                                         for n in range(len(layers))]) for t in (k, v))

    def kernel():
        y = x.contiguous().clone()  # the residual stream, updated in place
        if compiled_library().blocks(weights, len(layers), y.data_ptr(), TYPES[x.dtype], B, T, cos.data_ptr(),
                                     sin.data_ptr(), slots.data_ptr(), 0 if slots.dim() == 1 else T, k_rows, v_rows,
                                     S, k.stride(1), k.stride(2),
                                     None if full_mask is None else full_mask.data_ptr()):
            raise MemoryError("out of memory in the decoding kernel")
        return y

    def torch_loop():
        with choices.forced(False):
            return plain()

    w = weights[0]
    return choices.pick(Key("blocks", DTYPES[x.dtype], WEIGHT_FORMATS[w.w_type], rows_bucket(B * T),
                            torch.get_num_threads(), (len(layers), w.C, w.H, w.KVH, w.D, w.I)), kernel, torch_loop)


def prompt_rows(*tensors: torch.Tensor) -> bool:
    """Whether these (a prompt's activations, of one dtype, contiguous) go to the elementwise kernels: many rows
    on the CPU, without gradients. A few rows are a decoding step's, which kernels.blocks runs whole."""
    x = tensors[0]
    return (x.numel() > MAX_ROWS * x.shape[-1] and usable(x)
            and all(t.dtype == x.dtype and t.is_contiguous() for t in tensors))


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     plain: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Causal attention of a prompt's rows, each query t seeing keys 0..t: q (B, T, H, D), k and v (B, KVH, T, D)
    (a cache's first T slots, say) -> (B, T, H, D). Only the seen half is computed, where torch's kernel
    scores every key of a prompt of up to 512 tokens, then masks half of them. plain(), torch's, runs where the
    kernel does not (few rows, gradients, other devices, head sizes off 64) or is the slower."""
    B, T, H, D = q.shape
    KVH = k.shape[1]
    if not (prompt_rows(q) and T > MAX_ROWS and D % 64 == 0 and D <= MAX_HEAD_DIM and H % KVH == 0
            and k.shape == v.shape == (B, KVH, T, D) and k.dtype == v.dtype == q.dtype
            and k.stride(-1) == v.stride(-1) == 1):
        return plain()

    def kernel():
        out = torch.empty_like(q)
        if compiled_library().prompt_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                               TYPES[q.dtype], B, T, H, KVH, D, (ctypes.c_long * 3)(*k.stride()[:3]),
                                               (ctypes.c_long * 3)(*v.stride()[:3])):
            raise MemoryError("out of memory in the prompt attention kernel")
        return out

    # Its length, not its rows, sizes a prompt's attention (each query sees up to T keys).
    return choices.pick(Key("prompt_attention", DTYPES[q.dtype], None, rows_bucket(T), torch.get_num_threads(),
                            (B, H, KVH, D)), kernel, plain)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, plain: Callable[[], torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up in one pass; plain(), torch's, where the kernel does not run it or is the slower."""
    if not (prompt_rows(gate, up) and gate.shape == up.shape and gate.shape[-1] % 16 == 0):
        return plain()

    def kernel():
        out = torch.empty_like(gate)
        compiled_library().silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), TYPES[gate.dtype], gate.numel())
        return out

    return choices.pick(Key("silu_mul", DTYPES[gate.dtype], None, rows_bucket(gate.numel() // gate.shape[-1]),
                            torch.get_num_threads(), (gate.shape[-1],)), kernel, plain)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plain: Callable[[], torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in one pass, x (B, T, heads, D), cos and sin (B, T, 1, D); plain(), torch's,
    where the kernel does not run it or is the slower."""
    B, T, heads, D = x.shape
    if not (prompt_rows(x, cos, sin) and cos.shape == sin.shape == (B, T, 1, D) and D % 32 == 0):
        return plain()

    def kernel():
        out = torch.empty_like(x)
        compiled_library().rope_rows(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), TYPES[x.dtype],
                                     B * T, heads, D)
        return out

    return choices.pick(Key("rope", DTYPES[x.dtype], None, rows_bucket(B * T), torch.get_num_threads(), (heads, D)),
                        kernel, plain)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: Callable[[], torch.Tensor]) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension in one pass; plain(), torch's, where the kernel does not run
    it or is the slower."""
    C = x.shape[-1]
    if not (prompt_rows(x, weight) and C % 16 == 0 and weight.shape == (C,)):
        return plain()

    def kernel():
        out = torch.empty_like(x)
        compiled_library().norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), TYPES[x.dtype], x.numel() // C,
                                     C, eps)
        return out

    return choices.pick(Key("rms_norm", DTYPES[x.dtype], None, rows_bucket(x.numel() // C), torch.get_num_threads(),
                            (C,)), kernel, plain)
