"""CPU kernels (kernels.c), and the torch code each replaces where it is the faster: for decoding, few-row
matrix products and all the transformer blocks of a decoding step in one call; for prompts, float32 matrix
products, the causal attention and the elementwise steps. accelerate.py applies them to a model.

Decoding streams fp32, bf16 and int8 weights at close to the memory's speed, where torch's BLAS calls reach a
fraction of it, with no Python and no thread wake-ups between the ~10 operations of each layer; a float32
model read from GGUF Q4_1 / Q8_0 blocks streams those packed blocks instead, to the same bits. A row's result
does not depend on how many rows share the call, a prompt's included. A prompt's attention computes only the
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
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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
PACKED_TYPES = {GGMLQuantizationType.Q4_1: 3, GGMLQuantizationType.Q8_0: 4}  # GGUF's packed weights it streams
SCALES = {GGMLQuantizationType.Q4_1: 2, GGMLQuantizationType.Q8_0: 1}  # float16s that open each block of 32
# kernels.c's type -> bytes a block of 32 weights, its scales widened to float32
PACKED_BYTES = {PACKED_TYPES[kind]: GGML_QUANT_SIZES[kind][1] + 2 * SCALES[kind] for kind in PACKED_TYPES}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # as struct block
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "Q4_1 packed", "Q8_0 packed")  # by kernels.c's type
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
    p, i, n, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    return SimpleNamespace(
        linear=CFunction(lib.linear, x=p, type=i, count=i, w=p, w_type=i, scale=p, y=p, B=n, N=p, K=n),
        blocks=CFunction(lib.blocks, ctypes.c_int, w=p, layers=i, x=p, type=i, B=n, T=n, cos=p, sin=p, slots=p,
                         slot_stride=n, k_cache=p, v_cache=p, S=n, stride_b=n, stride_h=n, mask=p),
        prompt_attention=CFunction(lib.prompt_attention, ctypes.c_int, q=p, k=p, v=p, out=p, type=i, B=n, T=n, H=n,
                                   KVH=n, D=n, k_stride=p, v_stride=p),
        silu_mul=CFunction(lib.silu_mul, gate=p, up=p, out=p, type=i, n=n),
        rope_rows=CFunction(lib.rope_rows, x=p, cos=p, sin=p, out=p, type=i, R=n, heads=n, D=n),
        norm_rows=CFunction(lib.norm_rows, x=p, weight=p, out=p, type=i, R=n, C=n, eps=f),
    )


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can compute with x: inference (no gradients, no torch.compile) on the CPU, in float32
    or bf16, unless they are off."""
    return (choices.mode != "off" and x.device.type == "cpu" and x.dtype in DTYPES
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and compiled() is not None)


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


class Packed(NamedTuple):
    """A float32 weight's exact values as GGUF packed them, in the layout the kernels stream (packed_layout)."""
    type: int  # kernels.c's Q4_1 or Q8_0
    data: torch.Tensor  # uint8 (N, K / 32 * PACKED_BYTES[type])


def packed_layout(kind: int, data: np.ndarray) -> Packed | None:
    """GGUF blocks of `kind` (rows, bytes) in the layout the kernels stream; None for kinds they do not stream.
    Their float16 scales become float32 (exactly), which the CPU broadcasts for free."""
    kind = GGMLQuantizationType(kind)
    if kind not in PACKED_TYPES:
        return None
    blocks = data.reshape(data.shape[0], -1, GGML_QUANT_SIZES[kind][1])  # (N, K / 32, block size)
    scales = np.ascontiguousarray(blocks[..., :2 * SCALES[kind]]).view(np.float16).astype(np.float32)
    ours = np.concatenate([scales.view(np.uint8), blocks[..., 2 * SCALES[kind]:]], axis=-1)
    return Packed(PACKED_TYPES[kind], torch.from_numpy(ours.reshape(data.shape[0], -1)))


def streams(weight: torch.Tensor, packed: Packed | None) -> bool:
    """Whether the kernels can stream `weight` (float32 decoded from GGUF) from `packed` instead."""
    N, K = weight.shape if weight.dim() == 2 else (0, 1)
    return (packed is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and K % 32 == 0
            and packed.data.shape == (N, K // 32 * PACKED_BYTES[packed.type]))


def streamed(weights: list[torch.Tensor], packed: list[Packed | None]) -> tuple[int, list[int]]:
    """kernels.c's type and the addresses of what it reads for these weights: their packed copies where all
    have them, of one type; else the weights themselves."""
    if all(p is not None and p.type == packed[0].type for p in packed):
        return packed[0].type, [p.data.data_ptr() for p in packed]
    return TYPES[weights[0].dtype], [w.data_ptr() for w in weights]


def linear(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None] | None = None,
           packed: list[Packed | None] | None = None) -> list[torch.Tensor]:
    """[x @ w.T (* scale per output channel, for int8 weights) for each w], (..., K) -> (..., N) in x's dtype.

    Several weights of one input (gate and up) stream in one pass; weights with `packed` copies stream those.
    Torch multiplies (torch_linear) where the kernel cannot or is the slower."""
    scales = scales or [None] * len(weights)
    packed = packed or [None] * len(weights)
    K, rows, w_type = x.shape[-1], x.numel() // x.shape[-1], weights[0].dtype

    def plain():
        return [torch_linear(x, w, s) for w, s in zip(weights, scales)]

    if not (multiplies(x, rows) and K % 16 == 0 and w_type in (x.dtype, torch.int8) and all(
            w.dtype == w_type and w.shape[1] == K and w.shape[0] % 16 == 0 and w.is_contiguous() for w in weights)):
        return plain()
    sizes = [w.shape[0] for w in weights]
    weight_type, addresses = streamed(weights, packed)
    float_scales = [None if s is None else s.float().contiguous() for s in scales]

    def kernel():
        contiguous = x.contiguous()
        y = torch.empty(rows * sum(sizes), dtype=x.dtype)
        compiled().linear(x=contiguous.data_ptr(), type=TYPES[x.dtype], count=len(sizes),
                         w=(ctypes.c_void_p * len(addresses))(*addresses), w_type=weight_type,
                         scale=pointers(float_scales), y=y.data_ptr(), B=rows, N=(ctypes.c_long * len(sizes))(*sizes),
                         K=K)
        return [part.view(*x.shape[:-1], n) for part, n in zip(y.split([rows * n for n in sizes]), sizes)]

    return choices.pick(Key("linear", DTYPES[x.dtype], WEIGHT_FORMATS[weight_type], rows_bucket(rows),
                            torch.get_num_threads(), (K, *sizes)), kernel, plain)


class BlockWeights(ctypes.Structure):
    """kernels.c's struct block: where a transformer block's weights are, and its sizes."""
    _fields_ = ([(name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", *LINEARS)]
                + [(name + "_scale", ctypes.c_void_p) for name in LINEARS]
                + [("w_type", ctypes.c_int)] + [(name, ctypes.c_long) for name in ("C", "H", "KVH", "D", "I")]
                + [("eps", ctypes.c_float)])


def blocks(weights: ctypes.Array, x: torch.Tensor, rope, mask: torch.Tensor | None, cache, slots: torch.Tensor,
           plain: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The model's blocks, one after another, for a few rows decoding against a KV cache: one call, one
    parallel region for all of them (norms, products, RoPE, cache writes, attention). None where the
    kernel cannot run them. weights: a BlockWeights per block. plain() is the model's own loop over the
    blocks (the same residual stream and cache writes): on torch's kernels alone, it runs instead where it
    is the faster.

    x: (B, T, C); rope: cos, sin (B, T, 1, hd) in x's dtype; mask: (B, 1, T, S) or None for causal;
    cache: a KVCache (or a view of one), (L, B, KVH, S, D); slots: (T,) or (B, T) cache slots of the rows."""
    B, T, C = x.shape
    k, v = cache.k, cache.v  # in place: a view's rows and slots of a larger cache, say
    L, S, w = len(weights), cache.max_len, weights[0]
    cos, sin = rope
    if B * T > MAX_ROWS or not usable(x) or not (
            k.dtype == x.dtype and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and k.stride() == v.stride()
            and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()
            and k.shape[:3] == (L, B, w.KVH) and k.shape[4] == w.D and C == w.C):
        return None
    slots = slots.to(torch.int64).contiguous()
    if slots.numel() and not 0 <= slots.min() <= slots.max() < S:  # torch raises the IndexError
        return None
    full_mask = None if mask is None else mask.expand(B, 1, T, S).contiguous()
    k_layers, v_layers = ((ctypes.c_void_p * L)(*[t.data_ptr() + n * t.stride(0) * t.element_size() for n in range(L)])
                          for t in (k, v))

    def kernel():
        y = x.contiguous().clone()  # the residual stream, updated in place
        if compiled().blocks(w=weights, layers=L, x=y.data_ptr(), type=TYPES[x.dtype], B=B, T=T, cos=cos.data_ptr(),
                            sin=sin.data_ptr(), slots=slots.data_ptr(), slot_stride=0 if slots.dim() == 1 else T,
                            k_cache=k_layers, v_cache=v_layers, S=S, stride_b=k.stride(1), stride_h=k.stride(2),
                            mask=None if full_mask is None else full_mask.data_ptr()):
            raise MemoryError("out of memory in the decoding kernel")
        return y

    def torch_loop():
        with choices.forced(False):
            return plain()

    return choices.pick(Key("blocks", DTYPES[x.dtype], WEIGHT_FORMATS[w.w_type], rows_bucket(B * T),
                            torch.get_num_threads(), (L, w.C, w.H, w.KVH, w.D, w.I)), kernel, torch_loop)


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
        if compiled().prompt_attention(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                                      type=TYPES[q.dtype], B=B, T=T, H=H, KVH=KVH, D=D,
                                      k_stride=(ctypes.c_long * 3)(*k.stride()[:3]),
                                      v_stride=(ctypes.c_long * 3)(*v.stride()[:3])):
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
        compiled().silu_mul(gate=gate.data_ptr(), up=up.data_ptr(), out=out.data_ptr(), type=TYPES[gate.dtype],
                           n=gate.numel())
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
        compiled().rope_rows(x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), out=out.data_ptr(),
                            type=TYPES[x.dtype], R=B * T, heads=heads, D=D)
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
        compiled().norm_rows(x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), type=TYPES[x.dtype],
                            R=x.numel() // C, C=C, eps=eps)
        return out

    return choices.pick(Key("rms_norm", DTYPES[x.dtype], None, rows_bucket(x.numel() // C), torch.get_num_threads(),
                            (C,)), kernel, plain)


from .accelerate import accelerate, weight_format  # noqa: E402  (it builds on the functions above)
