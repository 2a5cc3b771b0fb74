"""Evaluating a model on token ids: sliding-window perplexity of a text, and the log-likelihood of a
continuation given its context (what lm-eval's `loglikelihood` requests ask).

Both score with the model's own forward pass (model.hidden_states, then model.logits) in inference mode, on
the device the model's weights are on; log-probabilities are taken in float32 whatever the model's dtype.
Bad input raises SmolError naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .errors import SmolError
from .generation.logprobs import token_logprobs


@dataclasses.dataclass(frozen=True)
class Perplexity:
    nll: float  # mean negative log-likelihood (nats) of the scored tokens
    tokens: int  # tokens scored: every one but the first
    window: int
    stride: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def checked_ids(model, ids: Sequence[int], what: str) -> list[int]:
    """ids as a list of ints; SmolError unless each is a token of the model's vocabulary."""
    try:
        ids = [operator.index(i) for i in ids]
    except TypeError:
        raise SmolError(f"{what}: token ids must be integers") from None
    vocab = model.config.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise SmolError(f"{what}: token id {bad} is not in the vocabulary (0..{vocab - 1})")
    return ids


def device_of(model) -> torch.device:
    return model.model.embed_tokens.weight.device


@torch.inference_mode()
def perplexity(model, ids: Sequence[int], window: int, stride: int,
               progress: Callable[[int], None] | None = None, kv_cache_dtype: str | None = None) -> Perplexity:
    """Sliding-window perplexity of ids: windows of up to `window` tokens, `stride` apart (less than the
    window: a window's first token is scored by the one before, which holds its predecessors); each scores only
    the tokens the previous one did not. progress(n), if given, is told the number of tokens each window
    scored. kv_cache_dtype: attention reads keys and values through a KV cache that stores this ("fp32",
    "bf16", "int8"; see kv_cache.KVCache), as generation does; None: straight from the pass, unrounded."""
    ids = checked_ids(model, ids, "perplexity")
    if len(ids) < 2:
        raise SmolError(f"perplexity needs at least 2 tokens, has {len(ids)}")
    limit = model.config.max_position_embeddings
    if not 2 <= window <= limit:
        raise SmolError(f"window must be in [2, {limit}] (the model's context), got {window}")
    if not 0 < stride < window:  # a window's first token is scored by the one before, which holds its past
        raise SmolError(f"stride must be in [1, {window - 1}] (below the window, {window}), got {stride}")
    tokens = torch.tensor(ids, device=device_of(model))
    nll, scored = 0.0, 1  # tokens[1:scored] are scored; tokens[0] never is
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        # Hidden state i of the window predicts tokens[begin + i + 1]; project only the unscored ones.
        cache = None if kv_cache_dtype is None else model.new_cache(1, end - 1 - begin, kv_cache_dtype)
        h = model.hidden_states(tokens[None, begin:end - 1], cache=cache)[0, scored - begin - 1:]
        nll += F.cross_entropy(model.logits(h).float(), tokens[scored:end], reduction="sum").item()
        if progress is not None:
            progress(end - scored)
        scored = end
        if end == len(ids):
            break
    return Perplexity(nll / (scored - 1), scored - 1, window, stride)


CONTEXT = 1024  # `smollm2 perplexity`'s window, where the model's own context window is not shorter


def windowed_perplexity(model, ids: Sequence[int], context: int | None = None, stride: int | None = None,
                        progress: Callable[[int], None] | None = None,
                        kv_cache_dtype: str | None = None) -> Perplexity:
    """perplexity() as `smollm2 perplexity` measures it: windows of `context` tokens (default CONTEXT), or of the
    model's whole context window where that is shorter, moved by `stride` (default: half a window)."""
    window = min(CONTEXT if context is None else context, model.config.max_position_embeddings)
    stride = window // 2 if stride is None else stride
    if not 0 < stride < window:
        raise SmolError(f"--stride must be in [1, --context - 1 = {window - 1}], got {stride}")
    return perplexity(model, ids, window, stride, progress, kv_cache_dtype)


def checked_request(model, context: Sequence[int], continuation: Sequence[int],
                    what: str) -> tuple[list[int], list[int]]:
    context, continuation = checked_ids(model, context, f"{what}: context"), checked_ids(model, continuation,
                                                                                        f"{what}: continuation")
    if not context:
        raise SmolError(f"{what}: the context is empty (lm-eval gives the end-of-text token as context)")
    if not continuation:
        raise SmolError(f"{what}: the continuation is empty")
    limit = model.config.max_position_embeddings
    if len(context) + len(continuation) - 1 > limit:
        raise SmolError(f"{what}: context and continuation ({len(context)} + {len(continuation)} tokens) exceed "
                        f"the model's context of {limit} (+1: the last token is only predicted)")
    return context, continuation


@torch.inference_mode()
def loglikelihoods(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                   batch_size: int = 8) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): the sum of the continuation's log-probabilities given the
    context, and whether greedy decoding from the context would produce the continuation (each of its tokens
    the argmax). Requests go batch_size at a time, right-padded: the model is causal, so padding after a
    request's tokens changes none of its positions."""
    if batch_size < 1:
        raise SmolError(f"batch_size must be at least 1, got {batch_size}")
    requests = [checked_request(model, context, continuation, f"request {i}")
                for i, (context, continuation) in enumerate(requests)]
    device, results = device_of(model), []
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        inputs = [context + continuation[:-1] for context, continuation in batch]
        ids = torch.zeros(len(batch), max(map(len, inputs)), dtype=torch.long, device=device)
        for row, tokens in enumerate(inputs):
            ids[row, :len(tokens)] = torch.tensor(tokens, device=device)
        h = model.hidden_states(ids)
        for row, (context, continuation) in enumerate(batch):
            # Hidden state i predicts input token i + 1: the continuation's from the context's last on.
            start = len(context) - 1
            logits = model.logits(h[row, start:start + len(continuation)])
            scored = token_logprobs(logits, continuation)  # as the server's echo scores a prompt's tokens
            results.append((math.fsum(s.logprob for s in scored),
                            logits.argmax(-1).tolist() == list(continuation)))
    return results


def loglikelihood(model, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> tuple[float, bool]:
    """The sum of the continuation's log-probabilities given the context, and whether greedy decoding would
    produce it: one request of loglikelihoods."""
    return loglikelihoods(model, [(context_ids, continuation_ids)])[0]
