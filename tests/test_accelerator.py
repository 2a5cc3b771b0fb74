"""Each model's accelerator is its own: two models decoding at once, in two threads (a server's base model and an
adapter's copy, say), one on torch alone, the other on the kernels, never change each other's way."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import TINY, tiny_model

from smollm2 import kernels
from smollm2.generation import generate
from smollm2.kernels import accelerate, ops

pytestmark = pytest.mark.skipif(kernels.compiled() is None, reason="no C compiler")

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
ROUNDS = 12  # generations each thread runs, while the other runs its own


def tokens(model) -> torch.Tensor:
    return generate(model, PROMPTS, 24, eos_token_id=None)


def test_two_models_decode_at_once_each_as_its_accelerator_says():
    reference = tiny_model(TINY["gqa"])
    want = tokens(reference)
    fast = accelerate(copy.deepcopy(reference), mode="on")
    slow = accelerate(copy.deepcopy(reference), mode="off")
    assert torch.equal(tokens(fast), want) and torch.equal(tokens(slow), want)  # each alone
    runs = fast.accelerator.kernel_runs["blocks"]  # a generation's steps: its prompt's and one a new token
    assert runs > 20 and not slow.accelerator.kernel_runs

    start, results = threading.Barrier(2), {}

    def generations(name, model):
        start.wait()
        results[name] = [tokens(model) for _ in range(ROUNDS)]

    threads = [threading.Thread(target=generations, args=item) for item in (("fast", fast), ("slow", slow))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(out, want) for name in ("fast", "slow") for out in results[name])
    assert fast.accelerator.kernel_runs["blocks"] == (1 + ROUNDS) * runs  # every step on the kernel, all along
    assert not slow.accelerator.kernel_runs  # and none of the other's


def test_a_prompts_q_k_and_v_are_one_product_with_each_ones_bits(monkeypatch):
    """Attention.project on the kernels: one pass for q, k and v (their input read, and in int8 mode quantized,
    once), each output the bits its own projection gives."""
    model = accelerate(tiny_model(TINY["gqa"]), mode="on")
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 40, model.config.hidden_size)
    passes = []
    linear = ops.linear

    def counted(choices, x, weights, *args, **kwargs):
        passes.append(len(weights))
        return linear(choices, x, weights, *args, **kwargs)

    monkeypatch.setattr(ops, "linear", counted)
    with torch.inference_mode():
        together = attn.project(x)
        assert passes == [3]
        alone = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_a_decoding_steps_final_norm_is_a_kernel_call():
    model = accelerate(tiny_model(TINY["gqa"]), mode="on")
    tokens(model)  # prompts of a few tokens: every pass one kernel call for the blocks, then the final norm's
    runs = model.accelerator.kernel_runs
    assert runs["rms_norm"] == runs["blocks"] > 20
