"""lm-evaluation-harness on smollm2, in this process: any task lm-eval knows, or one from a local YAML file.

    from smollm2.harness import run_tasks
    results = run_tasks(model, tokenizer, ["my_task"], include_path="tasks/")   # lm-eval's results dict

`HarnessModel` answers lm-eval's three kinds of request the way its own transformers model does, so the scores
compare with any other lm-eval run: texts are tokenized as lm-eval tokenizes them (a context's trailing spaces
move to the continuation; the continuation's ids are those of the whole text past the context's), an empty
context is the BOS token (else end-of-text), and a context longer than the window loses its oldest tokens.
  loglikelihood          smollm2.evaluate.loglikelihoods, batched (longest first, so padding is rare)
  loglikelihood_rolling  the text cut into lm-eval's disjoint windows, each scored as above
  generate_until         smollm2.generation.stream, one request at a time (a request's answer is then the one
                         `smollm2 serve` gives it, bit for bit), greedy unless the task samples
lm-eval is an extra (`pip install 'smollm2[eval]'`), imported when this module is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

from .errors import SmolError
from .evaluate import loglikelihoods
from .generation import stream

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until


class HarnessModel(TemplateLM):
    def __init__(self, model, tokenizer, batch_size: int = 8):
        super().__init__()
        if tokenizer.eos_token_id is None:
            raise SmolError(f"{tokenizer.source}: lm-eval needs an end-of-text token, and the tokenizer has none")
        self.model, self.smol_tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.config.max_position_embeddings

    @property
    def eot_token_id(self) -> int:
        return self.smol_tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # What an empty context and a text's first window are conditioned on: BOS where the tokenizer has one,
        # as lm-eval's own models choose.
        bos = self.smol_tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.smol_tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = []
        for _, context, continuation in requests:
            keep = self.max_length + 1 - len(continuation)  # the last token is only predicted, never read
            if keep < 1:
                raise SmolError(f"a continuation of {len(continuation)} tokens does not fit the model's window of "
                                f"{self.max_length}")
            pairs.append((context[-keep:], continuation))
        order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
        scored = loglikelihoods(self.model, [pairs[i] for i in order], self.batch_size)
        results = [None] * len(pairs)
        for i, result in zip(order, scored):
            results[i] = result
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in utils.get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                           max_seq_len=self.max_length, context_len=1):
                windows.append((None, *utils.make_disjoint_window(window)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs)
            until = gen_kwargs.pop("until", None) or [self.smol_tokenizer.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(gen_kwargs.pop("temperature", 0.0)) if gen_kwargs.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            text = "".join(step.text for (step,) in stream(self.model, [ids], max_new, stop=[u for u in until if u],
                                                           tokenizer=self.smol_tokenizer, temperature=temperature))
            answers.append(text)
        return answers


@functools.cache
def task_manager(include_path: str | None = None) -> TaskManager:
    """lm-eval's index of its tasks and those under include_path. Kept for the process: indexing the hundreds
    of built-in tasks takes seconds, and a task's files are read when it runs, not here (a task file added
    under include_path later is not seen)."""
    return TaskManager(include_path=include_path)


def run_tasks(model, tokenizer, tasks: Sequence[str], *, include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, batch_size: int = 8, log_samples: bool = False) -> dict:
    """lm-eval's simple_evaluate on the model in this process: its results dict (results, samples if asked)."""
    manager = task_manager(include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (nor in {include_path})" if include_path else ""
        raise SmolError(f"lm-eval knows no task {', '.join(map(repr, unknown))}{where}")
    return simple_evaluate(model=HarnessModel(model, tokenizer, batch_size), tasks=list(tasks), task_manager=manager,
                           limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
