"""Each kernel of kernels.c beside the torch code it replaces, the faster of the two running (choosing.py): for
decoding, few-row matrix products and all the transformer blocks of a decoding step in one call; for prompts,
float32 matrix products, the causal attention and the elementwise steps.

Every function takes the Choices of the accelerator it runs for: its mode, its measured choices, whether this
thread is inside its torch_only(), whether its decoding products quantize their inputs to 8 bits. Where a kernel
cannot run the call (gradients, other devices, dtypes or sizes it has no code for) torch's code runs, with the
same values to float rounding.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .build import compiled
from .choosing import DECODING_ROWS, Choices, Key, rows_bucket
from .packed import Packed

MAX_ROWS = DECODING_ROWS  # decoding steps of up to 16 rows (one kernel call for all the blocks)
# Past this many inputs a prompt's products go to BLAS, which splits them: the kernel's 4 weight rows outgrow L1
# and its 64 activation rows L2 (K = 4096 and 8192 ran at 70-85% of sgemm's speed, K <= 2560 at 100-125%).
MAX_PROMPT_K = 2560
MAX_HEAD_DIM = 256  # as kernels.c
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # as struct block
# By kernels.c's type. With AVX2 the "stripes" and "across" types are laid out as eights (8 rows side by side).
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "Q4_1 packed", "Q8_0 packed", "Q4_0 packed", "Q4_K packed",
                  "Q5_K packed", "Q6_K packed", "Q5_0 packed", "Q5_1 packed", "Q4_0 stripes", "Q4_K across",
                  "Q5_K across", "Q6_K across", "Q8_0 eights", "Q4_1 eights", "Q5_0 eights", "Q5_1 eights")
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the activations the kernels take

# bf16 arithmetic in torch's own kernels: the CPU has it, and torch dispatches to it (ATEN_CPU_CAPABILITY=avx2
# holds torch to an AVX2 CPU's code, whose bf16 products are emulated).
NATIVE_BF16 = ((torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
               and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2"))


def usable(choices: Choices, x: torch.Tensor) -> bool:
    """Whether the kernels can compute with x: inference (no gradients, no torch.compile) on the CPU, in float32
    or bf16, unless choices allow torch alone."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and choices.allow_kernels() and compiled() is not None)


def multiplies(choices: Choices, x: torch.Tensor, rows: int) -> bool:
    """Whether the kernel multiplies x, holding `rows` rows (tokens), by weights: a decoding step's few rows; a
    prompt's many rows in float32 with up to MAX_PROMPT_K inputs, where it runs ~15% faster than BLAS (sgemm
    reaches ~85 of a 2-core Zen 4's 117 GMAC/s, the kernel ~100). A bf16 prompt stays on torch, whose bf16
    BLAS is as fast."""
    return (rows <= MAX_ROWS or (x.dtype == torch.float32 and x.shape[-1] <= MAX_PROMPT_K)) and usable(choices, x)


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


def each_prompt(choices: Choices, plain: Callable, *rows: torch.Tensor):
    """plain(*rows), torch's code for activations (1, rows, ...); in a batched prefill (Choices.packed) once per
    prompt's rows, so that each gets the bits it gets alone."""
    split = choices.split(rows[0].shape[1]) if rows[0].dim() > 2 and rows[0].shape[0] == 1 else None
    if split is None or len(split) == 1:
        return plain(*rows)
    parts = [plain(*part) for part in zip(*(t.split(split, dim=1) for t in rows))]
    if isinstance(parts[0], list):  # the products of one input (gate and up)
        return [torch.cat(outputs, dim=1) for outputs in zip(*parts)]
    return torch.cat(parts, dim=1)


def pointers(tensors, kind=ctypes.c_void_p):
    return (kind * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


def formats(types) -> str:
    """What weights of kernels.c's `types` are read as, each format once: "Q4_K packed+Q6_K packed"."""
    return "+".join(dict.fromkeys(WEIGHT_FORMATS[t] for t in types))


def streamed(weights: list[torch.Tensor], packed: list[Packed | None]) -> tuple[int, list[int]]:
    """kernels.c's type and the addresses of what it reads for these weights: their packed copies where all
    have them, of one type; else the weights themselves."""
    if all(p is not None and p.type == packed[0].type for p in packed):
        return packed[0].type, [p.data.data_ptr() for p in packed]
    return TYPES[weights[0].dtype], [w.data_ptr() for w in weights]


def linear(choices: Choices, x: torch.Tensor, weights: list[torch.Tensor],
           scales: list[torch.Tensor | None] | None = None,
           packed: list[Packed | None] | None = None) -> list[torch.Tensor]:
    """[x @ w.T (* scale per output channel, for int8 weights) for each w], (..., K) -> (..., N) in x's dtype.

    Several weights of one input (gate and up) stream in one pass; weights with `packed` copies stream those.
    Torch multiplies (torch_linear) where the kernel cannot or is the slower. With choices.int8_activations, a
    decoding step's few rows are quantized to 8 bits against packed blocks (kernels.c's rows_times); a prompt's
    many rows too where the integer products are the cheaper (kernels.c's int8_prompts: every block type with
    AVX512-VNNI), else they stay exact. Few or many as the row's own prompt has them (choices.bucket): in a batched
    prefill, each row's products are those it gets alone."""
    scales = scales or [None] * len(weights)
    packed = packed or [None] * len(weights)
    K, rows, w_type = x.shape[-1], x.numel() // x.shape[-1], weights[0].dtype

    def plain():
        return each_prompt(choices, lambda x: [torch_linear(x, w, s) for w, s in zip(weights, scales)], x)

    # Weights held as blocks alone (held.py) go to the kernel at any size, unmeasured: torch would decode them
    # first, every time.
    held = all(p is not None for p in packed) and usable(choices, x)
    if not ((held or multiplies(choices, x, rows)) and K % 16 == 0 and w_type in (x.dtype, torch.int8) and all(
            w.dtype == w_type and w.shape[1] == K and w.shape[0] % 16 == 0 and w.is_contiguous() for w in weights)):
        return plain()
    sizes = [w.shape[0] for w in weights]
    weight_type, addresses = streamed(weights, packed)
    float_scales = [None if s is None else s.float().contiguous() for s in scales]
    # Only GGUF blocks are multiplied in integers: float32, bf16 and int8 weights stay exact, their inputs unquantized.
    int8 = choices.int8_activations and weight_type > TYPES[torch.int8] and (
        choices.bucket(rows) <= MAX_ROWS or bool(compiled().int8_prompts(w_type=weight_type)))

    def kernel():
        contiguous = x.contiguous()
        y = torch.empty(rows * sum(sizes), dtype=x.dtype)
        compiled().linear(x=contiguous.data_ptr(), type=TYPES[x.dtype], count=len(sizes),
                          w=(ctypes.c_void_p * len(addresses))(*addresses), w_type=weight_type,
                          scale=pointers(float_scales), y=y.data_ptr(), B=rows,
                          N=(ctypes.c_long * len(sizes))(*sizes), K=K,
                          int8=int8)
        return [part.view(*x.shape[:-1], n) for part, n in zip(y.split([rows * n for n in sizes]), sizes)]

    # Quantized inputs are another kind: the kernel's time differs, and so may the winner.
    activations = DTYPES[x.dtype] + (" as int8" if int8 else "")
    return choices.pick(Key("linear", activations, WEIGHT_FORMATS[weight_type], choices.bucket(rows),
                            torch.get_num_threads(), (K, *sizes)), kernel, plain, measured=not held)


class BlockWeights(ctypes.Structure):
    """kernels.c's struct block: where a transformer block's weights are, and its sizes."""
    _fields_ = ([(name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", *LINEARS)]
                + [(name + "_scale", ctypes.c_void_p) for name in LINEARS]
                + [("w_type", ctypes.c_int * len(LINEARS))]  # each matrix's: GGUF files mix them
                + [(name, ctypes.c_long) for name in ("C", "H", "KVH", "D", "I")]
                + [("eps", ctypes.c_float)])


class LowRank(ctypes.Structure):
    """kernels.c's struct lowrank: a layer's LoRA updates for a decoding step, per linear layer (LINEARS' order) the
    step's adapters' A stacked, (n, r, in), and their (s B)^T stacked, (n, r, out), float32 and contiguous, ranks
    zero-padded to r; None: no adapter of the step adapts it."""
    _fields_ = [("a", ctypes.c_void_p * len(LINEARS)), ("b", ctypes.c_void_p * len(LINEARS)),
                ("r", ctypes.c_long * len(LINEARS))]


class CacheLayers(ctypes.Structure):
    """kernels.c's struct cache: where every layer's keys and values (and an int8 cache's scales) are, their type
    and strides."""
    _fields_ = ([(name, ctypes.POINTER(ctypes.c_void_p)) for name in ("k", "v", "k_scale", "v_scale")]
                + [("type", ctypes.c_int)]
                + [(name, ctypes.c_long) for name in ("S", "stride_b", "stride_h", "scale_stride_b", "scale_stride_h")])


def layer_pointers(t: torch.Tensor | None):
    """The address of each layer of t, (L, ...), as a C array (kept alive by the caller); None for None."""
    if t is None:
        return None
    start, step = t.data_ptr(), t.stride(0) * t.element_size()  # once: a decoding step asks for 4 x L of them
    return (ctypes.c_void_p * t.shape[0])(*[start + n * step for n in range(t.shape[0])])


def blocks(choices: Choices, weights: ctypes.Array, x: torch.Tensor, rope, mask: torch.Tensor | None, cache,
           slots: torch.Tensor, plain: Callable[[], torch.Tensor],
           updates: tuple[ctypes.Array, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The model's blocks, one after another, for a few rows decoding against a KV cache: one call, one
    parallel region for all of them (norms, products, RoPE, cache writes, attention). None where the
    kernel cannot run them. weights: a BlockWeights per block. plain() is the model's own loop over the
    blocks (the same residual stream and cache writes), for choices.pick(); a decoding step's kind is never
    given to it where the kernel can run (choosing.py).

    x: (B, T, C); rope: cos, sin (B, T, 1, hd) in x's dtype; mask: (B, 1, T, S) or None for causal;
    cache: a KVCache (or a view of one), (L, B, KVH, S, D) of any of its dtypes; slots: (T,) or (B, T) cache slots
    of the rows; updates: LoRA adapters' (a LowRank per block, and each row's adapter among them, (B,) int32, -1
    for none), each adapter row's update added after its base product, the other rows' bits unchanged. With
    choices.int8_activations, the products of packed blocks quantize their inputs to 8 bits."""
    B, T, C = x.shape
    k, v, k_scale, v_scale = cache.k, cache.v, cache.k_scale, cache.v_scale  # in place: a view's rows and slots
    L, S, w = len(weights), cache.max_len, weights[0]
    cos, sin = rope
    lowrank, adapter = updates or (None, None)
    if B * T > MAX_ROWS or not usable(choices, x) or not (
            k.dtype in TYPES and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and k.stride() == v.stride()
            and (k_scale is None or (k_scale.stride(-2) == 1 and k_scale.stride() == v_scale.stride()))
            and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()
            and k.shape[:3] == (L, B, w.KVH) and k.shape[4] == w.D and C == w.C
            and (adapter is None or (adapter.dtype == torch.int32 and adapter.shape == (B,)))):
        return None
    slots = slots.to(torch.int64).contiguous()
    if slots.numel() and not 0 <= slots.min() <= slots.max() < S:  # torch raises the IndexError
        return None
    full_mask = None if mask is None else mask.expand(B, 1, T, S).contiguous()
    layers = [layer_pointers(t) for t in (k, v, k_scale, v_scale)]
    scale_strides = (0, 0) if k_scale is None else k_scale.stride()[1:3]
    cache_layers = CacheLayers(*layers, TYPES[k.dtype], S, *k.stride()[1:3], *scale_strides)

    def kernel():
        y = x.contiguous().clone()  # the residual stream, updated in place
        if compiled().blocks(w=weights, layers=L, x=y.data_ptr(), type=TYPES[x.dtype], B=B, T=T, cos=cos.data_ptr(),
                             sin=sin.data_ptr(), slots=slots.data_ptr(), slot_stride=0 if slots.dim() == 1 else T,
                             cache=ctypes.byref(cache_layers),
                             mask=None if full_mask is None else full_mask.data_ptr(), lowrank=lowrank,
                             adapter=None if adapter is None else adapter.data_ptr(),
                             int8=choices.int8_activations and max(w.w_type) > TYPES[torch.int8]):
            raise MemoryError("out of memory in the decoding kernel")
        return y

    return choices.pick(Key("blocks", DTYPES[x.dtype], formats(w.w_type), rows_bucket(B * T),
                            torch.get_num_threads(), (L, w.C, w.H, w.KVH, w.D, w.I, TYPES[k.dtype])), kernel, plain)


def prompt_rows(choices: Choices, *tensors: torch.Tensor) -> bool:
    """Whether these (a prompt's activations, of one dtype, contiguous) go to the elementwise kernels: many rows
    on the CPU, without gradients. A few rows are a decoding step's, which blocks() runs whole."""
    x = tensors[0]
    return (x.numel() > MAX_ROWS * x.shape[-1] and usable(choices, x)
            and all(t.dtype == x.dtype and t.is_contiguous() for t in tensors))


def prompt_attention(choices: Choices, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     plain: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Causal attention of a prompt's rows, each query t seeing keys 0..t: q (B, T, H, D), k and v (B, KVH, T, D)
    (a cache's first T slots, say) -> (B, T, H, D). Only the seen half is computed, where torch's kernel
    scores every key of a prompt of up to 512 tokens, then masks half of them. plain(q, k, v), torch's, runs where
    the kernel does not (few rows, gradients, other devices, head sizes off 64) or is the slower. Inside
    Choices.packed(), the B rows are prompts of a batched prefill: decided as one of them alone, and torch's side
    run once per row (the kernel gives each (row, head) the same bits whatever shares its call)."""
    B, T, H, D = q.shape
    KVH = k.shape[1]
    alone = choices.packing()
    whole = lambda: plain(q, k, v)  # noqa: E731
    if alone and B > 1:
        whole = lambda: torch.cat([plain(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(B)])  # noqa: E731
    if not (prompt_rows(choices, q) and T > MAX_ROWS and D % 64 == 0 and D <= MAX_HEAD_DIM and H % KVH == 0
            and k.shape == v.shape == (B, KVH, T, D) and k.dtype == v.dtype == q.dtype
            and k.stride(-1) == v.stride(-1) == 1):
        return whole()

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
                            (1 if alone else B, H, KVH, D)), kernel, whole)


def silu_mul(choices: Choices, gate: torch.Tensor, up: torch.Tensor,
             torch_silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up in one pass; torch_silu_mul(gate, up) where the kernel does not run it or is the slower."""
    plain = lambda: each_prompt(choices, torch_silu_mul, gate, up)  # noqa: E731
    if not (prompt_rows(choices, gate, up) and gate.shape == up.shape and gate.shape[-1] % 16 == 0):
        return plain()

    def kernel():
        out = torch.empty_like(gate)
        compiled().silu_mul(gate=gate.data_ptr(), up=up.data_ptr(), out=out.data_ptr(), type=TYPES[gate.dtype],
                            n=gate.numel())
        return out

    return choices.pick(Key("silu_mul", DTYPES[gate.dtype], None, choices.bucket(gate.numel() // gate.shape[-1]),
                            torch.get_num_threads(), (gate.shape[-1],)), kernel, plain)


def rope(choices: Choices, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         torch_rope: Callable[..., torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in one pass, x (B, T, heads, D), cos and sin (B, T, 1, D); torch_rope(x, cos,
    sin) where the kernel does not run it or is the slower."""
    B, T, heads, D = x.shape
    plain = lambda: each_prompt(choices, torch_rope, x, cos, sin)  # noqa: E731
    if not (prompt_rows(choices, x, cos, sin) and cos.shape == sin.shape == (B, T, 1, D) and D % 32 == 0):
        return plain()

    def kernel():
        out = torch.empty_like(x)
        compiled().rope_rows(x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), out=out.data_ptr(),
                             type=TYPES[x.dtype], R=B * T, heads=heads, D=D)
        return out

    return choices.pick(Key("rope", DTYPES[x.dtype], None, choices.bucket(B * T), torch.get_num_threads(), (heads, D)),
                        kernel, plain)


def rms_norm(choices: Choices, x: torch.Tensor, weight: torch.Tensor, eps: float,
             torch_norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension in one pass; torch_norm(x) where the kernel does not run it or
    is the slower."""
    C = x.shape[-1]
    plain = lambda: each_prompt(choices, torch_norm, x)  # noqa: E731
    # A decoding step's few rows too (its final norm; blocks() runs the others): one call where torch's is ~8
    # operations, each slow after the step's weights have streamed through the caches.
    if not (usable(choices, x) and x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
            and C % 16 == 0 and weight.shape == (C,)):
        return plain()

    def kernel():
        out = torch.empty_like(x)
        compiled().norm_rows(x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), type=TYPES[x.dtype],
                             R=x.numel() // C, C=C, eps=eps)
        return out

    return choices.pick(Key("rms_norm", DTYPES[x.dtype], None, choices.bucket(x.numel() // C), torch.get_num_threads(),
                            (C,)), kernel, plain)
