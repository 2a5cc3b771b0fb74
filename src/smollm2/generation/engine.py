"""Generation: prompts in, one token per row per step out.

A batch of prompts of different lengths is left-padded into one (B, T) block, so every row's next token
sits in the same column; the attention mask hides the padding and gives each row the positions it would
have alone. The prompt is prefilled into a static KV cache in fixed-size chunks (bounded memory for long
prompts), then each step feeds one token per row at the next cache slot.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..errors import SmolError
from .sampling import Sampler, Sampling

PREFILL_CHUNK = 512
CACHE_BLOCK = 256  # compiled steps see cache lengths in these steps, so new lengths rarely recompile


def decode_step(model, ids, input_pos, cache, attention_mask) -> torch.Tensor:
    """One token per row at slot input_pos -> next-token logits, (B, V)."""
    return model.logits(model.hidden_states(ids, input_pos, cache, attention_mask))[:, -1]


@functools.cache
def compiled_decode_step(device_type: str):
    # CUDA: CUDA graphs replay the whole step without Python; CPU: inductor fuses the small ops.
    return torch.compile(decode_step, mode="reduce-overhead" if device_type == "cuda" else None)


def prefill(model, ids, cache, start: int = 0, attention_mask=None) -> torch.Tensor:
    """Prompt ids (B, T) into the cache from slot `start` on, PREFILL_CHUNK tokens at a time (bounded memory);
    returns the last position's hidden state, (B, C). Each chunk's attention reads only the slots filled so far:
    the first chunk of an unpadded prompt is plain causal, which the CPU kernel computes half of."""
    T = ids.shape[1]
    for begin in range(start, T, PREFILL_CHUNK):
        end = min(begin + PREFILL_CHUNK, T)
        h = model.hidden_states(ids[:, begin:end], torch.arange(begin, end, device=ids.device),
                                cache.view(length=end), None if attention_mask is None else attention_mask[:, :end],
                                last_only=True)
    return h[:, -1]


def cache_length(n: int, limit: int, block: int = CACHE_BLOCK) -> int:
    """n slots rounded up to a whole number of blocks (at most limit): fewer distinct cache shapes."""
    return min(-(-n // block) * block, limit)


CHECKPOINT_EOS = object()  # "use the checkpoint's EOS ids", distinct from None ("never stop")


class Conversation:
    """One row's KV cache kept from one stream() call to the next, with the tokens it holds: a prompt that
    starts with them (a chat's history, sent again each turn) prefills only the rest."""

    def __init__(self):
        self.cache = None  # KVCache of one row, or None
        self.tokens: list[int] = []  # the tokens whose keys and values fill its first slots

    def reuse(self, model, prompt: list[int], length: int):
        """A cache of at least `length` slots, and how many of the prompt's first tokens it already holds
        (at most all but the last, whose logits the next token needs)."""
        same = next((i for i, (a, b) in enumerate(zip(self.tokens, prompt[:-1])) if a != b),
                    min(len(self.tokens), len(prompt) - 1))
        if self.cache is None or self.cache.max_len < length:  # grown in doublings, up to the context window
            old = self.cache
            self.cache = model.new_cache(1, min(max(length, 2 * (old.max_len if old else 0)),
                                                model.config.max_position_embeddings))
            if old is not None:
                self.cache.k[..., :same, :] = old.k[..., :same, :]
                self.cache.v[..., :same, :] = old.v[..., :same, :]
        del self.tokens[same:]
        return self.cache, same


def prompt_rows(input_ids, vocab_size: int) -> list[list[int]]:
    """A (T,) or (B, T) tensor, a list of ids, or a list of id lists -> one list of ids per row, checked."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2) or input_ids.dtype.is_floating_point:
            raise SmolError(f"input_ids must be a (T,) or (B, T) tensor of token ids, got {input_ids.dtype} "
                            f"of shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, Sequence) or isinstance(input_ids, (str, bytes)):
        raise SmolError(f"input_ids must be token ids, not {type(input_ids).__name__}")
    rows = [list(input_ids)] if not input_ids or not isinstance(input_ids[0], Sequence) else \
        [list(row) for row in input_ids]
    for b, row in enumerate(rows):
        where = f"prompt {b}" if len(rows) > 1 else "the prompt"
        if not row:
            raise SmolError(f"{where} is empty: give at least one token")
        for t in row:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise SmolError(f"{where} holds {t!r}, not a token id in [0, {vocab_size})")
    return rows


def eos_ids(eos_token_id, config) -> set[int]:
    if eos_token_id is CHECKPOINT_EOS:
        return set(config.eos_token_ids)
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


@torch.inference_mode()
def stream(model, input_ids, max_new_tokens: int = 128, *, eos_token_id=CHECKPOINT_EOS,
           stop: Sequence[str] = (), tokenizer=None, compile: bool | None = None,
           conversation: Conversation | None = None, **sampling) -> Iterator[list[int | None]]:
    """Yield, each step, the new token of every row (None for a row that has already stopped).

    sampling: temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, seed; see Sampling.
    A row stops after its EOS token (eos_token_id: the checkpoint's by default, None to never stop), or
    once its text contains one of the `stop` strings (which needs `tokenizer`), or after max_new_tokens.
    compile: run each decoding step through torch.compile. None (the default) chooses: on CUDA, yes (the
    step becomes a CUDA graph, replayed without Python); on the CPU, no: compiling takes about a minute, and
    the compiled step runs on torch's kernels instead of smollm2.kernels, slower than the eager step.
    conversation: a Conversation whose cache this one prompt continues (compile=False on CUDA): the tokens
    it shares with the previous call's are not prefilled again.
    """
    config = model.config
    rows = prompt_rows(input_ids, config.vocab_size)
    sampler_config = Sampling(**sampling)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise SmolError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if stop and tokenizer is None:
        raise SmolError("stop strings need a tokenizer: pass tokenizer=")
    B, T = len(rows), max(map(len, rows))
    context = config.max_position_embeddings
    if T + max_new_tokens > context:
        raise SmolError(f"the prompt ({T} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                        f"context window of {context} tokens")
    if max_new_tokens == 0:
        return
    eos = eos_ids(eos_token_id, config)
    device = model.model.embed_tokens.weight.device
    if compile is None:
        compile = device.type == "cuda"
    if conversation is not None and (B > 1 or compile):
        raise SmolError("a conversation continues one prompt, decoded without compile")
    length = T + max_new_tokens

    # history: every row's tokens so far, left-aligned to column T; -1 where a row has none.
    history = torch.full((B, length), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        history[b, T - len(row):T] = torch.tensor(row)
    history = history.to(device)
    padded = any(len(row) < T for row in rows)
    attention_mask = (history >= 0).long() if padded else None
    if attention_mask is not None:
        attention_mask[:, T:] = 1  # slots the generated tokens will fill

    if compile:
        length = cache_length(length, context)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (0, length - attention_mask.shape[1]), value=1)
    cache, held = conversation.reuse(model, rows[0], length) if conversation else (model.new_cache(B, length), 0)
    if compile and device.type == "cuda":
        for t in (cache.k, cache.v):  # a CUDA graph may update these in place only if they never move
            torch._dynamo.mark_static_address(t)
    step_fn = compiled_decode_step(device.type) if compile else decode_step
    h = prefill(model, history[:, :T].clamp(min=0), cache, held, attention_mask)  # padding as id 0
    if conversation:
        conversation.tokens += rows[0][held:]
    logits = model.logits(h)  # (B, V): only the last position is needed

    sample = Sampler(sampler_config, B, device)
    decoders = [tokenizer.stream_decoder() for _ in rows] if stop else []
    texts = [""] * B
    done = [False] * B
    for step in range(max_new_tokens):
        pos = T + step
        next_ids = sample(logits, history[:, :pos])  # (B,)
        history[:, pos] = next_ids
        new = next_ids.tolist()
        yield [None if done[b] else new[b] for b in range(B)]
        for b in range(B):
            if done[b]:
                continue
            if new[b] in eos:
                done[b] = True
            elif decoders:
                texts[b] += decoders[b].step(new[b])
                done[b] = any(s in texts[b] for s in stop)
        if all(done) or step == max_new_tokens - 1:
            return
        # Compiled: one static shape, the whole cache with unfilled slots masked; eager: the filled slots only.
        filled = length if compile else pos + 1
        logits = step_fn(model, next_ids[:, None], torch.tensor([pos], device=device),
                         cache if compile else cache.view(length=filled),
                         None if attention_mask is None else attention_mask[:, :filled])
        if conversation:
            conversation.tokens.append(new[0])


def generate(model, input_ids, max_new_tokens: int = 128, **kwargs) -> torch.LongTensor:
    """The prompts followed by their new tokens, (B, T + steps), like transformers' generate.

    Prompts of different lengths are left-padded, and a row that stops early is filled to the end, with
    the checkpoint's pad id (else its EOS id, else 0). Takes the keyword arguments of `stream`.
    """
    rows = prompt_rows(input_ids, model.config.vocab_size)
    pad = model.config.pad_token_id
    if pad is None:
        pad = next(iter(model.config.eos_token_ids), 0)
    T = max(map(len, rows))
    out = [[pad] * (T - len(row)) + row for row in rows]
    for step in stream(model, rows, max_new_tokens, **kwargs):
        for row, token in zip(out, step):
            row.append(pad if token is None else token)
    return torch.tensor(out, dtype=torch.long, device=model.model.embed_tokens.weight.device)
