"""The static batch: prompts in, one Step per row per step out, until every row has finished.

A batch of prompts of different lengths is left-padded into one (B, T) block, so every row's next token
sits in the same column; the attention mask hides the padding and gives each row the positions it would
have alone. The prompt is prefilled into a static KV cache in fixed-size chunks (bounded memory for long
prompts), then each step feeds one token per row at the next cache slot. Each row is a Sequence, which
decides its tokens' text and when it finishes.
"""

from __future__ import annotations

from collections import abc

import torch

from ..errors import SmolError
from .grammar import Grammar
from .sampling import Sampling
from .logprobs import check_top
from .sequence import Sequence, Step, advance, check_request, prompt_rows
from .steps import cache_length, compiled_decode_step, decode_step, prefill

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


def eos_ids(eos_token_id, config) -> set[int]:
    if eos_token_id is CHECKPOINT_EOS:
        return set(config.eos_token_ids)
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


@torch.inference_mode()
def stream(model, input_ids, max_new_tokens: int = 128, *, eos_token_id=CHECKPOINT_EOS,
           stop: abc.Sequence[str] = (), tokenizer=None, compile: bool | None = None,
           conversation: Conversation | None = None, logprobs: int | None = None, response_format=None,
           **sampling) -> abc.Iterator[list[Step | None]]:
    """Yield, each step, a Step for every row (None for a row that has already finished): its new token, the
    text that became final with it (decoded when a tokenizer is given), and on its last step why it finished.

    sampling: temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, seed; see Sampling.
    A row finishes after its EOS token (eos_token_id: the checkpoint's by default, None to never stop), or
    once its text contains one of the `stop` strings (which needs `tokenizer`; its text then ends before the
    stop string), or after max_new_tokens.
    compile: run each decoding step through torch.compile. None (the default) chooses: on CUDA, yes (the
    step becomes a CUDA graph, replayed without Python); on the CPU, no: compiling takes about a minute, and
    the compiled step runs on torch's kernels instead of smollm2.kernels, slower than the eager step.
    conversation: a Conversation whose cache this one prompt continues (compile=False on CUDA): the tokens
    it shares with the previous call's are not prefilled again.
    logprobs: None (the default) or 0..20: each Step's `logprob` is then a TokenLogprob, the token's
    log-probability (log-softmax of the raw logits, before any sampling transform) and the `logprobs` most
    likely tokens at its position with theirs.
    response_format: OpenAI's, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    (needs `tokenizer` and the `structured` extra): each row may only write JSON that fits it, then its EOS.
    """
    config = model.config
    context = config.max_position_embeddings
    rows = check_request(input_ids, max_new_tokens, stop, config.vocab_size, context)
    device = model.model.embed_tokens.weight.device
    params, eos = Sampling(**sampling), eos_ids(eos_token_id, config)
    if response_format is not None and tokenizer is None:
        raise SmolError("response_format needs a tokenizer: pass tokenizer=")
    grammar = None if response_format is None else Grammar.from_response_format(response_format, tokenizer)
    sequences = [Sequence(row, max_new_tokens, params, eos, stop, tokenizer, device, check_top(logprobs), grammar)
                 for row in rows]
    if compile is None:
        compile = device.type == "cuda"
    if conversation is not None and (len(rows) > 1 or compile):
        raise SmolError("a conversation continues one prompt, decoded without compile")
    if max_new_tokens == 0:
        return
    B, T = len(rows), max(map(len, rows))
    length = cache_length(T + max_new_tokens, context) if compile else T + max_new_tokens

    # Left-padded prompts, padding as id 0; the mask, over every slot, has 0 at the padding alone.
    prompts = torch.zeros((B, T), dtype=torch.long)
    padded = any(len(row) < T for row in rows)
    attention_mask = torch.ones((B, length), dtype=torch.long) if padded else None
    for b, row in enumerate(rows):
        prompts[b, T - len(row):] = torch.tensor(row)
        if padded:
            attention_mask[b, :T - len(row)] = 0
    prompts = prompts.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)

    cache, held = conversation.reuse(model, rows[0], length) if conversation else (model.new_cache(B, length), 0)
    if compile and device.type == "cuda":
        for t in (cache.k, cache.v):  # a CUDA graph may update these in place only if they never move
            torch._dynamo.mark_static_address(t)
    step_fn = compiled_decode_step(device.type) if compile else decode_step
    h = prefill(model, prompts, cache, held, attention_mask)
    if conversation:
        conversation.tokens += rows[0][held:]
    logits = model.logits(h)  # (B, V): only the last position is needed

    for pos in range(T, T + max_new_tokens):
        next_ids, steps = advance(logits, sequences)  # (B,), a Step per unfinished row
        yield steps
        if all(s.finish_reason for s in sequences):
            return
        # Compiled: one static shape, the whole cache with unfilled slots masked; eager: the filled slots only.
        filled = length if compile else pos + 1
        logits = step_fn(model, next_ids[:, None], torch.tensor([pos], device=device),
                         cache if compile else cache.view(length=filled),
                         None if attention_mask is None else attention_mask[:, :filled])
        if conversation:
            conversation.tokens.append(steps[0].token)


def generate(model, input_ids, max_new_tokens: int = 128, **kwargs) -> torch.LongTensor:
    """The prompts followed by their new tokens, (B, T + steps), like transformers' generate.

    Prompts of different lengths are left-padded, and a row that finishes early is filled to the end, with
    the checkpoint's pad id (else its EOS id, else 0). Takes the keyword arguments of `stream`.
    """
    rows = prompt_rows(input_ids, model.config.vocab_size)
    pad = model.config.pad_token_id
    if pad is None:
        pad = next(iter(model.config.eos_token_ids), 0)
    T = max(map(len, rows))
    out = [[pad] * (T - len(row)) + row for row in rows]
    for steps in stream(model, rows, max_new_tokens, **kwargs):
        for row, step in zip(out, steps):
            row.append(pad if step is None else step.token)
    return torch.tensor(out, dtype=torch.long, device=model.model.embed_tokens.weight.device)
