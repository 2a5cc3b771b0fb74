"""Which activations a behaviour depends on. Activation patching: run a corrupted prompt again and again, each
time with one hook point's activation at one position (and one head, where the point has heads) taken from a
clean prompt's run, and measure how far a metric of the logits comes back. Attribution patching: its linear
approximation, (clean - corrupted activation) . d metric / d activation at the corrupted run, for every position
and head at once from one backward pass (TransformerLens's attribution_patch; Nanda, "Attribution Patching",
2023).

    paris, rome = tok.encode(" Paris")[0], tok.encode(" Rome")[0]
    metric = lambda logits: logits[0, -1, paris] - logits[0, -1, rome]        # logits: (B, T, V) -> a scalar
    patched = patch(model, clean, corrupted, metric, ["blocks.3.hook_resid_pre", "blocks.3.attn.hook_z"])
    # patched["blocks.3.hook_resid_pre"]: (T,), patched["blocks.3.attn.hook_z"]: (T, heads)

Both run the reference math through the hook points, as lens.run_with_cache does.
"""

from __future__ import annotations

from collections import abc

import torch

from .errors import SmolError
from .generation.hooks import Hooks
from .lens import reference_math, run_with_cache, token_rows

# The points with heads, and where: (B, T, heads, head_dim), or (B, heads, T query positions, S key slots).
HEADS_AFTER_POSITIONS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
                         "attn.hook_z")
HEADS_BEFORE_POSITIONS = ("attn.hook_attn_scores", "attn.hook_pattern")
PATCH_TOKENS = 512  # tokens one batched pass of patched runs holds: their logits, 512 x 49152 floats, 100 MB

Metric = abc.Callable[[torch.Tensor], torch.Tensor]


def has_heads(name: str) -> bool:
    return name.endswith(HEADS_AFTER_POSITIONS + HEADS_BEFORE_POSITIONS)


def by_position(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation at point `name` as a view (B, T, ...), its heads next where it has them: (B, T, heads, ...)."""
    return x.transpose(1, 2) if name.endswith(HEADS_BEFORE_POSITIONS) else x


def scalar(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    value = metric(logits)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise SmolError(f"the metric must map the logits, (B, T, V), to a tensor of one number, got "
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    return value.reshape(()).float()


def pair(model, clean_ids, corrupted_ids, metric: Metric, hook_names) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The two prompts as (B, T) tensors of one shape, and the hook names as a list, checked."""
    clean, corrupted = token_rows(model, clean_ids), token_rows(model, corrupted_ids)
    if clean.shape != corrupted.shape:
        raise SmolError(f"the clean and corrupted prompts must have the same shape (rows, tokens), got "
                        f"{tuple(clean.shape)} and {tuple(corrupted.shape)}")
    if not callable(metric):
        raise SmolError(f"the metric must be a function of the logits, got {metric!r}")
    if isinstance(hook_names, str) or not isinstance(hook_names, abc.Iterable):
        raise SmolError(f"hook_names must be a list of hook point names, got {hook_names!r}")
    names = list(dict.fromkeys(hook_names))
    Hooks(model.config.num_hidden_layers, [(name, lambda x, name: None) for name in names])  # checks each name
    return clean, corrupted, names


def hooked_logits(model, ids: torch.Tensor, hooks: list) -> torch.Tensor:
    with reference_math(model):
        return model.logits(Hooks(model.config.num_hidden_layers, hooks).hidden_states(model, ids))


@torch.inference_mode()
def patch(model, clean_ids, corrupted_ids, metric: Metric, hook_names: abc.Iterable[str]) -> dict[str, torch.Tensor]:
    """Activation patching: {hook name: the metric of the corrupted run with that point's activation at one
    position (and head) taken from the clean run}, (T,) by position, or (T, heads) where the point has heads
    (attn.hook_q, k, v, rot_q, rot_k, z: k's and v's are the key-value heads; attn_scores and pattern: by query
    position). Every row of the prompts is patched at once. Many patched runs travel in one batched pass."""
    clean, corrupted, names = pair(model, clean_ids, corrupted_ids, metric, hook_names)
    B, T = clean.shape
    _, cache = run_with_cache(model, clean, names)
    found = {}
    for name in names:
        shape = by_position(cache[name], name).shape[1:3 if has_heads(name) else 2]
        # every position (and head): (T [* heads], 1 [or 2])
        sites = torch.cartesian_prod(*(torch.arange(n, device=clean.device) for n in shape)).reshape(-1, len(shape))
        values = []
        for part in sites.split(max(1, PATCH_TOKENS // (B * T))):
            rows = torch.arange(len(part) * B, device=clean.device)
            where = part.repeat_interleave(B, 0).unbind(1)  # each row's position (and head)

            def patched(x, name, rows=rows, where=where):
                x = x.clone()
                by_position(x, name)[(rows, *where)] = by_position(cache[name], name)[(rows % B, *where)]
                return x

            logits = hooked_logits(model, corrupted.repeat(len(part), 1), [(name, patched)])
            values += [scalar(metric, run) for run in logits.split(B)]
        found[name] = torch.stack(values).reshape(shape)
    return found


def attribution_patch(model, clean_ids, corrupted_ids, metric: Metric,
                      hook_names: abc.Iterable[str]) -> dict[str, torch.Tensor]:
    """Attribution patching: {hook name: (clean - corrupted activation) . d metric / d activation at the corrupted
    run, summed over the hidden dimension (the head's, where the point has heads) and the rows}, shaped as patch()
    returns, estimating patch()'s values less the corrupted run's metric. One forward pass of the clean prompt,
    one forward and one backward of the corrupted."""
    clean, corrupted, names = pair(model, clean_ids, corrupted_ids, metric, hook_names)
    _, cache = run_with_cache(model, clean, names)
    seen, nudges = {}, {}

    def keep(x, name):
        # A zero added where the gradient is wanted: unlike a detached copy, it leaves the gradient flowing to the
        # points before it, and asks for none of the weights'.
        seen[name], nudges[name] = x.detach(), torch.zeros_like(x, requires_grad=True)
        return x + nudges[name]

    with torch.enable_grad():
        value = scalar(metric, hooked_logits(model, corrupted, [(name, keep) for name in names]))
        if not value.requires_grad:
            raise SmolError("the metric must be computed from the logits it is given (it has no gradient)")
        grads = torch.autograd.grad(value, [nudges[name] for name in names], allow_unused=True)
    found = {}
    for name, grad in zip(names, grads):
        # where the two runs agree, no difference: also where both hold attn_scores' -inf (masked), not NaN
        difference = torch.where(cache[name] == seen[name], 0, cache[name] - seen[name])
        effect = by_position(difference * (0 if grad is None else grad), name)
        found[name] = effect.flatten(3 if has_heads(name) else 2).sum((0, -1)).float()
    return found
