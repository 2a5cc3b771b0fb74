"""A sparse dictionary's features at work (sae.load_sae's SAEs and transcoders): which features each position of
a prompt lights up, what a feature's decoder direction does to the logits, and steering by a feature.

    values, indices = top_features(model, sae, [ids], k=5)          # (1, T, 5) each
    promoted, suppressed = logit_effect(model, sae, int(indices[0, -1, 0]))   # (values, ids) each
    smollm2.generate(model, [ids], 20, hooks=feature_steering(model.config, sae, 123, scale=8.0))
"""

from __future__ import annotations

import math

import torch

from .errors import SmolError
from .generation.hooks import HookFunction, Hooks
from .lens import run_with_cache
from .sae import SAE, reads_before_writes

STREAM_POINTS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")


def top_features(model, sae: SAE, ids, k: int = 5) -> torch.return_types.topk:
    """Each position's k strongest features at the SAE's hook point: (values, indices), (B, T, k) each, the
    strongest first (a value of 0: fewer than k are active there)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= sae.W_enc.shape[1]:
        raise SmolError(f"k must be a whole number from 1 to the {sae.W_enc.shape[1]} features, got {k!r}")
    _, cache = run_with_cache(model, ids, [sae.hook_name])
    return sae.encode(cache[sae.hook_name]).topk(k, dim=-1)


def direction(sae: SAE, feature: int) -> torch.Tensor:
    """What one unit of the feature's activation adds to what the dictionary writes: its decoder row (divided by
    its norm where a TopK SAE ranks by it, as decode() does)."""
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < sae.W_dec.shape[0]:
        raise SmolError(f"feature must be a whole number from 0 to {sae.W_dec.shape[0] - 1}, got {feature!r}")
    row = sae.W_dec[feature]
    return row / row.norm() if sae.rescale_by_decoder_norm else row


def writes_to_stream(config, sae: SAE) -> bool:
    """Whether what the dictionary writes is in the residual stream, where a direction can be added to it and read
    through the output."""
    return (sae.hook_name_out == "hook_embed" or sae.hook_name_out.endswith(STREAM_POINTS)) \
        and sae.W_dec.shape[1] == config.hidden_size


def in_stream(config, sae: SAE) -> None:
    if not writes_to_stream(config, sae):
        raise SmolError(f"{sae.hook_name_out} is not in the residual stream: a feature's direction there is not one "
                        f"to add to the stream or read through the output (hook_embed, {', '.join(STREAM_POINTS)})")


@torch.inference_mode()
def logit_effect(model, sae: SAE, feature: int, k: int = 10) -> tuple[torch.return_types.topk, torch.return_types.topk]:
    """The tokens a feature's decoder direction promotes and suppresses most, read through the final norm (its
    scale frozen: it scales every logit alike, so 1) and the output projection: ((values, ids) promoted, (values,
    ids) suppressed, the most negative first), k each."""
    in_stream(model.config, sae)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= model.config.vocab_size:
        raise SmolError(f"k must be a whole number from 1 to {model.config.vocab_size}, got {k!r}")
    weight = model.model.norm.weight
    logits = model.logits(weight * direction(sae, feature).to(weight)).float()
    return logits.topk(k), (-logits).topk(k)


def feature_steering(config, sae: SAE, feature: int, scale: float | None = None,
                     clamp: float | None = None) -> list[tuple[str, HookFunction]]:
    """The hooks that steer by a feature at every position, prompt and answer alike, for
    smollm2.generate(model, ..., hooks=) or an engine row (generation.hooks.steering's way): add scale times its
    decoder direction where the dictionary writes (hook_name_out), or clamp its activation there to `clamp` (add
    (clamp - its activation) times the direction; a transcoder's activation is read at its input, hook_name, in
    the same pass)."""
    in_stream(config, sae)
    d = direction(sae, feature)
    if (scale is None) == (clamp is None):
        raise SmolError("steer by a feature with a scale (add its direction) or a clamp (set its activation), "
                        "one of them")
    value = scale if clamp is None else clamp
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SmolError(f"the {'scale' if clamp is None else 'clamp'} must be a finite number, got {value!r}")
    if clamp is None:
        hooks = [(sae.hook_name_out, lambda x, name: x + (scale * d).to(x))]
    elif not sae.transcoder:
        hooks = [(sae.hook_name, lambda x, name: x + (clamp - sae.encode(x)[..., feature, None]).to(x) * d.to(x))]
    else:
        reads_before_writes(config, sae)
        seen = {}

        def read(x, name):
            seen["activation"] = sae.encode(x)[..., feature, None]

        def write(x, name):  # the pass that read it, at once: each row's hooked pass runs alone
            return x + (clamp - seen.pop("activation")).to(x) * d.to(x)

        hooks = [(sae.hook_name, read), (sae.hook_name_out, write)]
    Hooks(config.num_hidden_layers, hooks)  # the points are the model's
    return hooks
