"""The static batch: prompts in, one Step per row per step out, until every row has finished.

Every prompt is admitted to one engine at once and prefilled at its first step; from then on each step gives
every row still going its next token, each row at its own positions, as it would alone.
"""

from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

import torch

from ..errors import SmolError
from .engine import Engine
from .grammar import Grammar
from .hooks import Hooks
from .prefix_cache import PrefixCache
from .request import MAX_NEW_TOKENS, Names, Request, prompt_rows
from .sampling import Sampling
from .sequence import Step
from .steps import compiled_decode_step, decode_step

if TYPE_CHECKING:
    from ..model import SmolLM2
    from ..tools import Tools


@torch.inference_mode()
def stream(model, input_ids, max_new_tokens: int = MAX_NEW_TOKENS, *, eos_token_id="checkpoint",
           stop: abc.Sequence[str | int] = (), tokenizer=None, compile: bool | None = None,
           prefix_cache: PrefixCache | None = None, logprobs: int | None = None, response_format=None,
           speculative: str | SmolLM2 | None = None, tools: Tools | None = None, hooks=None,
           kv_cache_dtype: str | None = None, **sampling) -> abc.Iterator[list[Step | None]]:
    """Yield a Step for every row, a token at a time (None for a row that has finished, or that gained fewer
    tokens than another in a speculating step): its new token, the text that became final with it (decoded when
    a tokenizer is given), and on its last step why it finished.

    sampling: temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, logit_bias ({token id: bias}), min_new_tokens, seed; see Sampling.
    A row finishes after its EOS token (eos_token_id: the checkpoint's by default, None to never stop) or a token
    id in `stop`, or once its text contains one of the strings in `stop` (which needs `tokenizer`; its text then
    ends before the stop string), or after max_new_tokens; not before min_new_tokens: until then its EOS and stop
    ids are banned and stop strings let pass.
    compile: run each decoding step through torch.compile. None (the default) chooses: on CUDA, yes (the
    step becomes a CUDA graph, replayed without Python); on the CPU, no: compiling takes about a minute, and
    the compiled step runs on torch's kernels instead of smollm2.kernels, slower than the eager step.
    prefix_cache: a PrefixCache kept from call to call (a chat's turns): the whole prefill chunks a prompt
    shares with an earlier one's are copied from it, not computed, with the same bits.
    logprobs: None (the default) or 0..20: each Step's `logprob` is then a TokenLogprob, the token's
    log-probability (log-softmax of the raw logits, before any sampling transform) and the `logprobs` most
    likely tokens at its position with theirs.
    response_format: OpenAI's, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}},
    or {"type": "choice", "choices": [...]} or {"type": "regex", "pattern": ...} (needs `tokenizer`): each row
    may only write text that fits it, then its EOS.
    speculative: None; "ngram": each row guesses its next tokens by prompt lookup; or a draft model (a smaller
    SmolLM2 with the same tokenizer): each row guesses them with it, greedily. The model checks a row's guesses in
    one pass (smollm2.generation.speculative); the tokens are those of decoding without it.
    tools: a smollm2.tools.Tools (needs `tokenizer`): each row's tool calls, where its tool_choice lets it make
    them, fit the tools' names and schemas; smollm2.tools.parse_tool_calls reads them.
    hooks: (hook point name, function) pairs (smollm2.generation.hooks, as TransformerLens's fwd_hooks; steering()
    makes a steering vector's): every row's passes run op by op through them, reading or changing activations.
    kv_cache_dtype: what the KV cache stores: "fp32", "bf16" (half the memory), "int8" (a quarter, with a float32
    scale per head and position), or None (the default) for the model's dtype; see smollm2.kv_cache.KVCache.

    Its return value (StopIteration.value, or `yield from`'s) is the engine's PassCounts: its decoding passes,
    the tokens they gave, and the tokens guessed and kept by speculation.
    """
    rows = prompt_rows(input_ids)
    for name, given in (("response_format", response_format), ("tools", tools)):
        if given is not None and tokenizer is None:
            raise SmolError(f"{name} needs a tokenizer: pass tokenizer=")
    grammar = Grammar.for_answer(tokenizer, response_format, tools)
    hooks = None if hooks is None else Hooks(model.config.num_hidden_layers, hooks)
    requests = [Request(prompt, max_new_tokens, Sampling(**sampling), stop, eos_token_id, logprobs,
                        grammar=grammar, speculative=speculative, hooks=hooks,
                        names=Names(prompt=f"prompt {b}") if len(rows) > 1 else Names())
                for b, prompt in enumerate(rows)]
    rows = [request.row(model, tokenizer=tokenizer) for request in requests]
    device = model.model.embed_tokens.weight.device
    if compile is None:
        compile = device.type == "cuda" and speculative is None
    sequences = [row.sequence for row in rows]
    if all(sequence.finish_reason for sequence in sequences):  # max_new_tokens 0
        return
    engine = Engine(model, len(rows), max(len(s.prompt) + s.max_new_tokens for s in sequences),
                    prefill_budget=None, prefix_cache=prefix_cache,
                    step=compiled_decode_step(device.type) if compile else decode_step, whole_cache=compile,
                    kv_cache_dtype=kv_cache_dtype)
    for row in rows:
        engine.queue(row)
    while not all(sequence.finish_reason for sequence in sequences):
        # Every prompt is prefilled at the first step, so each step gives each row going a Step at least, and a
        # speculating row maybe more: its i-th goes in the i-th list.
        taken = {row: [] for row in rows}
        for row, step in engine.step():
            taken[row].append(step)
        for i in range(max(map(len, taken.values()))):
            yield [steps[i] if i < len(steps) else None for steps in taken.values()]
    return engine.counts


def generate(model, input_ids, max_new_tokens: int = MAX_NEW_TOKENS, **kwargs) -> torch.LongTensor:
    """The prompts followed by their new tokens, (B, T + steps), like transformers' generate.

    Prompts of different lengths are left-padded, and a row that finishes early is filled to the end, with
    the checkpoint's pad id (else its EOS id, else 0). Takes the keyword arguments of `stream`.
    """
    rows = prompt_rows(input_ids)
    pad = model.config.pad_token_id
    if pad is None:
        pad = next(iter(model.config.eos_token_ids), 0)
    T = max(map(len, rows))
    out = [[pad] * (T - len(row)) + row for row in rows]
    for steps in stream(model, rows, max_new_tokens, **kwargs):
        for row, step in zip(out, steps):
            if step is not None:
                row.append(step.token)
    width = max(map(len, out))
    out = [row + [pad] * (width - len(row)) for row in out]
    return torch.tensor(out, dtype=torch.long, device=model.model.embed_tokens.weight.device)
