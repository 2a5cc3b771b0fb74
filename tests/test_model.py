"""The model against transformers' LlamaForCausalLM, and one test for each defect of the seed design.

Tiny random configs (litgpt style): weights copied into transformers, logits compared with assert_close.
The real SmolLM2-135M-Instruct is compared on 512 tokens of English text. Every parity test runs twice
(`variant`): on model.py's reference modules, and on the same model accelerated (smollm2.accelerate).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY, as_variant, hf_copy, tiny_model

import smollm2.model as model_module
from smollm2 import KVCache, SmolConfig, SmolLM2
from smollm2.loading import WithoutRandomInit
from smollm2.model import RMSNorm, rope_tables

GQA = TINY["gqa"]


def random_ids(config: SmolConfig, B: int = 2, T: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------------------
# Numerical equivalence with transformers


@pytest.mark.parametrize("name", list(TINY))
@torch.no_grad()
def test_tiny_configs_match_transformers(name, variant, record_property):
    model = as_variant(tiny_model(TINY[name]), variant)
    hf = hf_copy(model)
    ids = random_ids(model.config, B=2, T=40)
    ours, theirs = model(ids), hf(ids).logits
    diff = max_abs(ours, theirs)
    record_property("max_abs_diff", diff)
    print(f"{name}: max abs logit diff vs transformers {diff:.3g}")
    assert ours.shape == (2, 40, model.config.vocab_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@torch.no_grad()
def test_real_135m_matches_transformers(either_model, hf_model, english, embedded_path, record_property):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_path.parent), gguf_file=embedded_path.name)
    ids = tokenizer(english, return_tensors="pt").input_ids[:, :512]
    assert ids.shape == (1, 512)
    ours, theirs = either_model(ids), hf_model(ids).logits
    diff = max_abs(ours, theirs)
    record_property("max_abs_diff", diff)
    print(f"SmolLM2-135M-Instruct, 512 tokens: max abs logit diff vs transformers {diff:.3g}")
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
    # Same argmax everywhere (a sanity check on top of the 1e-3 bound).
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.999


# ---------------------------------------------------------------------------------------------------------
# The seed design's defects, one test each


def test_rope_angles_float32_from_integer_positions_in_bf16():
    """The seed built positions with arange(dtype=bf16): bf16 cannot count past 256 (257 -> 256 ...)."""
    config = GQA  # max_position_embeddings=512: positions 257..511 are not bf16-representable
    hd = config.head_dim
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(pos, inv_freq).repeat(1, 2)
    cos, sin = rope_tables(config)
    assert cos.dtype == sin.dtype == torch.float32
    assert max_abs(cos, angles.cos()) < 1e-4 and max_abs(sin, angles.sin()) < 1e-4
    # What bf16 positions would have given: far off past 256, so the check above discriminates.
    bf16_angles = torch.outer(pos.to(torch.bfloat16).double(), inv_freq).repeat(1, 2)
    assert max_abs(bf16_angles[:257].cos(), angles[:257].cos()) == 0
    assert max_abs(bf16_angles.cos(), angles.cos()) > 0.5

    # The bf16 model gets the same tables, and a 300-token bf16 forward matches transformers in bf16
    # (whose rotary inv_freq is kept in float32, as its from_pretrained(dtype=bfloat16) does).
    fp32 = tiny_model(config)
    hf = hf_copy(fp32)
    model = tiny_model(config).to(torch.bfloat16)
    assert torch.equal(model.rope_cos.to(torch.bfloat16), cos.to(torch.bfloat16))  # what the forward uses
    inv_freq32 = hf.model.rotary_emb.inv_freq.clone()
    hf = hf.to(torch.bfloat16)
    hf.model.rotary_emb.inv_freq = inv_freq32
    ids = random_ids(config, B=1, T=300)
    with torch.no_grad():
        ours, theirs, exact = model(ids).float(), hf(ids).logits.float(), fp32(ids)
    torch.testing.assert_close(ours[:, 256:], theirs[:, 256:], atol=2e-2, rtol=0)
    assert max_abs(ours[:, 256:], exact[:, 256:]) < 0.1  # bf16 rounding only, no position error


def test_rmsnorm_accumulates_in_float32_for_bf16(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    dim = 576
    ours, theirs = RMSNorm(dim, 1e-5), LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(1.0, 0.1)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = (torch.randn(4, 16, dim) * torch.logspace(-3, 2, 16)[:, None]).to(torch.bfloat16)
    y = ours(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, theirs(x), atol=0, rtol=0)
    # The seed's bf16 accumulation gives something else.
    naive = ours.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert not torch.equal(naive, y)
    # fp32 input: the reference formula.
    x32, w32 = x.float(), ours.weight.float()
    ref = w32 * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ours.float()(x32), ref, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_causal_mask_for_every_cached_and_new_length(variant):
    """Every (cached length c, new length n) gives the full forward's logits; stale slots never leak."""
    model = as_variant(tiny_model(GQA), variant)
    T = 9
    ids = random_ids(model.config, B=2, T=T)
    full = model(ids)
    torch.testing.assert_close(full, hf_copy(model)(ids).logits, atol=1e-5, rtol=0)
    for c in range(T):
        for n in range(1, T - c + 1):
            cache = model.new_cache(2, T + 3)
            for buf in (cache.k, cache.v):  # garbage in unwritten slots, as a reused cache would hold
                buf.normal_(0, 1e3)
            if c:
                model(ids[:, :c], input_pos=torch.arange(c), cache=cache)
            out = model(ids[:, c:c + n], input_pos=torch.arange(c, c + n), cache=cache)
            torch.testing.assert_close(out, full[:, c:c + n], atol=1e-5, rtol=0, msg=f"cached {c}, new {n}")


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 17, 40])
@torch.no_grad()
def test_causal_mask_chunked_prefill_equals_one_shot(chunk, variant):
    model = as_variant(tiny_model(GQA), variant)
    ids = random_ids(model.config, B=2, T=40)
    one_shot = model(ids)
    cache = model.new_cache(2, 48)
    pieces = [model(ids[:, s:s + chunk], input_pos=torch.arange(s, min(s + chunk, 40)), cache=cache)
              for s in range(0, 40, chunk)]
    torch.testing.assert_close(torch.cat(pieces, 1), one_shot, atol=1e-5, rtol=0)
    # Then cached decoding continues exactly as a full forward over the longer sequence.
    more = random_ids(model.config, B=2, T=4, seed=5)
    steps = [model(more[:, i:i + 1], input_pos=torch.tensor([40 + i]), cache=cache) for i in range(4)]
    full = model(torch.cat([ids, more], 1))
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 40:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_left_padded_batch_rows_equal_unpadded(monkeypatch, variant):
    # No query row may be fully masked: older torch versions turn such rows into NaN (2.13 gives zeros).
    class CheckedF:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, attn_mask=None, **kwargs):
            assert attn_mask is None or attn_mask.any(-1).all(), "a fully masked attention row"
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(model_module, "F", CheckedF())
    model = as_variant(tiny_model(GQA), variant)
    lengths, L, pad = [12, 5, 1, 9], 12, 0
    rows = [random_ids(model.config, B=1, T=n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.full((len(rows), L), pad)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):], mask[i, L - len(r):] = r, 1

    # Without a cache.
    logits = model(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()
    alone = [model(r[None])[0] for r in rows]
    for i, r in enumerate(rows):
        torch.testing.assert_close(logits[i, L - len(r):], alone[i], atol=1e-5, rtol=0)
    # transformers, given the same mask (its own positions for real tokens are the same), agrees.
    hf = hf_copy(model)
    hf_logits = hf(ids, attention_mask=mask).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(logits[i, L - len(r):], hf_logits[i, L - len(r):], atol=1e-5, rtol=0)

    # With a cache: padded prefill, then decoding steps, row by row equal to each row decoded alone.
    new = random_ids(model.config, B=len(rows), T=3, seed=3)
    cache = model.new_cache(len(rows), L + 3)
    prefill = model(ids, cache=cache, attention_mask=mask)
    torch.testing.assert_close(prefill, logits, atol=1e-5, rtol=0)
    steps = []
    for t in range(3):
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
        steps.append(model(new[:, t:t + 1], input_pos=torch.tensor([L + t]), cache=cache, attention_mask=mask))
    steps = torch.cat(steps, 1)
    assert torch.isfinite(steps).all()
    for i, r in enumerate(rows):
        expect = model(torch.cat([r, new[i]])[None])[0, -3:]
        torch.testing.assert_close(steps[i], expect, atol=1e-5, rtol=0)


@torch.no_grad()
def test_batch_equals_its_rows_alone(variant):
    model = as_variant(tiny_model(TINY["mha"]), variant)
    ids = random_ids(model.config, B=3, T=20)
    batch = model(ids)
    for i in range(3):
        torch.testing.assert_close(batch[i], model(ids[i:i + 1])[0], atol=1e-5, rtol=0)
    cache = model.new_cache(3, 24)
    batch_cached = torch.cat([model(ids[:, t:t + 1], input_pos=torch.tensor([t]), cache=cache)
                              for t in range(20)], 1)
    torch.testing.assert_close(batch_cached, batch, atol=1e-5, rtol=0)


@torch.no_grad()
def test_kv_cache_written_in_place(variant):
    model = as_variant(tiny_model(GQA), variant)
    c = model.config
    cache = model.new_cache(2, 16)
    assert isinstance(cache, KVCache) and cache.max_len == 16
    shape = (c.num_hidden_layers, 2, c.num_key_value_heads, 16, c.head_dim)
    assert all(t.shape == shape and t.dtype == torch.float32 for t in (cache.k, cache.v))
    objects = [id(t) for t in (cache.k, cache.v)]
    pointers = [t.data_ptr() for t in (cache.k, cache.v)]
    ids = random_ids(c, B=2, T=10)
    model(ids[:, :6], input_pos=torch.arange(6), cache=cache)
    for t in range(6, 10):
        model(ids[:, t:t + 1], input_pos=torch.tensor([t]), cache=cache)
        assert [id(x) for x in (cache.k, cache.v)] == objects
        assert [x.data_ptr() for x in (cache.k, cache.v)] == pointers
        assert all(x.shape == shape for x in (cache.k, cache.v))  # no torch.cat growth
    # Slots 0..9 written, the rest untouched.
    for x in (cache.k, cache.v):
        assert (x[..., :10, :] != 0).any(dim=-1).all() and (x[..., 10:, :] == 0).all()


def test_no_repeat_interleave_of_kv(monkeypatch):
    """K/V heads are shared with their query group (SDPA enable_gqa), never copied per query head."""
    def refuse(*args, **kwargs):
        raise AssertionError("K/V copied with repeat_interleave / repeat")

    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat", refuse)
    for name in ("gqa", "mqa"):
        model = tiny_model(TINY[name])
        ids = random_ids(model.config, B=2, T=8)
        with torch.no_grad():
            cache = model.new_cache(2, 9)
            model(ids, cache=cache)
            model(ids[:, :1], input_pos=torch.tensor([8]), cache=cache)
            model(ids)


@torch.no_grad()
def test_rope_tables_not_rebuilt_per_step(monkeypatch):
    model = tiny_model(GQA)
    cos, sin = model.rope_cos, model.rope_sin
    pointers = cos.data_ptr(), sin.data_ptr()
    assert cos.shape == (model.config.max_position_embeddings, model.config.head_dim)
    assert "rope_cos" not in model.state_dict()  # computed, never stored in checkpoints

    def refuse(*args, **kwargs):
        raise AssertionError("RoPE tables rebuilt during a forward")

    monkeypatch.setattr(model_module, "rope_tables", refuse)
    ids = random_ids(model.config, B=2, T=8)
    cache = model.new_cache(2, 12)
    model(ids, cache=cache)
    for t in range(8, 12):
        model(ids[:, :1], input_pos=torch.tensor([t]), cache=cache)
    model(ids)
    assert model.rope_cos is cos and model.rope_sin is sin
    assert (cos.data_ptr(), sin.data_ptr()) == pointers


def test_weight_init_as_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dataclasses.replace(GQA, hidden_size=256, intermediate_size=512, num_attention_heads=8, head_dim=None,
                                 num_key_value_heads=4, vocab_size=2048, attention_bias=True, mlp_bias=True,
                                 tie_word_embeddings=False, initializer_range=0.05, pad_token_id=3)
    torch.manual_seed(0)
    ours = SmolLM2(config)
    theirs = LlamaForCausalLM(LlamaConfig(**config.to_hf()))
    theirs_params = dict(theirs.named_parameters())
    params = dict(ours.named_parameters())
    assert params.keys() == theirs_params.keys()
    for name, p in params.items():
        p, q = p.detach(), theirs_params[name].detach()
        assert p.shape == q.shape, name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(q, p), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)) and torch.equal(q, p), name
        else:
            if name == "model.embed_tokens.weight":  # transformers zeroes the padding row
                assert torch.equal(p[3], torch.zeros_like(p[3])) and torch.equal(q[3], p[3])
                p, q = torch.cat([p[:3], p[4:]]), torch.cat([q[:3], q[4:]])
            assert abs(p.std().item() - 0.05) < 0.05 * 0.03, name
            assert abs(p.mean().item()) < 0.05 * 0.03, name
            assert abs(p.std().item() - q.std().item()) < 0.05 * 0.04, name
    # Tied: one matrix, not a copy.
    tied = SmolLM2(GQA)
    assert tied.lm_head is None and "lm_head.weight" not in tied.state_dict()


# ---------------------------------------------------------------------------------------------------------
# The public API


@torch.no_grad()
def test_public_api(variant):
    model = as_variant(tiny_model(TINY["untied"]), variant)
    ids = random_ids(model.config, B=2, T=7)
    logits = model(ids)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 7, model.config.vocab_size)
    assert torch.equal(model(ids, input_pos=None, cache=None, attention_mask=None), logits)
    h = model.hidden_states(ids)
    assert h.shape == (2, 7, model.config.hidden_size)
    assert torch.equal(model.logits(h), logits)
    torch.testing.assert_close(model(ids, attention_mask=torch.ones(2, 7, dtype=torch.long)), logits,
                               atol=1e-6, rtol=0)
    # (B, T) positions work as well as (T,).
    cache = model.new_cache(2, 8)
    out = model(ids, input_pos=torch.arange(7).expand(2, 7), cache=cache)
    torch.testing.assert_close(out, logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long))


def test_load_builds_the_model_without_drawing_weights():
    """Every weight is replaced by the checkpoint's: building draws no random numbers (and touches no memory)."""
    before = torch.get_rng_state()
    with WithoutRandomInit():
        SmolLM2(TINY["bias"])
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("T", [7, 40])  # 7: a few rows (the CPU's decoding kernel), 40: a prompt
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_last_only_gives_the_last_position_and_the_whole_cache(T, padded, variant):
    model = as_variant(tiny_model(GQA), variant)
    ids = random_ids(model.config, B=2, T=T)
    mask = torch.ones(2, T, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
    full, last = model.new_cache(2, T + 5), model.new_cache(2, T + 5)
    pos = torch.arange(T)
    want = model.hidden_states(ids, pos, full.view(length=T), mask if padded else None)[:, -1:]
    got = model.hidden_states(ids, pos, last.view(length=T), mask if padded else None, last_only=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(full.k, last.k) and torch.equal(full.v, last.v)  # every position's, of every layer
