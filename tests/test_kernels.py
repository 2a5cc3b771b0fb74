"""The CPU decoding kernels against torch's formulas, and the model's tokens with and without them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from smollm2 import Tokenizer, kernels
from smollm2.generation import generate
from smollm2.generation.engine import decode_step
from smollm2.generation.quantize import quantize_int8
from smollm2.model import apply_rope

pytestmark = pytest.mark.skipif(kernels.compiled_library() is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def inference():
    torch.manual_seed(0)
    with torch.inference_mode():  # the kernels serve inference only: with gradients, torch does the work
        yield


@pytest.fixture
def plain(monkeypatch):
    """Run the code inside with torch's kernels only."""
    def off():
        monkeypatch.setattr(kernels, "enabled", False)
    return off


def weights(dtype, N=96, K=64):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    if dtype == torch.int8:
        return torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N) + 0.5
    return w.to(dtype), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
def test_linear_matches_torch(dtype, rows):
    w, scale = weights(dtype)
    x = torch.randn(rows, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    got = kernels.linear(x, [w], [scale])[0]
    want = F.linear(x.float(), w.float()) * (1 if scale is None else scale)
    assert got.dtype == x.dtype and got.shape == (rows, 96)
    if dtype == torch.bfloat16:  # one rounding of the float32 sum
        torch.testing.assert_close(got, want.to(torch.bfloat16), atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    w, scale = weights(dtype)
    x = torch.randn(16, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    batched = kernels.linear(x, [w], [scale])[0]
    for b in (0, 5, 15):
        assert torch.equal(kernels.linear(x[b:b + 1], [w], [scale])[0][0], batched[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_several_weights_in_one_pass(dtype):
    (wq, sq), (wk, sk) = weights(dtype), weights(dtype, N=32)
    x = torch.randn(3, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    q, k = kernels.linear(x, [wq, wk], [sq, sk])
    assert torch.equal(q, kernels.linear(x, [wq], [sq])[0]) and torch.equal(k, kernels.linear(x, [wk], [sk])[0])
    # SwiGLU's two products together: the formula, rounded where torch rounds.
    plain = F.silu(kernels.linear(x, [wq], [sq])[0]) * kernels.linear(x, [wq], [sq])[0]
    torch.testing.assert_close(kernels.swiglu(x, wq, wq, sq, sq), plain, atol=1e-5, rtol=1e-5 if dtype != torch.bfloat16
                               else 2 ** -7)


def test_many_rows_stay_on_torch():
    w, _ = weights(torch.float32)
    x = torch.randn(kernels.MAX_ROWS + 1, 64)
    assert torch.equal(kernels.linear(x, [w])[0], F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_sdpa(dtype, T, masked):
    B, H, KVH, S, D = 2, 6, 2, 37, 32
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(B, KVH, 64, D, generator=g).to(dtype) for _ in range(2))
    k, v = k_cache[:, :, :S], v_cache[:, :, :S]  # a cache view: slots contiguous, rows strided
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    pos = torch.arange(S - T, S)
    mask = (torch.arange(S) <= pos[:, None]).expand(B, T, S).clone()
    if masked:
        mask[1, :, :10] = False  # row 1 left-padded
    got = kernels.attention(q, k, v, mask[:, None] if masked else None)
    want = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.float(), v.float(), attn_mask=mask[:, None],
                                          enable_gqa=True).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_follow_the_formulas(dtype, plain):
    from smollm2.model import RMSNorm

    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    x = (torch.randn(4, 1, 64) * torch.logspace(-2, 2, 4)[:, None, None]).to(dtype)
    angles = torch.randn(4, 1, 1, 32)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    heads = torch.randn(4, 1, 3, 64).to(dtype)
    with torch.no_grad():
        fast_norm, fast_rope = norm(x), apply_rope(heads.clone(), cos, sin)
        plain()
        slow_norm, slow_rope = norm(x), apply_rope(heads.clone(), cos, sin)
    if dtype == torch.bfloat16:  # the same roundings in the same places
        assert torch.equal(fast_rope, slow_rope)
    else:  # a fused multiply-add may skip one rounding
        torch.testing.assert_close(fast_rope, slow_rope, atol=1e-6, rtol=1e-6)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 1e-6  # the sum of squares in another order
    torch.testing.assert_close(fast_norm, slow_norm, atol=0, rtol=ulp)


@pytest.mark.parametrize("variant", ["fp32", "int8", "batched"])
def test_decoding_gives_the_plain_tokens(model, variant, plain):
    m = quantize_int8(copy.deepcopy(model)) if variant == "int8" else model
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 28, 17, 30]] if variant == "batched" else [[1, 504, 3458, 282]]
    fast = generate(m, prompts, 24, eos_token_id=None)
    plain()
    assert torch.equal(fast, generate(m, prompts, 24, eos_token_id=None))


def teacher_forced_logits(model, tokens, prompt=8):
    """The logits of every decoding step along a given text, (len(tokens) - prompt, V) in float32."""
    cache = model.new_cache(1, len(tokens))
    h = model.hidden_states(torch.tensor([tokens[:prompt]]), torch.arange(prompt), cache.view(length=prompt))
    out = [model.logits(h[:, -1])]
    for p in range(prompt, len(tokens) - 1):
        out.append(decode_step(model, torch.tensor([[tokens[p]]]), torch.tensor([p]), cache.view(length=p + 1), None))
    return torch.cat(out).float()


def test_bf16_decoding_is_as_exact_as_the_plain_path(model, english, plain):
    """bf16 rounds differently on the kernels (float32 sums, one rounding per output), so near-ties can go
    either way: measured against fp32, along a real text, it is as exact as torch's bf16."""
    tokens = Tokenizer.from_pretrained().encode(english)[:120]
    reference = teacher_forced_logits(model, tokens)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fast = teacher_forced_logits(bf16, tokens)
    plain()
    slow = teacher_forced_logits(bf16, tokens)
    top1 = reference.argmax(-1)
    assert (fast - reference).abs().mean() <= 1.05 * (slow - reference).abs().mean()
    assert (fast.argmax(-1) == top1).float().mean() >= (slow.argmax(-1) == top1).float().mean() - 0.03


def test_without_a_compiler_torch_does_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels.compiled_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="kernels unavailable"):
            assert kernels.compiled_library() is None
        x, (w, _) = torch.randn(1, 64), weights(torch.float32)
        assert torch.equal(kernels.linear(x, [w])[0], F.linear(x, w))
    finally:
        kernels.compiled_library.cache_clear()
