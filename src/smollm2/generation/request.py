"""One request to the model, whichever way it comes: generate()/stream() and the CLI in Python, or any of the
server's APIs (each API's body makes one: its to_request method). Its defaults are stated here, once.

A request is checked in two steps, both here: its own fields as it is made (__post_init__), and against the model
that runs it (its vocabulary, its context window, its EOS ids) as it becomes an engine row (row(), which
generate()/stream() and the server both call). An error names the field as the request's API calls it (names).
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import FieldError, SmolError
from .engine import Row
from .grammar import Grammar
from .hooks import Hooks
from .logprobs import check_top
from .sampling import Sampling, whole
from .sequence import Sequence
from .speculative import check_speculative

if TYPE_CHECKING:
    from ..model import SmolLM2

MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class Names:
    """What a request's API calls the fields a check may find wrong: the library's own names by default. entries:
    an error in one entry of a list or a map names the entry (stop_token_ids.1, logit_bias.5), as the server's do."""
    prompt: str = "prompt"
    max_new_tokens: str = "max_new_tokens"
    min_new_tokens: str = "min_new_tokens"
    stop: str = "stop"
    logit_bias: str = "logit_bias"
    entries: bool = False


@dataclass(frozen=True)
class Request:
    """prompt: token ids. max_new_tokens: None is up to the context window. stop: strings (which need a tokenizer:
    the text ends before the first) and token ids (ending the answer as EOS does). eos_token_id: "checkpoint" (the
    model's EOS ids), None (never stop), or ids. logprobs / prompt_logprobs: None, or each generated (prompt) token's
    log-probability with its position's top n. grammar: what the answer must fit. speculative: None, "ngram"
    (prompt lookup) or a draft model (a SmolLM2 of the model's vocabulary): the same tokens either way. hooks: the
    hook points its passes run through, alone (steering). adapter: the served model that answers it (the base or
    a LoRA adapter, by name: the server's choice of engine thread). names: what its API calls its fields, which
    its errors name."""
    prompt: list[int]
    max_new_tokens: int | None = MAX_NEW_TOKENS
    sampling: Sampling = Sampling()
    stop: tuple[str | int, ...] = ()
    eos_token_id: int | abc.Collection[int] | None | Literal["checkpoint"] = "checkpoint"
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    speculative: Literal["ngram"] | SmolLM2 | None = None
    hooks: Hooks | None = None
    adapter: str | None = None
    names: Names = field(default=Names(), compare=False)

    def __post_init__(self):
        names = self.names
        if not isinstance(self.prompt, list):
            raise FieldError(names.prompt, f"must be a list of token ids, not {type(self.prompt).__name__}")
        if not self.prompt:
            raise FieldError(names.prompt, "the prompt is empty: give at least one token")
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, abc.Iterable):
            raise FieldError(names.stop, f"must be a list of non-empty strings and token ids, got {self.stop!r:.80}")
        m = self.max_new_tokens
        if m is not None and not whole(m):
            raise FieldError(names.max_new_tokens, f"must be a whole number >= 0, got {m!r}")
        if m is not None and self.sampling.min_new_tokens > m:
            raise FieldError(names.min_new_tokens,
                             f"{self.sampling.min_new_tokens} exceeds {names.max_new_tokens} ({m})")
        if self.grammar is not None and self.sampling.min_new_tokens:
            raise FieldError(names.min_new_tokens, f"{names.min_new_tokens} cannot be combined with response_format: "
                             "the grammar decides where the answer ends")
        check_top(self.logprobs)
        check_top(self.prompt_logprobs, "prompt_logprobs")

    def row(self, model, window: int | None = None, tokenizer=None) -> Row:
        """The engine row of this request on `model`, once the request fits it: its prompt and stop ids in the
        model's vocabulary, its prompt and new tokens within `window` (the engine's rows' length; the model's
        context window by default), a draft model of its vocabulary; stop strings with a tokenizer. EOS: the
        model's, unless the request says otherwise."""
        config, names = model.config, self.names
        vocab_size, window = config.vocab_size, window or config.max_position_embeddings
        for t in self.prompt:
            check_token_id(t, vocab_size, names.prompt)
        for j, s in enumerate(self.stop):
            if not ((isinstance(s, str) and s) or token_id(s, vocab_size)):
                raise FieldError(f"{names.stop}.{j}" if names.entries else names.stop,
                                 f"must be non-empty strings and token ids in [0, {vocab_size}), got {s!r:.80}")
        for t in self.sampling.logit_bias or ():
            check_token_id(t, vocab_size, f"{names.logit_bias}.{t}" if names.entries else names.logit_bias)
        n, m = len(self.prompt), self.max_new_tokens
        if n + min(1 if m is None else m, 1) > window:
            raise FieldError(names.prompt, f"the prompt ({n} tokens) leaves no room in the context window of "
                             f"{window} tokens")
        if m is None:
            m = window - n
        elif n + m > window:
            raise FieldError(names.max_new_tokens, f"the prompt ({n} tokens) plus {names.max_new_tokens} ({m}) "
                             f"exceeds the context window of {window} tokens")
        check_speculative(self.speculative, vocab_size)
        eos = self.eos_token_id
        eos = config.eos_token_ids if eos == "checkpoint" else () if eos is None else [eos] if whole(eos) else eos
        device = model.model.embed_tokens.weight.device
        sequence = Sequence(self.prompt, m, self.sampling, eos, self.stop, tokenizer, device, self.logprobs,
                            self.grammar)
        return Row(sequence, self.prompt_logprobs, speculative=self.speculative, hooks=self.hooks)


def token_id(t, vocab_size: int) -> bool:
    return whole(t) and t < vocab_size


def check_token_id(t, vocab_size: int, field: str) -> None:
    """The one vocabulary check, wherever a token id comes from (a request's prompt or logit_bias, rows a model runs
    whole, /detokenize's tokens, /inspect/graph's target): a FieldError naming `field` unless `t` is one of
    `vocab_size` tokens' ids."""
    if not token_id(t, vocab_size):
        raise FieldError(field, f"{t!r} is not a token id in [0, {vocab_size})")


def prompt_rows(input_ids) -> list[list[int]]:
    """A (T,) or (B, T) tensor, a list of ids, or a list of id lists -> one list of ids per row, each non-empty and
    of whole numbers (the model's vocabulary is checked as each becomes a Request's row)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2) or input_ids.dtype.is_floating_point:
            raise SmolError(f"input_ids must be a (T,) or (B, T) tensor of token ids, got {input_ids.dtype} "
                            f"of shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, abc.Sequence) or isinstance(input_ids, (str, bytes)):
        raise SmolError(f"input_ids must be token ids, not {type(input_ids).__name__}")
    rows = [list(input_ids)] if not input_ids or not isinstance(input_ids[0], abc.Sequence) else \
        [list(row) for row in input_ids]
    for b, row in enumerate(rows):
        where = f"prompt {b}" if len(rows) > 1 else "the prompt"
        if not row:
            raise SmolError(f"{where} is empty: give at least one token")
        bad = next((t for t in row if not whole(t)), None)
        if bad is not None:
            raise SmolError(f"{where} holds {bad!r}, not a token id")
    return rows


def checked_rows(input_ids, config, window: int | None = None, where: str = "prompt") -> list[list[int]]:
    """Token ids (as prompt_rows takes them) that a model runs whole, not as a Request (embeddings, the lens):
    one list per row, each of the model's token ids and within `window` tokens (its context window by default)."""
    rows, window = prompt_rows(input_ids), window or config.max_position_embeddings
    for b, row in enumerate(rows):
        at = where if len(rows) == 1 else f"prompt {b}"
        for t in row:
            check_token_id(t, config.vocab_size, at)
        if len(row) > window:
            raise FieldError(at, f"{len(row)} tokens exceed the context window of {window} tokens")
    return rows
