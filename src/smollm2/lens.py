"""See inside the model: every activation of a pass under TransformerLens's names (run_with_cache), what each
layer's residual stream would predict (logit_lens), and a steering vector from two prompts. Where a pass's time
goes is roofline.py's, beside bench.py: speed is not what this module reads.

All of it runs model.py's own forward through its hook points (generation/hooks.py), on torch's operations even
in an accelerated model (its kernels set aside), so that what is read is what model.py computes.

    logits, cache = run_with_cache(model, ids)          # cache["blocks.3.attn.hook_pattern"]: (B, heads, T, T)
    probs, top = logit_lens(model, residual_stream(cache), top_k=5)    # (layers + 1, B, T, 5) each
"""

from __future__ import annotations

import contextlib
from collections import abc

import torch

from .errors import SmolError
from .generation.hooks import Hooks, point_names
from .generation.request import checked_rows

MIN_STEERING_TOKENS = 2  # a steering text's: its last token past position 0, the attention sink, whose stream is
# unlike any other's (in SmolLM2-135M, many times their norm in most blocks): a difference there means nothing
LENS_ROWS = 256  # positions whose logits one step of the logit lens holds at once: 256 x 49152 floats, 50 MB


def reference_math(model) -> contextlib.AbstractContextManager:
    """Inside, an accelerated model runs torch's operations alone (in this thread); any other runs as it is."""
    accelerator = model.__dict__.get("accelerator")
    return accelerator.choices.torch_only() if accelerator is not None else contextlib.nullcontext()


def token_rows(model, ids) -> torch.Tensor:
    """ids as run_with_cache takes them (a list of ids, a list of equally long lists, or a (T,) / (B, T) tensor),
    checked, as a (B, T) tensor on the model's device."""
    rows = checked_rows(ids, model.config)
    if len({len(row) for row in rows}) > 1:
        raise SmolError(f"the prompts must be equally long (no padding here), got lengths {[len(r) for r in rows]}")
    return torch.tensor(rows, device=model.model.embed_tokens.weight.device)


@torch.inference_mode()
def run_with_cache(model, ids, names: abc.Iterable[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits, (B, T, V), and the activations at the hook points `names` (default: all), by name, as
    TransformerLens's run_with_cache returns them."""
    ids = token_rows(model, ids)
    layers = model.config.num_hidden_layers
    cache = {}

    def keep(x, name):
        cache[name] = x

    hooks = Hooks(layers, [(name, keep) for name in (point_names(layers) if names is None else names)])
    with reference_math(model):
        logits = model.logits(hooks.hidden_states(model, ids))
    return logits, cache


def residual_stream(cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """The residual stream entering each block, then leaving the last: (layers + 1, B, T, C), from a cache that
    holds every hook_resid_pre and the last hook_resid_post."""
    layers = sum(name.endswith(".hook_resid_pre") for name in cache)
    return torch.stack([*(cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(layers)),
                        cache[f"blocks.{layers - 1}.hook_resid_post"]])


@torch.inference_mode()
def logit_lens(model, residual: torch.Tensor, top_k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """What each residual state (..., C) would predict, read through the final norm and the output projection as
    if the blocks after it were not there: the top_k probabilities and their token ids, (..., top_k) each. The
    last layer's is the model's own prediction."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= model.config.vocab_size:
        raise SmolError(f"top_k must be a whole number from 1 to {model.config.vocab_size}, got {top_k!r}")
    rows = residual.reshape(-1, residual.shape[-1])
    probs, ids = [], []
    with reference_math(model):
        for part in rows.split(LENS_ROWS):
            p, i = model.logits(model.model.norm(part)).float().softmax(-1).topk(top_k, dim=-1)
            probs.append(p)
            ids.append(i)
    shape = (*residual.shape[:-1], top_k)
    return torch.cat(probs).reshape(shape), torch.cat(ids).reshape(shape)


@torch.inference_mode()
def steering_vector(model, toward: list[int], away: list[int], layer: int) -> torch.Tensor:
    """The residual stream entering block `layer` at the last token of `toward` less that at the last token of
    `away` (say, the ids of "I went to a wedding" and of "I went to a funeral"): a direction to add to the stream
    there (hooks.steering). Each needs MIN_STEERING_TOKENS tokens at least."""
    for what, ids in (("toward", toward), ("away", away)):
        if len(ids) < MIN_STEERING_TOKENS:
            raise SmolError(f"{what}: a steering text needs {MIN_STEERING_TOKENS} tokens at least, got {len(ids)}: "
                            f"the first position's stream is the attention sink's, unlike any other's")
    name = f"blocks.{layer}.hook_resid_pre"
    states = [run_with_cache(model, [ids], [name])[1][name][0, -1] for ids in (toward, away)]
    return states[0] - states[1]
