"""Features in Python: each position's strongest features, a feature's logit effect (against the logit lens of
its direction), and steering by a feature in the engine: the steered row changes its answer, the rows beside it
keep their bits."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, as_variant, tiny_model
from smollm2 import lens
from smollm2.errors import SmolError
from smollm2.features import feature_steering, logit_effect, top_features
from smollm2.generation.engine import Engine
from smollm2.generation.hooks import Hooks
from smollm2.generation.sampling import Sampling
from smollm2.generation.sequence import Sequence
from smollm2.sae import SAE

D_SAE, FEATURE, TOKEN = 32, 5, 7


def dictionary(config, reads: str, writes: str | None = None, seed: int = 0) -> SAE:
    """A random ReLU SAE at `reads` (or a transcoder from `reads` to `writes`), its feature FEATURE's decoder
    direction the unembedding of token TOKEN."""
    generator = torch.Generator().manual_seed(seed)
    C = config.hidden_size
    W_dec = 0.1 * torch.randn(D_SAE, C, generator=generator)
    W_dec[FEATURE] = tiny_model(config).output_weight[TOKEN].detach() / 0.02  # entries about N(0, 1)
    encoder = C ** -0.5 * torch.randn(C, D_SAE, generator=generator)
    return SAE(reads, writes or reads, "relu", writes is not None, encoder,
               0.1 * torch.randn(D_SAE, generator=generator), W_dec, torch.zeros(C), None, None, None,
               writes is None, False)


def test_top_features_and_logit_effect():
    config = TINY["gqa"]
    model = tiny_model(config)
    sae = dictionary(config, "blocks.1.hook_resid_pre")
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    values, indices = top_features(model, sae, ids, k=4)
    _, cache = lens.run_with_cache(model, ids, [sae.hook_name])
    every = sae.encode(cache[sae.hook_name])
    assert values.shape == indices.shape == (2, 6, 4)
    torch.testing.assert_close(values, every.gather(-1, indices), atol=0, rtol=0)
    assert bool((values[..., -1:] >= every.topk(5, dim=-1).values[..., -1:]).all())  # none stronger left out
    promoted, suppressed = logit_effect(model, sae, FEATURE, k=10)
    assert int(promoted.indices[0]) == TOKEN
    # the logit lens of the direction (the final norm with its own scale: one number for all logits) agrees
    direction = sae.W_dec[FEATURE]
    _, up = lens.logit_lens(model, direction[None], top_k=10)
    _, down = lens.logit_lens(model, -direction[None], top_k=10)
    assert promoted.indices.tolist() == up[0].tolist() and suppressed.indices.tolist() == down[0].tolist()
    assert bool((promoted.values[:-1] >= promoted.values[1:]).all()) and bool((suppressed.values > 0).all())


def answers(model, prompts, steered: set[int], hooks) -> list[list]:
    """Each prompt's tokens and log-probabilities from one engine, the rows in `steered` with `hooks`."""
    hooks = Hooks(model.config.num_hidden_layers, hooks)
    engine = Engine(model, len(prompts), 64, prefill_budget=None)
    sequences = [Sequence(prompt, 8, Sampling(), eos=(), logprobs=2) for prompt in prompts]
    rows = [engine.admit(sequence, hooks=hooks if b in steered else None) for b, sequence in enumerate(sequences)]
    found = {row: [] for row in rows}
    while not all(s.finish_reason for s in sequences):
        for row, step in engine.step():
            found[row].append((step.token, step.logprob))
    return list(found.values())


@pytest.mark.parametrize("how", ["add", "clamp_sae", "clamp_transcoder"])
def test_a_row_steered_by_a_feature_leaves_the_other_rows_bits(how):
    config = TINY["gqa"]
    model = as_variant(tiny_model(config), "accelerated")
    if how == "add":
        hooks = feature_steering(config, dictionary(config, "blocks.1.hook_resid_pre"), FEATURE, scale=50.0)
    elif how == "clamp_sae":
        hooks = feature_steering(config, dictionary(config, "blocks.1.hook_resid_post"), FEATURE, clamp=50.0)
    else:
        hooks = feature_steering(config, dictionary(config, "blocks.1.hook_resid_mid", "blocks.1.hook_mlp_out"),
                                 FEATURE, clamp=50.0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 11, 7)]
    plain = answers(model, prompts, set(), hooks)
    steered = answers(model, prompts, {1}, hooks)
    assert steered[0] == plain[0] and steered[2] == plain[2]  # tokens and log-probabilities, exactly
    assert [t for t, _ in steered[1]] == [TOKEN] * 8 != [t for t, _ in plain[1]]
    assert steered[1] == answers(model, [prompts[1]], {0}, hooks)[0]  # as it is steered alone


def test_bad_feature_requests_are_smol_errors():
    config = TINY["gqa"]
    model = tiny_model(config)
    sae = dictionary(config, "blocks.1.hook_resid_pre")
    with pytest.raises(SmolError, match="feature must be a whole number from 0 to 31"):
        feature_steering(config, sae, D_SAE, scale=1.0)
    with pytest.raises(SmolError, match="a scale .* or a clamp .*, one of them"):
        feature_steering(config, sae, 0, scale=1.0, clamp=2.0)
    with pytest.raises(SmolError, match="the clamp must be a finite number"):
        feature_steering(config, sae, 0, clamp=float("nan"))
    with pytest.raises(SmolError, match="not in the residual stream"):
        logit_effect(model, dictionary(config, "blocks.1.ln2.hook_normalized"), 0)
    with pytest.raises(SmolError, match="no hook point 'blocks.2.hook_resid_pre'"):
        feature_steering(config, dictionary(config, "blocks.2.hook_resid_pre"), 0, scale=1.0)
    with pytest.raises(SmolError, match="k must be a whole number from 1 to the 32 features"):
        top_features(model, sae, [[1, 2]], k=0)
