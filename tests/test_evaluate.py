"""smollm2.evaluate: sliding-window perplexity against plain full-sequence computations, log-likelihoods of
continuations against transformers' LlamaForCausalLM, and hostile requests."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, hf_copy, tiny_model
from smollm2 import evaluate
from smollm2.errors import SmolError


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(TINY["gqa"])


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk_nll(model, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] given their prefixes, from one forward pass over ids."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0, :-1].float()
    return F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()


def test_perplexity_equals_the_whole_sequence_when_the_window_covers_it(tiny):
    ids = random_ids(200, tiny.config.vocab_size)
    want = chunk_nll(tiny, ids) / (len(ids) - 1)
    for window, stride in [(200, 100), (512, 256), (200, 1)]:  # one window: the stride never comes into play
        got = evaluate.perplexity(tiny, ids, window, stride)
        assert got.tokens == len(ids) - 1 and (got.window, got.stride) == (window, stride)
        assert got.nll == pytest.approx(want, rel=1e-5) and got.perplexity == pytest.approx(math.exp(want), rel=1e-5)


def test_perplexity_of_windows_overlapping_by_one_token(tiny):
    """stride = window - 1: each window scores every token of its own but the first (its predecessor's last),
    from one forward pass over the window, as a plain loop over the windows computes it."""
    ids, window = random_ids(130, tiny.config.vocab_size, seed=1), 50
    told = []
    got = evaluate.perplexity(tiny, ids, window, window - 1, progress=told.append)
    want = sum(chunk_nll(tiny, ids[begin:begin + window]) for begin in range(0, len(ids) - 1, window - 1))
    assert got.tokens == len(ids) - 1 and sum(told) == len(ids) - 1 and len(told) == 3
    assert got.nll == pytest.approx(want / (len(ids) - 1), rel=1e-5)


@pytest.mark.parametrize("variant", ["gqa", "untied", "head_dim"])
def test_loglikelihood_equals_transformers(variant):
    model = tiny_model(TINY[variant])
    hf = hf_copy(model)
    vocab = model.config.vocab_size
    context, continuation = random_ids(37, vocab, seed=2), random_ids(9, vocab, seed=3)
    with torch.inference_mode():
        logits = hf(torch.tensor([context + continuation[:-1]])).logits[0].float()
        # the greedy continuation of the context, token by token
        greedy = []
        for _ in range(5):
            greedy.append(hf(torch.tensor([context + greedy])).logits[0, -1].argmax().item())
    logprobs = torch.log_softmax(logits[len(context) - 1:], dim=-1)
    want = logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item()

    got, is_greedy = evaluate.loglikelihood(model, context, continuation)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4) and not is_greedy
    got, is_greedy = evaluate.loglikelihood(model, context, greedy)
    assert is_greedy and got <= 0


def test_loglikelihoods_batched_equal_one_at_a_time(tiny):
    vocab = tiny.config.vocab_size
    requests = [(random_ids(n, vocab, seed=n), random_ids(m, vocab, seed=100 + n)) for n, m in
                [(1, 1), (20, 3), (5, 17), (64, 2), (9, 9)]]
    batched = evaluate.loglikelihoods(tiny, requests, batch_size=3)
    for (context, continuation), (got, greedy) in zip(requests, batched):
        alone, alone_greedy = evaluate.loglikelihood(tiny, context, continuation)
        assert got == pytest.approx(alone, rel=1e-5, abs=1e-5) and greedy == alone_greedy


@pytest.mark.parametrize("context, continuation, message", [
    ([1, 2], [], "continuation is empty"),
    ([], [1, 2], "context is empty"),
    ([1, 2], [49152], "token id 49152 is not in the vocabulary"),
    ([-1], [3], "token id -1 is not in the vocabulary"),
    ([1.5], [3], "token ids must be integers"),
    (list(range(500)), list(range(14)), r"500 \+ 14 tokens\) exceed the model's context of 512"),
])
def test_hostile_loglikelihood_requests(tiny, context, continuation, message):
    with pytest.raises(SmolError, match=message):
        evaluate.loglikelihood(tiny, context, continuation)


def test_windowed_perplexity_takes_the_commands_defaults(tiny):
    """evaluate.windowed_perplexity, which `smollm2 perplexity` calls: 1024-token windows, or the model's whole
    context window (512) where shorter, moved by half a window unless the stride says."""
    ids = random_ids(700, tiny.config.vocab_size, seed=2)
    assert evaluate.windowed_perplexity(tiny, ids) == evaluate.perplexity(tiny, ids, 512, 256)
    assert evaluate.windowed_perplexity(tiny, ids, 2000, 100) == evaluate.perplexity(tiny, ids, 512, 100)
    assert evaluate.windowed_perplexity(tiny, ids, 128) == evaluate.perplexity(tiny, ids, 128, 64)
    with pytest.raises(SmolError, match=r"--stride must be in \[1, --context - 1 = 127\], got 128"):
        evaluate.windowed_perplexity(tiny, ids, 128, 128)


def test_hostile_perplexity_input(tiny):
    with pytest.raises(SmolError, match="at least 2 tokens"):
        evaluate.perplexity(tiny, [5], 64, 32)
    with pytest.raises(SmolError, match="not in the vocabulary"):
        evaluate.perplexity(tiny, [5, 10**6], 64, 32)
    with pytest.raises(SmolError, match=r"window must be in \[2, 512\]"):
        evaluate.perplexity(tiny, [5, 6, 7], 1000, 32)
    for stride in (0, 64):  # a window moved by all of itself would leave its first token unpredicted
        with pytest.raises(SmolError, match=r"stride must be in \[1, 63\] \(below the window, 64\)"):
            evaluate.perplexity(tiny, [5, 6, 7], 64, stride)
    with pytest.raises(SmolError, match="batch_size"):
        evaluate.loglikelihoods(tiny, [([1], [2])], batch_size=0)
