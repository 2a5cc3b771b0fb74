"""The CPU kernels against torch's formulas, and each model accelerated against the same model's reference
modules (model.py alone): logits, caches and tokens."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, clear_leads, tiny_model
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_files import gguf_name, gguf_tensors, write_gguf

from smollm2 import SmolError, SmolLM2, Tokenizer, kernels, load
from smollm2.checkpoints.gguf import SCALES
from smollm2.generation import generate
from smollm2.generation.steps import decode_step
from smollm2.kernels import accelerate, build, ops
from smollm2.kernels.accelerate import DecodePlan, packed_of
from smollm2.kernels.build import choices_file
from smollm2.kernels.choosing import (BUDGET_S, BUSY, MAX_TURNS, MEASUREMENTS, MIN_TURNS, Choice, Choices, Key,
                                      rows_bucket)
from smollm2.kernels.held import HeldWeight
from smollm2.kernels.packed import ACROSS, PACKED_TYPES, STRIPES, HugePages, packed_layout, unpacked
from smollm2.model import MLP
from smollm2.quantize import quantize_int8

pytestmark = pytest.mark.skipif(kernels.compiled() is None, reason="no C compiler")

ON = Choices("on", choices_file)  # the kernel wherever it can run: what the functions of ops.py are tested with


@pytest.fixture(autouse=True)
def inference():
    torch.manual_seed(0)
    with torch.inference_mode():  # the kernels serve inference only: with gradients, torch does the work
        yield


def on_torch(*rows):
    """plain() for a kernel's function (the elementwise ones pass it their rows): says that it ran."""
    return "torch"


def weights(dtype, N=96, K=64):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    if dtype == torch.int8:
        return torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N) + 0.5
    return w.to(dtype), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("K", [64, 80])  # 80: bf16 pairs end in a half step
def test_linear_matches_torch(dtype, rows, K):
    w, scale = weights(dtype, K=K)
    x = torch.randn(rows, K).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    got = ops.linear(ON, x, [w], [scale])[0]
    want = F.linear(x.float(), w.float()) * (1 if scale is None else scale)
    assert got.dtype == x.dtype and got.shape == (rows, 96)
    if dtype == torch.bfloat16:  # one rounding of the float32 sum
        torch.testing.assert_close(got, want.to(torch.bfloat16), atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("K", [64, 80])
def test_a_rows_result_does_not_depend_on_its_batch(dtype, K):
    w, scale = weights(dtype, K=K)
    x = torch.randn(16, K).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    batched = ops.linear(ON, x, [w], [scale])[0]
    for b in (0, 5, 15):
        assert torch.equal(ops.linear(ON, x[b:b + 1], [w], [scale])[0][0], batched[b])


@pytest.mark.parametrize("weight_type", [torch.float32, torch.int8])
@pytest.mark.parametrize("rows", [17, 64, 130])  # 130: two blocks of 64 rows, and 2 more
def test_a_float32_prompts_products_are_its_rows_decoded_alone(weight_type, rows):
    w, scale = weights(weight_type)
    x = torch.randn(rows, 64)
    got = ops.linear(ON, x, [w], [scale])[0]
    want = F.linear(x, w.float()) * (1 if scale is None else scale)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)
    for b in {0, min(64, rows - 1), rows - 1}:
        assert torch.equal(ops.linear(ON, x[b:b + 1], [w], [scale])[0][0], got[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_several_weights_in_one_pass(dtype):
    (wq, sq), (wk, sk) = weights(dtype), weights(dtype, N=32)
    x = torch.randn(3, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    q, k = ops.linear(ON, x, [wq, wk], [sq, sk])
    assert torch.equal(q, ops.linear(ON, x, [wq], [sq])[0]) and torch.equal(k, ops.linear(ON, x, [wk], [sk])[0])


@pytest.mark.parametrize("dtype, K", [(torch.bfloat16, 64), (torch.float32, ops.MAX_PROMPT_K + 16)])
def test_prompts_products_the_kernel_leaves_to_torch(dtype, K):
    w, _ = weights(dtype, K=K)
    x = torch.randn(ops.MAX_ROWS + 1, K, dtype=dtype)
    assert torch.equal(ops.linear(ON, x, [w])[0], F.linear(x, w))


def tiny(name: str, dtype: str):
    """A tiny reference model in `dtype` (int8: its blocks' linear layers)."""
    model = tiny_model(TINY[name])
    return quantize_int8(model) if dtype == "int8" else model.to(getattr(torch, dtype))


def accelerated(model: SmolLM2) -> SmolLM2:
    return accelerate(copy.deepcopy(model))


def decode(model, ids, attention_mask, T, kv_dtype=None):
    """The logits of the last T tokens, decoded in one step after the others went in as a prompt, and the
    keys and values in the cache (of kv_dtype) then, as attention reads them."""
    B, S = ids.shape
    P = S - T
    cache = model.new_cache(B, 64, kv_dtype)
    model(ids[:, :P], torch.arange(P), cache.view(length=P), attention_mask[:, :P])
    logits = model(ids[:, P:], torch.arange(P, S), cache.view(length=S), attention_mask)
    if cache.k_scale is not None:
        return logits, [(t.float() * scale)[..., :S, :] for t, scale in ((cache.k, cache.k_scale),
                                                                         (cache.v, cache.v_scale))]
    return logits, [t[..., :S, :] for t in (cache.k, cache.v)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["gqa", "mqa", "mha"])
@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8"])
def test_decoding_blocks_match_torch(name, dtype, T, padded, kv_dtype):
    """A decoding step of the whole model, each block one kernel call, against the reference model's: logits,
    and the keys and values it wrote into the cache (after RoPE), in the model's dtype or another."""
    reference = tiny(name, dtype)
    model = accelerated(reference)
    activations = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert DecodePlan(model, activations).weights is not None  # the kernel does take these blocks
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    attention_mask = torch.ones_like(ids)
    if padded:
        attention_mask[1, :10] = 0  # row 1 left-padded
    (fast, fast_cache), (slow, slow_cache) = (decode(m, ids, attention_mask, T, kv_dtype) for m in (model, reference))
    # bf16: the products' float32 sums are added in another order, so a rounding may land one ulp away (and a
    # bf16 cache's values with them).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype != "bfloat16" and kv_dtype != "bf16" else dict(atol=2 ** -6,
                                                                                              rtol=2 ** -7)
    torch.testing.assert_close(fast.float(), slow.float(), **tol)
    for got, want in zip(fast_cache, slow_cache):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, KVH, D", [(1, 512, 9, 3, 64), (2, 37, 9, 3, 64), (1, 100, 4, 4, 128),
                                             (3, 17, 8, 1, 64)])
def test_prompt_attention_matches_torch(dtype, B, T, H, KVH, D):
    """Causal attention of a prompt's rows against torch's, keys and values read in place from a longer cache."""
    q = torch.randn(B, T, H, D, dtype=dtype)
    k, v = (torch.randn(B, KVH, T + 5, D, dtype=dtype)[:, :, :T] for _ in range(2))
    got = ops.prompt_attention(ON, q, k, v, on_torch)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2 ** -7, rtol=2 ** -7)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_elementwise_steps_match_torch(dtype):
    gate, up = torch.randn(2, 40, 96, dtype=dtype), torch.randn(2, 40, 96, dtype=dtype)
    x, angles = torch.randn(2, 40, 3, 64, dtype=dtype), torch.rand(2, 40, 1, 64) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2 ** -7, rtol=2 ** -7)
    torch.testing.assert_close(ops.silu_mul(ON, gate, up, on_torch), F.silu(gate) * up, **tol)
    torch.testing.assert_close(ops.rope(ON, x, cos, sin, on_torch), x * cos + torch.cat([-x2, x1], dim=-1) * sin,
                               **tol)
    weight = torch.randn(96, dtype=dtype)
    h = gate.float() * torch.rsqrt(gate.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ops.rms_norm(ON, gate, weight, 1e-5, on_torch), weight * h.to(dtype), **tol)
    assert ops.silu_mul(ON, gate[:, :8], up[:, :8], on_torch) == "torch"  # a decoding step's few rows: blocks' work
    assert ops.rope(ON, x[..., :16], cos[..., :16], sin[..., :16], on_torch) == "torch"  # head size off 32


def test_prompt_attention_leaves_what_it_cannot_run_to_torch():
    q, k = torch.randn(1, 40, 4, 64), torch.randn(1, 2, 40, 64)
    assert ops.prompt_attention(ON, q[:, :16], k[:, :, :16], k[:, :, :16], on_torch) == "torch"  # a few rows
    assert ops.prompt_attention(ON, q[..., :32], k[..., :32], k[..., :32], on_torch) == "torch"  # head size off 64
    with torch.inference_mode(False):  # training
        assert ops.prompt_attention(ON, torch.randn(1, 40, 4, 64, requires_grad=True), k.clone(), k.clone(),
                                        on_torch) == "torch"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8"])
def test_a_rows_block_does_not_depend_on_its_batch(dtype, kv_dtype):
    model = accelerated(tiny("gqa", dtype))
    ids = torch.randint(0, model.config.vocab_size, (3, 20))
    batched, _ = decode(model, ids, torch.ones_like(ids), 1, kv_dtype)
    alone, _ = decode(model, ids[1:2], torch.ones_like(ids[1:2]), 1, kv_dtype)
    assert torch.equal(alone[0], batched[1])


@pytest.mark.parametrize("name", ["bias", "head_dim"])
def test_blocks_the_kernel_cannot_run_stay_on_torch(name):
    model = accelerated(tiny(name, "float32"))
    assert model.decode_plan(torch.float32).weights is None
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    torch.testing.assert_close(decode(model, ids, torch.ones_like(ids), 1)[0],
                               decode(tiny(name, "float32"), ids, torch.ones_like(ids), 1)[0], atol=1e-5, rtol=0)


def test_slots_outside_the_cache_raise_instead_of_writing_past_it():
    model = accelerated(tiny("gqa", "float32"))
    cache = model.new_cache(1, 16)
    with pytest.raises((IndexError, RuntimeError)):
        model(torch.tensor([[5]]), torch.tensor([16]), cache)


def gguf_model(path, qtype, dtype=torch.float32, packed=True):
    """A tiny random model written as a GGUF file of qtype blocks (norms in F32), read back and accelerated:
    streaming the file's packed blocks, or (packed=False) the float32 weights they decode to."""
    source = tiny_model(TINY["gqa"])
    write_gguf(path, source.config, gguf_tensors(source, qtype))
    return load(path, dtype=dtype) if packed else accelerate(
        load(path, dtype=dtype, kernels=False))


def linears(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
WIDE = dataclasses.replace(TINY["gqa"], hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=1024)


def crafted_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random bytes are valid blocks of qtype (every integer and sub-block scale a valid one); their float16
    scales set to finite values of either sign, so that every weight is. uint8 (rows, bytes a row)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in SCALES[qtype]:
        scale = (rng.uniform(2e-4, 2e-3, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_packed_blocks_stream_gguf_dequantized_weights(qtype):
    """The weights the kernel multiplies are gguf.quants.dequantize's float32 values, bit for bit: a product
    with the identity gives them back (a sum of one weight and zeros; -0 comes back +0)."""
    N, K = 32, 512
    blocks = crafted_blocks(N, K, qtype, np.random.default_rng(int(qtype)))
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(N, K))
    weight = torch.zeros(N, K)  # only its shape and dtype matter: the packed blocks are streamed
    file_blocks = torch.from_numpy(blocks)
    packed = packed_layout(qtype, file_blocks)
    if qtype in K_QUANTS:  # streamed as the file holds them: no copy
        assert packed.data.data_ptr() == file_blocks.data_ptr() and packed.data.shape == file_blocks.shape
    got, = ops.linear(ON, torch.eye(K), [weight], packed=[packed])
    assert torch.equal(got.T, want)
    nonzero = want != 0
    assert torch.equal(got.T[nonzero].view(torch.int32), want[nonzero].view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_a_matrix_takes_its_bytes_once_in_a_models_huge_pages(qtype):
    """packed_layout asked to lay blocks out again (Q4_0, the K-quants, Q8_0) where this CPU's kernels may not
    (SSE2, NEON: no int8 tile of their own) takes their bytes once in the model's huge pages: laid out, or copied.
    It took room for the layout first, then copied, and a 360M Q4_0 model held its matrices twice at AVX2."""
    blocks = torch.from_numpy(crafted_blocks(16, 512, qtype, np.random.default_rng(int(qtype))))
    pages, taken = HugePages(), []
    empty = pages.empty
    pages.empty = lambda shape: taken.append(int(np.prod(shape))) or empty(shape)
    laid_out = packed_layout(qtype, blocks, repack=True, pages=pages)
    assert taken == [blocks.numel()]
    assert torch.equal(unpacked(laid_out), torch.from_numpy(dequantize(blocks.numpy(), qtype).reshape(16, 512)))


def crafted_gguf_model(path: Path, qtype: Q, packed: bool = True, v_down: Q | None = None,
                       kinds: dict[str, Q] | None = None) -> SmolLM2:
    """A tiny random model (WIDE: its matrices' rows are whole super-blocks) written as GGUF with every matrix
    crafted blocks of qtype (v_proj and down_proj of v_down where given, as Q4_K_M files mix Q6_K ones in; or of
    kinds[part] where part is in its name) and norms in F32, read back and accelerated, as gguf_model."""
    source, rng = tiny_model(WIDE), np.random.default_rng(0)
    kinds = kinds or ({"v_proj": v_down, "down_proj": v_down} if v_down else {})
    tensors = {}
    for name, t in source.state_dict().items():
        kind = next((k for part, k in kinds.items() if part in name), qtype)
        if t.dim() == 1:
            tensors[gguf_name(name)] = (t.numpy(), None)
        else:
            tensors[gguf_name(name)] = (crafted_blocks(*t.shape, kind, rng), kind)
    write_gguf(path, WIDE, tensors)
    return load(path) if packed else accelerate(load(path, kernels=False))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_0, *K_QUANTS, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_gguf_packed_blocks_give_the_float32_weights_results(tmp_path, qtype):
    """A float32 model read from GGUF's packed blocks streams them: its logits and cache are those of its
    float32 weights, to the last bit; the decoding step reads the blocks."""
    read = crafted_gguf_model if qtype in K_QUANTS + [Q.Q5_0, Q.Q5_1] else gguf_model
    model = read(tmp_path / "tiny.gguf", qtype)
    assert all(packed_of(m) is not None for m in [*linears(model), model.model.embed_tokens])
    assert kernels.weight_format(model) == f"{qtype.name} packed"
    assert "packed" not in str(model.state_dict().keys())  # non-persistent: never saved
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    runs = model.accelerator.kernel_runs["blocks"]
    packed, packed_cache = decode(model, ids, torch.ones_like(ids), 3)
    assert model.accelerator.kernel_runs["blocks"] > runs
    weights, weights_cache = decode(read(tmp_path / "tiny.gguf", qtype, packed=False), ids, torch.ones_like(ids), 3)
    assert torch.equal(packed, weights)
    assert all(torch.equal(a, b) for a, b in zip(packed_cache, weights_cache))


def test_a_layer_of_mixed_block_types_streams_each(tmp_path):
    """As a Q4_K_M file: Q4_K matrices, v_proj and down_proj Q6_K. The decoding step reads each matrix's blocks
    and gives its float32 weights' logits to the last bit."""
    model = crafted_gguf_model(tmp_path / "tiny.gguf", Q.Q4_K, v_down=Q.Q6_K)
    assert kernels.weight_format(model) == "Q4_K packed+Q6_K packed"
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    runs = model.accelerator.kernel_runs["blocks"]
    packed, _ = decode(model, ids, torch.ones_like(ids), 3)
    assert model.accelerator.kernel_runs["blocks"] > runs
    weights, _ = decode(crafted_gguf_model(tmp_path / "tiny.gguf", Q.Q4_K, packed=False, v_down=Q.Q6_K), ids,
                        torch.ones_like(ids), 3)
    assert torch.equal(packed, weights)


# What llama-quantize writes for a matrix whose rows are not whole super-blocks of 256 (src/llama-quant.cpp,
# tensor_type_fallback): SmolLM2-135M's and -360M's q, k, v, o, gate and up (576 and 960 inputs), whose down_proj
# (1536 and 2560) keeps its K-quant.
FALLBACKS = {"Q4_K_M": ({"v_proj": Q.Q8_0, "down_proj": Q.Q6_K}, Q.Q5_0),
             "Q5_K_M": ({"v_proj": Q.Q8_0, "down_proj": Q.Q5_K}, Q.Q5_1)}


@pytest.mark.parametrize("file_type", FALLBACKS)
def test_k_quant_files_of_widths_off_super_blocks_stream_each_fallback(tmp_path, file_type):
    """As a Q4_K_M (Q5_K_M) file of the 135M or 360M: Q5_0 (Q5_1) matrices, v_proj Q8_0 (use_more_bits' Q6_K
    fallen back), down_proj a K-quant. Every matrix streams its own blocks, to its float32 weights' bits."""
    kinds, qtype = FALLBACKS[file_type]
    model = crafted_gguf_model(tmp_path / "tiny.gguf", qtype, kinds=kinds)
    assert kernels.weight_format(model) == f"{qtype.name} packed+Q8_0 packed+{kinds['down_proj'].name} packed"
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    packed, _ = decode(model, ids, torch.ones_like(ids), 3)
    weights, _ = decode(crafted_gguf_model(tmp_path / "tiny.gguf", qtype, packed=False, kinds=kinds), ids,
                        torch.ones_like(ids), 3)
    assert torch.equal(packed, weights)


def test_a_weight_changed_in_place_is_streamed_itself(tmp_path):
    """A weight held as blocks cannot change in place; dequantized, it can, and the kernels stream it."""
    model = gguf_model(tmp_path / "tiny.gguf", Q.Q4_1)
    ids = torch.randint(0, model.config.vocab_size, (1, 21))
    decode(model, ids, torch.ones_like(ids), 1)  # the plan built with the packed blocks
    up = model.model.layers[1].mlp.up_proj
    with torch.inference_mode(False), torch.no_grad(), pytest.raises(SmolError, match="dequantize"):
        up.weight.mul_(0.5)
    kernels.dequantize(model)
    with torch.inference_mode(False), torch.no_grad():
        up.weight.mul_(0.5)
    changed, _ = decode(model, ids, torch.ones_like(ids), 1)
    assert packed_of(up) is None
    plain = gguf_model(tmp_path / "tiny.gguf", Q.Q4_1, packed=False)
    with torch.inference_mode(False), torch.no_grad():
        plain.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    assert torch.equal(changed, decode(plain, ids, torch.ones_like(ids), 1)[0])


def double_down_proj(model):
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(model.model.layers[0].mlp.down_proj.weight * 2)


def swap_blocks(model):
    model.model.layers[0], model.model.layers[1] = model.model.layers[1], model.model.layers[0]


def new_mlp(model):
    mlp = MLP(model.config)  # a reference module, into an accelerated model too
    mlp.load_state_dict(model.model.layers[1].mlp.state_dict())
    model.model.layers[0].mlp = mlp


@pytest.mark.parametrize("change", [double_down_proj, swap_blocks, new_mlp])
def test_anything_assigned_rebuilds_the_plan(change):
    """A weight, a block or a block's module replaced: the plan, which points at the old weights, is rebuilt."""
    reference = tiny("gqa", "float32")
    model = accelerated(reference)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    decode(model, ids, torch.ones_like(ids), 1)
    plan = model.decode_plan(torch.float32)
    for m in (model, reference):
        with torch.inference_mode(False):
            change(m)
    got, want = decode(model, ids, torch.ones_like(ids), 1)[0], decode(reference, ids, torch.ones_like(ids), 1)[0]
    assert model.decode_plan(torch.float32) is not plan
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_plan_holds_while_nothing_changed():
    model = accelerated(tiny("gqa", "float32"))
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    decode(model, ids, torch.ones_like(ids), 1)
    plan = model.decode_plan(torch.float32)
    model.eval()
    decode(model, ids, torch.ones_like(ids), 1)
    assert model.decode_plan(torch.float32) is plan
    assert model.accelerator.kernel_runs["blocks"] == 4  # each decode(): the 8-token prompt too is a step's size


def test_copies_and_conversions_build_their_own_plans():
    """A deep copy's weights are elsewhere, and .to() moves them: neither may run on the original's plan. A copy
    has an accelerator of its own."""
    model = accelerated(tiny("gqa", "float32"))
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    want, _ = decode(model, ids, torch.ones_like(ids), 1)
    assert model.accelerator.plans
    copied = copy.deepcopy(model)
    assert type(copied) is type(model) and copied.accelerator is not model.accelerator
    assert not copied.accelerator.plans and copied.model.layers[0].mlp.accelerator is copied.accelerator
    del model
    assert torch.equal(decode(copied, ids, torch.ones_like(ids), 1)[0], want)
    bf16 = copied.to(torch.bfloat16)
    assert not bf16.accelerator.plans
    assert decode(bf16, ids, torch.ones_like(ids), 1)[0].dtype == torch.bfloat16


def test_accelerating_keeps_the_models_parameters_and_names():
    reference = tiny("bias", "float32")
    model = accelerated(reference)
    assert isinstance(model, SmolLM2) and type(model) is not SmolLM2
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    accelerator = model.accelerator
    assert accelerate(model) is model  # twice is once
    assert [type(m) for m in accelerate(model).modules()] == [type(m) for m in model.modules()]
    assert model.accelerator is accelerator and accelerate(model, mode="off").accelerator.mode == "off"
    with pytest.raises(SmolError, match="kernels mode 'fast' is none of auto, on, off"):
        accelerate(model, mode="fast")


def test_the_embedded_model_streams_its_files_packed_blocks(model):
    """fp32 decoding of the default model reads its file's Q4_1 block weights and Q8_0 embeddings."""
    assert kernels.weight_format(model) == "Q4_1 packed"
    assert packed_of(model.model.embed_tokens).type == PACKED_TYPES[Q.Q8_0]


def test_bf16_models_keep_no_packed_blocks(tmp_path):
    """Their weights are rounded to bf16: the packed blocks no longer hold their values."""
    model = gguf_model(tmp_path / "tiny.gguf", Q.Q4_1, torch.bfloat16)
    assert not any(packed_of(m) for m in [*linears(model), model.model.embed_tokens])


# Not an int8 cache: its rounding turns the kernel's other float sums into whole steps of a value now and then
# (tokens equal here on AVX-512, not on the AVX2 tier); test_decoding_blocks_match_torch compares it within 1e-5.
@pytest.mark.parametrize("kind", ["fp32", "int8", "batched", "bf16 cache"])
def test_decoding_gives_the_reference_tokens(model, reference_model, kind):
    fast, plain = model, reference_model
    if kind == "int8":
        plain = quantize_int8(copy.deepcopy(reference_model))
        fast = accelerated(plain)
    prompts = [[1, 504, 3458, 282]] if kind in ("fp32", "int8") else [[1, 504, 3458, 282, 4649, 314], [1, 28, 17, 30]]
    if not kind.endswith("cache"):
        assert torch.equal(generate(fast, prompts, 24, eos_token_id=None),
                           generate(plain, prompts, 24, eos_token_id=None))
        return
    # torch's results move with the batch by float rounding, which a cache's rounding can turn into a whole step
    # of its values: the reference runs each row alone, and the kernels give a row its bits in any batch.
    kv_cache_dtype = kind.removesuffix(" cache")
    batched = generate(fast, prompts, 24, eos_token_id=None, kv_cache_dtype=kv_cache_dtype)[:, -24:]
    for prompt, got in zip(prompts, batched):
        alone = generate(plain, [prompt], 24, eos_token_id=None, kv_cache_dtype=kv_cache_dtype)[0, -24:]
        assert torch.equal(got, alone)


def teacher_forced_logits(model, tokens, prompt=8):
    """The logits of every decoding step along a given text, (len(tokens) - prompt, V) in float32."""
    cache = model.new_cache(1, len(tokens))
    h = model.hidden_states(torch.tensor([tokens[:prompt]]), torch.arange(prompt), cache.view(length=prompt))
    out = [model.logits(h[:, -1])]
    for p in range(prompt, len(tokens) - 1):
        out.append(decode_step(model, torch.tensor([[tokens[p]]]), torch.tensor([p]), cache.view(length=p + 1), None))
    return torch.cat(out).float()


def test_bf16_decoding_is_as_exact_as_the_reference(reference_model, english):
    """bf16 rounds differently on the kernels (float32 sums, one rounding per output) than on torch, whose own
    bf16 rounds differently again with and without bf16 arithmetic, so near-ties of fp32's top token fall either
    way (on a Zen 4, 5 of 112 flipped where torch's held; on a Sapphire Rapids torch's flipped more). Measured
    against fp32 along a real text: every clear lead is kept, and the logits are as exact as torch's bf16."""
    tokens = Tokenizer.from_pretrained().encode(english)[:176]
    # fp32 in one forward: within 1e-4 of decoding step by step, a thousandth of bf16's error
    reference = reference_model(torch.tensor([tokens]))[0, 7:-1]
    bf16 = copy.deepcopy(reference_model).to(torch.bfloat16)
    fast_model = accelerated(bf16)
    fast = teacher_forced_logits(fast_model, tokens)
    assert fast_model.accelerator.kernel_runs["blocks"] == len(tokens) - 8  # every decoding step on the kernels
    slow = teacher_forced_logits(bf16, tokens)
    clear = clear_leads(reference, reference_model.config.num_hidden_layers)
    assert clear.sum() >= 30  # of 168 positions (42 for this text)
    assert torch.equal(fast.argmax(-1)[clear], reference.argmax(-1)[clear])
    # Where the roundings fall moves the mean error by ~10-15% (over 240 positions torch's bf16 was 0.095 on its
    # AVX2 code, 0.111 with AMX; the kernels' 0.097 to 0.105 by tier); a lost rounding or a wrong sum shows as a
    # multiple.
    ours, torchs = (fast - reference).abs().mean(), (slow - reference).abs().mean()
    print(f"mean |bf16 - fp32|: kernels {ours:.4f}, torch {torchs:.4f}; clear leads {clear.sum()} of {len(clear)}")
    assert ours <= 1.25 * torchs


def test_without_a_compiler_torch_does_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels.compiled.cache_clear()
    try:
        with pytest.warns(UserWarning, match="kernels unavailable"):
            assert kernels.compiled() is None
        x, (w, _) = torch.randn(1, 64), weights(torch.float32)
        assert torch.equal(ops.linear(ON, x, [w])[0], F.linear(x, w))
        model = tiny("gqa", "float32")
        assert type(accelerate(model)) is SmolLM2  # left as it is
    finally:
        kernels.compiled.cache_clear()


# The choice between kernel and torch: in "auto" mode the faster runs, measured on the first call of each kind.
# Timed on a clock of the test's own: each side's run moves it by the seconds the test gives.

KEY = Key("rms_norm", "float32", None, 64, 2, (96,))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def measuring(tmp_path, clock=None, load=(0.0,)) -> Choices:
    """Choices kept in tmp_path, timed by a test clock, on a machine as busy as `load` says (machine_load's
    figures: one per call, the last repeated; quiet, 0)."""
    loads = itertools.chain(load, itertools.repeat(load[-1]))
    return Choices("auto", lambda: tmp_path / "choices.json", clock or Clock(), lambda: next(loads))


def timed(winner: str, kernel_s: float, torch_s: float, margin: float, measurements: int) -> Choice:
    """A Choice to compare with a measured one: the test clock's sums round its times a little."""
    return Choice(winner, pytest.approx(kernel_s), pytest.approx(torch_s), pytest.approx(margin), measurements)


def side(name: str, calls: list, choices: Choices | None = None, seconds=0.0):
    """A kernel() or plain() that notes each call in `calls`, returns its name and takes `seconds` on the clock of
    `choices` (one figure every run, or one per run: the first is the warm-up's)."""
    durations = iter(seconds) if isinstance(seconds, list) else itertools.repeat(seconds)

    def run():
        calls.append(name)
        if choices is not None:
            choices.clock.now += next(durations)
        return name
    return run


def test_the_faster_side_is_picked_and_runs_last(tmp_path):
    choices, calls = measuring(tmp_path), []
    assert choices.pick(KEY, side("kernel", calls, choices, 0.002), side("torch", calls, choices, 0.001)) == "torch"
    assert calls[-1] == "torch"  # what it writes (a KV cache) is what stays
    assert choices.made[KEY] == timed("torch", 0.002, 0.001, 2.0, 1)
    # a clear winner whose times repeat: settled at the fewest turns
    assert (calls.count("kernel"), calls.count("torch")) == (1 + MIN_TURNS, 1 + MIN_TURNS + 1)  # warm-up, winner
    prompt = KEY._replace(rows=128)
    assert choices.pick(prompt, side("kernel", calls, choices), side("torch", calls, choices, 0.002)) == "kernel"
    assert calls[-1] == "kernel" and choices.made[prompt].winner == "kernel"
    assert choices.kernel_runs == {"rms_norm": 1}


def test_a_noisy_side_is_timed_until_its_best_repeats(tmp_path):
    """The kernel's first runs fall on a busy stretch of the machine: the best of 3 turns would crown torch."""
    choices, calls = measuring(tmp_path), []
    kernel = side("kernel", calls, choices, [0.003, 0.003, 0.0025, 0.0028, 0.001, 0.00102] + [0.001] * 10)
    assert choices.pick(KEY, kernel, side("torch", calls, choices, 0.0015)) == "kernel"
    assert calls.count("kernel") == 1 + 5  # the warm-up, then turns until its best (1 ms) came twice
    assert choices.made[KEY] == timed("kernel", 0.001, 0.0015, 1.5, 1)


def test_a_close_call_is_timed_longer_and_its_margin_kept(tmp_path):
    choices, calls = measuring(tmp_path), []
    assert choices.pick(KEY, side("kernel", calls, choices, 0.001), side("torch", calls, choices, 0.00105)) == "kernel"
    assert calls.count("torch") == 1 + MAX_TURNS
    choice = choices.made[KEY]
    assert choice.margin == pytest.approx(1.05) and choice.measurements == 1
    assert "kernel by 1.05x (kernel 1 ms vs torch 1.05 ms)" in choices.report()[0]["text"]


def test_measuring_is_bounded_in_time(tmp_path):
    """A big model's slow step whose times never repeat: the fewest turns once past the budget."""
    choices, calls = measuring(tmp_path), []
    slow = [BUDGET_S / 2, BUDGET_S / 3] * MAX_TURNS
    choices.pick(KEY, side("kernel", calls, choices, slow), side("torch", calls, choices, slow[1:]))
    assert calls.count("kernel") == 1 + MIN_TURNS


def test_a_thin_choice_is_measured_again_by_later_accelerators(tmp_path):
    """Measured while the machine was busy, torch won by a hair; later accelerators measure again, each once, and
    the best times of all their measurements decide: the kernel, which was the faster all along."""
    first, calls = measuring(tmp_path), []
    first.pick(KEY, side("kernel", calls, first, 0.00104), side("torch", calls, first, 0.001))
    assert first.made[KEY].winner == "torch" and first.made[KEY].margin < 1.1
    assert first.pick(KEY, side("kernel", calls, first), side("torch", calls, first)) == "torch"  # once here
    second = measuring(tmp_path)
    assert second.pick(KEY, side("kernel", calls, second, 0.0008), side("torch", calls, second, 0.001)) == "kernel"
    assert second.made[KEY] == timed("kernel", 0.0008, 0.001, 1.25, 2)
    calls.clear()  # a clear margin now: not measured again
    assert measuring(tmp_path).pick(KEY, side("kernel", calls), side("torch", calls)) == "kernel"
    assert calls == ["kernel"]


def test_a_choice_measured_on_a_busy_machine_is_measured_again(tmp_path):
    """Measured while other work took the kernel's threads off their cores, torch won by 10x; a later accelerator
    on a quiet machine measures again, and the best times of both measurements decide: the kernel's. A clear
    choice measured quiet is kept."""
    assert BUSY == 1.5  # the README's figure: a load average over 1.5 a core
    first, calls = measuring(tmp_path, load=(1.4, 1.6)), []  # busy by the end of the measurement
    assert first.pick(KEY, side("kernel", calls, first, 0.016), side("torch", calls, first, 0.0016)) == "torch"
    assert first.made[KEY] == timed("torch", 0.016, 0.0016, 10.0, 1)._replace(busy=True)
    second = measuring(tmp_path)
    assert second.pick(KEY, side("kernel", calls, second, 0.0008), side("torch", calls, second, 0.0016)) == "kernel"
    assert second.made[KEY] == timed("kernel", 0.0008, 0.0016, 2.0, 2)
    calls.clear()
    assert measuring(tmp_path).pick(KEY, side("kernel", calls), side("torch", calls)) == "kernel"
    assert calls == ["kernel"]


def test_measuring_a_busy_machine_again_stops(tmp_path):
    """A machine that stays busy: a choice is measured MEASUREMENTS times in all, then kept."""
    for n in range(1, MEASUREMENTS + 2):
        choices, calls = measuring(tmp_path, load=(1.6, 1.4)), []  # busy as it began
        choices.pick(KEY, side("kernel", calls, choices, 0.001), side("torch", calls, choices, 0.002))
        assert choices.made[KEY].measurements == min(n, MEASUREMENTS)
        assert calls.count("torch") == (1 + MIN_TURNS if n <= MEASUREMENTS else 0)


def test_a_clear_choice_measured_at_a_load_of_1_5_a_core_is_kept(tmp_path):
    first = measuring(tmp_path, load=(1.5,))
    first.pick(KEY, side("kernel", [], first, 0.001), side("torch", [], first, 0.002))
    assert not first.made[KEY].busy
    calls = []
    assert measuring(tmp_path).pick(KEY, side("kernel", calls), side("torch", calls)) == "kernel"
    assert calls == ["kernel"]


def test_measuring_a_near_tie_again_stops(tmp_path):
    """A real near tie stays thin: it is measured MEASUREMENTS times in all, then kept."""
    for n in range(1, MEASUREMENTS + 2):
        choices, calls = measuring(tmp_path), []
        choices.pick(KEY, side("kernel", calls, choices, 0.001), side("torch", calls, choices, 0.00102))
        assert choices.made[KEY].measurements == min(n, MEASUREMENTS)
        assert calls.count("torch") == (1 + MAX_TURNS if n <= MEASUREMENTS else 0)


def test_a_file_without_margins_is_measured_again(tmp_path):
    """Choices kept before margins were: as thin, whatever their times said."""
    entry = dict(KEY._asdict(), winner="torch", kernel_s=0.002, torch_s=0.001)
    (tmp_path / "choices.json").write_text(json.dumps([entry]))
    choices, calls = measuring(tmp_path), []
    assert choices.pick(KEY, side("kernel", calls, choices, 0.0005), side("torch", calls, choices, 0.001)) == "kernel"
    assert choices.made[KEY] == timed("kernel", 0.0005, 0.001, 2.0, 2)
    assert measuring(tmp_path).read() == choices.made


def test_a_known_kind_is_not_measured_again(tmp_path):
    choices = measuring(tmp_path)
    choices.pick(KEY, side("kernel", [], choices), side("torch", [], choices, 0.002))
    calls = []
    assert [choices.pick(KEY, side("kernel", calls), side("torch", calls)) for _ in range(3)] == ["kernel"] * 3
    assert calls == ["kernel"] * 3
    later = measuring(tmp_path)  # another process: the file's choice
    assert later.pick(KEY, side("kernel", calls), side("torch", calls)) == "kernel"
    assert calls == ["kernel"] * 4 and later.made == choices.made


def test_choices_round_trip_through_their_file(tmp_path):
    ours, theirs = measuring(tmp_path), measuring(tmp_path)  # two processes, each measuring its own kinds
    product = Key("linear", "bfloat16", "Q4_1 packed", 32, 4, (576, 576, 192, 192))
    step = Key("prompt_attention", "float32", None, 512, 4, (1, 9, 3, 64))
    ours.pick(KEY, side("kernel", [], ours, 0.001), side("torch", [], ours, 0.002))
    ours.pick(product, side("kernel", [], ours, 0.0024), side("torch", [], ours, 0.002))
    theirs.pick(step, side("kernel", [], theirs, 0.001), side("torch", [], theirs, 0.002))
    assert measuring(tmp_path).read() == {**ours.made, **theirs.made}  # each kept the other's
    assert [choice["text"] for choice in ours.report()] == [
        "RMSNorm of 96, 33-64 rows, float32: kernel by 2.00x (kernel 1 ms vs torch 2 ms)",
        "product 576 -> 576+192+192, 17-32 rows, bfloat16 reading Q4_1 packed: torch by 1.20x (kernel 2.4 ms vs "
        "torch 2 ms)"]
    assert ours.report()[0]["margin"] == pytest.approx(2.0)


@pytest.mark.parametrize("text", ["{not json", "[1]", '{"op": "rms_norm"}', '[{"op": "rms_norm"}]',
                                  '[{"op": "rms_norm", "dtype": "float32", "weights": null, "rows": 64, "threads": 2, '
                                  '"sizes": [96], "winner": "neither", "kernel_s": 1, "torch_s": 2}]'])
def test_a_corrupt_file_is_measured_again(tmp_path, text):
    (tmp_path / "choices.json").write_text(text)
    choices, calls = measuring(tmp_path), []
    assert choices.pick(KEY, side("kernel", calls, choices), side("torch", calls, choices, 0.002)) == "kernel"
    assert calls.count("torch") == 1 + MIN_TURNS
    assert measuring(tmp_path).read() == choices.made  # and written anew


def test_a_file_that_cannot_be_written_does_not_stop_inference(tmp_path):
    (tmp_path / "a-file").write_text("")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for where in (lambda: tmp_path / "a-file" / "choices.json", no_home):
        choices = Choices("auto", where, Clock())
        assert choices.pick(KEY, side("kernel", [], choices), side("torch", [], choices, 0.002)) == "kernel"
        assert choices.made[KEY].winner == "kernel"  # for this accelerator still


def test_the_modes_do_what_they_say(tmp_path):
    for mode, ran in (("on", "kernel"), ("off", "torch")):
        choices, calls = Choices(mode, lambda: tmp_path / "choices.json", Clock()), []
        slow_kernel = choices.pick(KEY, side("kernel", calls, choices, 0.002), side("torch", calls, choices))
        slow_torch = choices.pick(KEY, side("kernel", calls, choices), side("torch", calls, choices, 0.002))
        assert slow_kernel == slow_torch == ran and calls == [ran, ran] and not choices.made
    for mode in ("auto", "on"):  # a kernel that cannot run: torch, and nothing decided
        choices = Choices(mode, lambda: tmp_path / "choices.json")
        assert choices.pick(KEY, lambda: None, on_torch) == "torch" and not choices.made
    assert not (tmp_path / "choices.json").exists()


def test_torch_only_holds_in_its_own_thread_alone():
    choices, seen = Choices("on", choices_file), []
    with choices.torch_only():
        assert choices.pick(KEY, side("kernel", []), on_torch) == "torch"
        other = threading.Thread(target=lambda: seen.append(choices.pick(KEY, side("kernel", []), on_torch)))
        other.start()
        other.join()
        assert Choices("on", choices_file).pick(KEY, side("kernel", []), on_torch) == "kernel"  # nor another's
    assert seen == ["kernel"] and choices.pick(KEY, side("kernel", []), on_torch) == "kernel"


def test_torch_only_leaves_every_kernel_unused():
    x, w, model = torch.randn(2, 40, 96), torch.randn(32, 96), accelerated(tiny("gqa", "float32"))
    cache = model.new_cache(1, 8)

    def decoding_step():
        return ops.blocks(ON, model.decode_plan(torch.float32).weights, torch.randn(1, 1, 64),
                          (torch.ones(1, 1, 1, 16),) * 2, None, cache.view(length=1), torch.tensor([0]), on_torch)

    with ON.torch_only():
        assert ops.rms_norm(ON, x, torch.ones(96), 1e-5, on_torch) == "torch"
        assert ops.silu_mul(ON, x, x, on_torch) == "torch"
        assert torch.equal(ops.linear(ON, x, [w])[0], F.linear(x, w))
        assert decoding_step() is None  # the model runs its own loop
    assert decoding_step().shape == (1, 1, 64)  # the kernel always, as tests run


def test_measured_choices_give_the_kernels_tokens(tmp_path):
    """A tiny model whose heads fit every kernel generates the same tokens when its operations are measured
    (on the first call of each kind), and whichever side won each."""
    model = accelerate(tiny_model(dataclasses.replace(TINY["gqa"], head_dim=64)))
    prompts = [list(range(5, 29)), list(range(40, 64))]  # 24 tokens each: a prompt's kernels run too
    want = generate(model, prompts, 8, eos_token_id=None)  # the kernels wherever they run
    choices = model.accelerator.choices = Choices("auto", lambda: tmp_path / "choices.json")
    assert torch.equal(generate(model, prompts, 8, eos_token_id=None), want)
    made = choices.made
    assert {key.op for key in made} == {"linear", "prompt_attention", "rms_norm", "rope", "silu_mul"}
    assert all(key.rows > ops.MAX_ROWS for key in made)  # a decoding step's kinds: the kernel's, never measured
    for winner in ("kernel", "torch"):
        choices.made = {key: choice._replace(winner=winner) for key, choice in made.items()}
        assert torch.equal(generate(model, prompts, 8, eos_token_id=None), want)


def test_every_decoding_batch_is_one_kind():
    """A row decodes to the same bits whatever its batch only if every batch size runs on the same side."""
    assert {rows_bucket(rows) for rows in range(1, ops.MAX_ROWS + 1)} == {ops.MAX_ROWS}
    assert [rows_bucket(rows) for rows in (17, 300, 512, 513)] == [32, 512, 512, 1024]


@pytest.mark.parametrize("winner", ["kernel", "torch"])
def test_whichever_side_auto_picks_a_rows_bits_do_not_depend_on_its_batch(winner, monkeypatch):
    """auto on a machine where `winner` measures the faster at everything: a decoding step's kinds run on the kernel
    all the same (only it gives a row the same bits whatever rows share its call), a prompt's on the winner, and a
    row's tokens and log-probabilities are the same bits alone and among others."""
    from smollm2.generation.engine import Engine
    from smollm2.generation.sampling import Sampling
    from smollm2.generation.sequence import Sequence

    def measure(self, key, kernel, plain, before=None):
        self.made[key] = Choice.timed(1.0, 2.0) if winner == "kernel" else Choice.timed(2.0, 1.0)
        if winner == "kernel" and (y := kernel()) is not None:
            self.kernel_runs[key.op] += 1
            return y
        return plain()

    monkeypatch.setattr(Choices, "measure", measure)
    monkeypatch.setattr(Choices, "recall", lambda self, key: None)  # nothing from this machine's file
    model = accelerate(copy.deepcopy(tiny("gqa", "float32")), mode="auto")
    prompts = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in (40, 23, 33)]

    def answers(rows: list[list[int]]) -> list[list[tuple]]:
        engine = Engine(model, len(rows), 64, prefill_budget=None)
        sequences = [Sequence(prompt, 6, Sampling(), eos=(), logprobs=2) for prompt in rows]
        steps = {engine.admit(sequence): [] for sequence in sequences}
        while not all(s.finish_reason for s in sequences):
            for row, step in engine.step():
                steps[row].append((step.token, step.logprob))
        return list(steps.values())

    batched = answers(prompts)
    assert [answers([prompt])[0] for prompt in prompts] == batched
    choices = model.accelerator.choices
    assert choices.made and all(key.rows > ops.MAX_ROWS and choice.winner == winner
                                for key, choice in choices.made.items())  # a prompt's kinds alone were decided
    assert choices.kernel_runs["blocks"] >= 3 * 5  # every decoding step on the kernel


# ---- Opt-in int8 activations (kernels.c's rows_times): not exact, so compared within stated tolerances ----

INT8 = Choices("on", choices_file)  # as ON, the decoding products' inputs quantized to 8 bits
INT8.int8_activations = True


def q8_0_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0 with a float32 scale, in numpy: rows (R, K) float32 in blocks of 32, each
    d = max |x| / 127 and q = x / d rounded to the nearest (ties to even): q (R, K / 32, 32), d (R, K / 32, 1)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    return np.rint(blocks * inverse), d


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_int8_activation_products_match_a_float64_reference(qtype, rows):
    """Each weight block's integer dot product with its activations' block, scaled in float32: within 1e-6 of the
    same products in float64 (gguf's dequantized weights times the activations quantized in numpy), relative to
    the sum of their magnitudes (measured: 3e-8 at every x86 tier). The exact products are 1e-3 away from it (what
    quantizing the activations changes): the integer path ran."""
    N, K = 32, 512
    rng = np.random.default_rng(int(qtype))
    blocks = crafted_blocks(N, K, qtype, rng)
    w = dequantize(blocks, qtype).reshape(N, K).astype(np.float64)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    q, d = q8_0_activations(x)
    quantized = (q * d).reshape(rows, K).astype(np.float64)
    want, magnitude = quantized @ w.T, np.abs(quantized) @ np.abs(w).T
    packed = packed_layout(qtype, torch.from_numpy(blocks))
    got, = ops.linear(INT8, torch.from_numpy(x), [torch.zeros(N, K)], packed=[packed])
    exact, = ops.linear(ON, torch.from_numpy(x), [torch.zeros(N, K)], packed=[packed])
    assert (np.abs(got.numpy() - want) / magnitude).max() < 1e-6
    assert (np.abs(exact.numpy() - want) / magnitude).max() > 1e-4


@pytest.mark.skipif(build.MARCH != "x86-64-v3", reason="the AVX2 build's choice (make test runs one)")
def test_avx2_multiplies_a_prompts_rows_in_integers_where_its_tiles_do():
    """With AVX2 (x86-64-v3), int8 mode multiplies a prompt's rows in integers for every block type: eights_block
    takes them all, as the README's int8 section says."""
    assert {qtype for qtype in SCALES if int8_prompts(qtype)} == set(SCALES)


def int8_prompts(qtype: Q) -> bool:
    """Whether int8 mode multiplies a prompt's rows of qtype's blocks in integers too (kernels.c's int8_prompts)."""
    return bool(kernels.compiled().int8_prompts(w_type=ops.WEIGHT_FORMATS.index(f"{qtype.name} packed")))


@pytest.mark.parametrize("qtype, K", [*((qtype, 512) for qtype in SCALES), *((qtype, 2560) for qtype in K_QUANTS),
                                      (Q.Q4_0, 32800), (Q.Q4_K, 33024)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_int8_activations_in_a_prompts_products(qtype, K):
    """A prompt's rows (64, and 80: past kernels.c's ROW_BLOCK) in int8 mode: where int8_prompts says so (every
    block type with AVX512-VNNI; with AVX2, Q4_0, Q5_0, Q8_0 and the K-quants), quantized and multiplied in
    integers as a decoding step's, within 1e-6 of the
    float64 reference, each row's bits those it gets alone (decoded one at a time), and in a batched prefill each
    prompt's those it gets alone; elsewhere the exact products, to the bit. K-quant rows of 2560 are longer than
    the prompt tile unpacks at once (kernels.c's CHUNK, 8 super-blocks): 8, then 2. Rows over 32768 wide (a
    file can declare them) are wider than held_rows holds on a thread's stack (HELD_WIDTH, where it runs: AVX2):
    multiplied unheld, the same bits."""
    N = 32
    rng = np.random.default_rng(int(qtype))
    blocks = crafted_blocks(N, K, qtype, rng)
    w = dequantize(blocks, qtype).reshape(N, K).astype(np.float64)
    packed = packed_layout(qtype, torch.from_numpy(blocks))
    for rows in (64, 80):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        got, = ops.linear(INT8, torch.from_numpy(x), [torch.zeros(N, K)], packed=[packed])
        exact, = ops.linear(ON, torch.from_numpy(x), [torch.zeros(N, K)], packed=[packed])
        if not int8_prompts(qtype):
            assert torch.equal(got, exact)
            continue
        q, d = q8_0_activations(x)
        quantized = (q * d).reshape(rows, K).astype(np.float64)
        want, magnitude = quantized @ w.T, np.abs(quantized) @ np.abs(w).T
        assert (np.abs(got.numpy() - want) / magnitude).max() < 1e-6
        assert (np.abs(exact.numpy() - want) / magnitude).max() > 1e-4
        for b in range(rows):
            assert torch.equal(ops.linear(INT8, torch.from_numpy(x[b:b + 1]), [torch.zeros(N, K)],
                                          packed=[packed])[0][0], got[b])
    if int8_prompts(qtype):
        prompts = torch.from_numpy(rng.standard_normal((1, 75, K)).astype(np.float32))
        with INT8.packed([35, 40]):  # two prompts' rows (one bucket, 64) in one pass: each prompt's as alone
            together, = ops.linear(INT8, prompts, [torch.zeros(N, K)], packed=[packed])
        for rows in (slice(0, 35), slice(35, 75)):
            assert torch.equal(together[0, rows], ops.linear(INT8, prompts[0, rows], [torch.zeros(N, K)],
                                                             packed=[packed])[0])


@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x7F, 0x00], ids=hex)
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_int8_products_at_the_integers_extremes(qtype, fill):
    """Blocks whose every byte but the float16 scales is `fill` (0xFF: every 4-, 5- and 6-bit q at its largest,
    Q8_0's q -1; 0x80: Q8_0's -128, Q6_K's scales -128; 0x7F: Q6_K's 127; 0x00: Q4_0's q - 8 at -8, and Q6_K's
    q - 32 at -32, its scales set to -128: the largest sum, 16.6M < 2^24) against activations all +1 or all -1
    (every quantized x +-127): the sums kernels.c keeps in 16 bits (AVX2's eights_block: a block's 8 pairs of
    4-bit q x, Q5_K's 4, Q6_K's 2, Q8_0's 1; held_rows' pairs) at their bounds, within 1e-6 of the float64
    reference, the file's blocks and those laid out again, at 1 row and a prompt's 64, each row's bits its own."""
    N, K = 32, 512
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.full((N, K // block, size), fill, np.uint8)
    if qtype == Q.Q6_K and fill == 0x00:
        raw[..., 192:208] = 0x80  # its 16 int8 scales
    for offset in SCALES[qtype]:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    blocks = raw.reshape(N, -1)
    w = dequantize(blocks, qtype).reshape(N, K).astype(np.float64)
    if not w.any():
        pytest.skip(f"every weight of these {qtype.name} blocks is 0")
    x = np.where(np.arange(64)[:, None] % 2 == 0, 1.0, -1.0).repeat(K, 1).astype(np.float32)
    q, d = q8_0_activations(x)
    quantized = (q * d).reshape(64, K).astype(np.float64)
    want, magnitude = quantized @ w.T, np.abs(quantized) @ np.abs(w).T
    for layout in (packed_layout(qtype, torch.from_numpy(blocks)),
                   packed_layout(qtype, torch.from_numpy(blocks), repack=True)):
        alone = [ops.linear(INT8, torch.from_numpy(x[b:b + 1]), [torch.zeros(N, K)], packed=[layout])[0][0]
                 for b in range(2)]
        for b in range(2):
            assert (np.abs(alone[b].numpy() - want[b]) / magnitude[b]).max() < 1e-6
        if int8_prompts(qtype):
            got, = ops.linear(INT8, torch.from_numpy(x), [torch.zeros(N, K)], packed=[layout])
            assert (np.abs(got.numpy() - want) / magnitude).max() < 1e-6
            assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_int8_activation_products_of_a_row_do_not_depend_on_its_batch(qtype):
    N, K = 32, 512
    rng = np.random.default_rng(int(qtype))
    packed = packed_layout(qtype, torch.from_numpy(crafted_blocks(N, K, qtype, rng)))
    x = torch.from_numpy(rng.standard_normal((16, K)).astype(np.float32))
    batched, = ops.linear(INT8, x, [torch.zeros(N, K)], packed=[packed])
    for b in range(16):
        assert torch.equal(ops.linear(INT8, x[b:b + 1], [torch.zeros(N, K)], packed=[packed])[0][0], batched[b])
    prompts = torch.from_numpy(rng.standard_normal((1, 21, K)).astype(np.float32))  # a batched prefill's rows
    with INT8.packed([9, 12]):  # two prompts' rows in one pass, 21 rows: each prompt's as it is alone
        together, = ops.linear(INT8, prompts, [torch.zeros(N, K)], packed=[packed])
    for rows in (slice(0, 9), slice(9, 21)):
        assert torch.equal(together[0, rows], ops.linear(INT8, prompts[0, rows], [torch.zeros(N, K)],
                                                         packed=[packed])[0])


@pytest.mark.parametrize("qtype, K", [*((Q.Q4_0, K) for K in (64, 480, 512, 544, 960)),
                                      *((qtype, K) for qtype in (Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q5_1) for K in (64, 960)),
                                      *((qtype, K) for qtype in K_QUANTS for K in (256, 768))],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_laid_out_again_gives_the_file_blocks_bits(qtype, K, monkeypatch):
    """Q4_0 laid out again as rows of stripes, a K-quant as its int8 tile's steps (packed_layout's repack: where the
    int8 tile is built, AVX512-VNNI (K-quants: and DQ); with AVX2 every block type as groups of 8 rows; elsewhere the
    file's blocks as they are) gives the bits of the file's blocks: the int8 products of 1, 5 and 64 rows, the exact
    ones, dequantize and rows looked up; Q4_0's rows of 2 to 30 blocks (fewer than a stripe, whole ones, and a last
    one overlapping the one before)."""
    rng = np.random.default_rng(K)
    blocks = torch.from_numpy(crafted_blocks(32, K, qtype, rng))
    file, again = packed_layout(qtype, blocks), packed_layout(qtype, blocks, repack=True)
    assert again.type == (LAID_OUT_AS[qtype] if built_again(qtype) else file.type)
    assert again.data.shape == file.data.shape
    for rows in (1, 5, 64):
        x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32))
        for choices in (INT8, ON):
            want, = ops.linear(choices, x, [torch.zeros(32, K)], packed=[file])
            assert torch.equal(ops.linear(choices, x, [torch.zeros(32, K)], packed=[again])[0], want)
    assert torch.equal(unpacked(again), unpacked(file))
    assert torch.equal(HeldWeight(again, (32, K)).decoded(), unpacked(file))
    ids = torch.tensor([[3, 0, 31], [7, 7, 2]])
    assert torch.equal(unpacked(again, ids), unpacked(file, ids))
    monkeypatch.setattr("smollm2.kernels.packed.LOOKED_UP", 1)  # a group of rows decoded at a time: the same rows
    assert torch.equal(unpacked(again, ids), unpacked(file, ids))


def test_decoding_a_laid_out_matrix_says_when_its_copy_finds_no_memory():
    """kernels.c's dequantize puts a laid-out matrix back as the file's blocks in a copy first: a copy it cannot
    have is -1 (packed.kernels_decoded raises MemoryError), not a matrix left undecoded."""
    blocks = torch.from_numpy(crafted_blocks(16, 256, Q.Q4_K, np.random.default_rng(0)))
    again = packed_layout(Q.Q4_K, blocks, repack=True)
    if again.type != ACROSS[Q.Q4_K]:
        pytest.skip("the K-quants are not laid out again on this CPU")
    out = torch.zeros(16, 256)
    assert kernels.compiled().dequantize(w=again.data.data_ptr(), w_type=again.type, out=out.data_ptr(),
                                         N=1 << 48, K=256) == -1  # ~40 PB of blocks to copy
    assert kernels.compiled().dequantize(w=again.data.data_ptr(), w_type=again.type, out=out.data_ptr(),
                                         N=16, K=256) == 0
    assert torch.equal(out, unpacked(packed_layout(Q.Q4_K, blocks)))


LAID_OUT_AS = {Q.Q4_0: STRIPES, **ACROSS}  # the types packed_layout's repack lays out again, as what


def built_again(qtype: Q) -> bool:
    """Whether the kernels lay weights of qtype out again (where their int8 tile is built)."""
    blocks = torch.from_numpy(crafted_blocks(16, GGML_QUANT_SIZES[qtype][0], qtype, np.random.default_rng(0)))
    return packed_layout(qtype, blocks, repack=True).type == LAID_OUT_AS[qtype]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_int8_activations_at_load_lay_the_matrices_out_again(tmp_path, qtype):
    """A Q4_0 model loaded with int8 activations holds its matrices as rows of stripes where the int8 tile is built,
    a K-quant model (v_proj and down_proj Q6_K, as Q4_K_M's) as its tile's steps, its tied embedding too (the output
    head; its rows looked up through the kernels' dequantize), and decodes to the bits of the same model switched to
    int8 after loading; exact again, the exact bits."""
    path = tmp_path / "tiny.gguf"
    model = gguf_model(path, qtype) if qtype == Q.Q4_0 else crafted_gguf_model(path, qtype, v_down=Q.Q6_K)
    fast = load(path, int8_activations=True)
    assert model.lm_head is None
    kinds = {name: next(kind for kind, ours in PACKED_TYPES.items() if ours == packed_of(m).type)
             for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert set(kinds.values()) == ({qtype} if qtype == Q.Q4_0 else {qtype, Q.Q6_K})
    for name, kind in kinds.items():
        want = LAID_OUT_AS[kind] if built_again(kind) else PACKED_TYPES[kind]
        assert packed_of(fast.get_submodule(name)).type == want
    ids = torch.randint(0, model.config.vocab_size, (3, 21))
    exact, _ = decode(model, ids, torch.ones_like(ids), 3)
    with_int8_activations(model)
    assert torch.equal(decode(fast, ids, torch.ones_like(ids), 3)[0], decode(model, ids, torch.ones_like(ids), 3)[0])
    with_int8_activations(fast, False)
    assert torch.equal(decode(fast, ids, torch.ones_like(ids), 3)[0], exact)


def with_int8_activations(model: SmolLM2, on: bool = True) -> SmolLM2:
    return accelerate(model, int8_activations=on)


def q8_0_in_torch(model: SmolLM2, prompts: bool = False) -> SmolLM2:
    """model (its reference modules alone) with the inputs of a decoding step's products (up to 16 rows, the head's
    too), and with `prompts` a prompt's too, quantized as q8_0_activations, in torch: what the kernels' int8
    activations compute, to float rounding."""
    def quantized(x):
        if x.numel() // x.shape[-1] > ops.MAX_ROWS and not prompts:  # a prompt's products exact
            return x
        q, d = q8_0_activations(x.reshape(-1, x.shape[-1]).numpy())
        return torch.from_numpy(q * d).reshape(x.shape)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda module, args: (quantized(args[0]),))
    model.logits = lambda h: F.linear(quantized(h), model.output_weight)
    return model


@pytest.mark.parametrize("qtype, v_down", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, None), (Q.Q4_0, None), (Q.Q5_K, None),
                                           (Q.Q4_1, None), (Q.Q5_0, None), (Q.Q5_1, None)],
                         ids=lambda q: q.name if q else "")
def test_int8_activations_in_the_decoding_step(tmp_path, qtype, v_down):
    """A GGUF model's decoding step with int8 activations (every block type; Q4_K with Q6_K, as a Q4_K_M file):
    its logits those of the same quantization in torch (q8_0_in_torch) within 2e-2 of their largest (measured:
    1e-7-3e-6, and up to 1.3e-2 where float rounding moved a value across a rounding boundary of its quantization,
    and the error of the quantized value, up to half a step, went on through the layers: a chance event, more
    likely the more products are quantized, as a prompt's are now for every type with AVX512-VNNI); a row's logits
    and cache the same alone as in a batch of 3; off again, the exact bits again."""
    model = crafted_gguf_model(tmp_path / "tiny.gguf", qtype, v_down=v_down)
    ids = torch.randint(0, model.config.vocab_size, (3, 21))
    exact, _ = decode(model, ids, torch.ones_like(ids), 3)
    with_int8_activations(model)
    runs = model.accelerator.kernel_runs["blocks"]
    got, cache = decode(model, ids, torch.ones_like(ids), 3)
    assert model.accelerator.kernel_runs["blocks"] > runs and not torch.equal(got, exact)
    reference = q8_0_in_torch(load(tmp_path / "tiny.gguf", kernels=False), prompts=int8_prompts(qtype))
    want, _ = decode(reference, ids, torch.ones_like(ids), 3)
    assert ((got - want).abs().amax() / want.abs().amax()).item() < 2e-2
    alone, alone_cache = decode(model, ids[1:2], torch.ones_like(ids[1:2]), 3)
    assert torch.equal(alone[0], got[1])
    assert all(torch.equal(a[:, 0], b[:, 1]) for a, b in zip(alone_cache, cache))
    with_int8_activations(model, False)
    assert torch.equal(decode(model, ids, torch.ones_like(ids), 3)[0], exact)


def steps_logits(model: SmolLM2, tokens: list[int]) -> torch.Tensor:
    """The logits of each of `tokens` fed one at a time, every product a decoding step's: (len(tokens), vocab)."""
    cache, seq = model.new_cache(1, len(tokens)), torch.tensor([tokens])
    return torch.cat([model(seq[:, t:t + 1], torch.arange(t, t + 1), cache.view(length=t + 1),
                            torch.ones(1, t + 1, dtype=torch.long))[0] for t in range(len(tokens))])


def test_int8_activations_on_the_embedded_model(model):
    """The embedded model (Q4_1 blocks, Q8_0 embeddings) loaded with int8 activations, beside its exact decoding
    (the default): along the exact model's greedy continuations of two prompts (32 tokens), every step's logits
    within 0.1 of the largest logit (measured: at most 0.047-0.067; what llama.cpp's quantization gives here, as
    q8_0_in_torch gives it too: 0.063-0.067), the same top token at >= 90% of the steps (measured 94-100%), and the
    greedy tokens (8, a prompt's products quantized too where the CPU multiplies them in integers) the exact ones
    until they part, if they do, where the exact model's top two were within that 0.1 of each other (measured: 3
    and 8 tokens, parting at a gap of 0.11 against 0.1 times 21.5; q8_0_in_torch parts there too)."""
    fast = load(int8_activations=True)
    assert fast.accelerator.int8_activations and not model.accelerator.int8_activations
    tokenizer = Tokenizer.from_pretrained(None)
    for text in ["Once upon a time, there was a", "def fibonacci(n):"]:
        prompt = [1, *tokenizer.encode(text)]
        tokens = generate(model, [prompt], 32, eos_token_id=None)[0].tolist()
        exact, int8 = steps_logits(model, tokens), steps_logits(fast, tokens)
        scale = exact.abs().amax(-1)
        assert ((int8 - exact).abs().amax(-1) / scale).max() < 0.1
        assert (int8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
        greedy = generate(fast, [prompt], 8, eos_token_id=None)[0].tolist()
        parted = next((t for t, (a, b) in enumerate(zip(greedy, tokens)) if a != b), None)
        if parted is not None:  # the exact logits that chose tokens[parted]
            top = exact[parted - 1].topk(2).values
            assert top[0] - top[1] < 0.1 * scale[parted - 1]


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_int8_activations_leave_other_weights_exact(weights):
    """Only GGUF blocks are multiplied in integers: a float32 model's, and an int8-weight model's, decoding steps and
    prompts give the same bits with int8 activations as without."""
    plain = tiny_model(TINY["gqa"])
    model = accelerate(quantize_int8(plain) if weights == "int8" else plain)
    ids = torch.randint(0, plain.config.vocab_size, (2, 40))
    exact, exact_cache = decode(model, ids, torch.ones_like(ids), 3)
    with_int8_activations(model)
    got, cache = decode(model, ids, torch.ones_like(ids), 3)
    assert torch.equal(got, exact) and all(torch.equal(a, b) for a, b in zip(cache, exact_cache))


def test_int8_activations_are_the_kernels():
    with pytest.raises(SmolError, match="int8 activations run on the CPU kernels"):
        load(kernels=False, int8_activations=True)
