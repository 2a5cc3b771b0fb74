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
from smollm2.kernels import accelerate

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
