"""Seeing inside: the hook points' pass equals the model, run_with_cache and the logit lens equal transformers'
hidden states and attentions, hooks read and change activations during generation, and a steered row leaves the
other rows' bits alone."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, as_variant, hf_copy, tiny_model, torch_row_variance
from smollm2 import generate, lens
from smollm2.errors import SmolError
from smollm2.generation.sampling import Sampling
from smollm2.generation.sequence import Sequence
from smollm2.generation.engine import Engine
from smollm2.generation.hooks import BLOCK_POINTS, Hooks, point_names, steering
from smollm2.model import RMSNorm


@pytest.fixture(params=sorted(TINY))
def config(request):
    return TINY[request.param]


def random_ids(config, shape, seed=0):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def hf_eager(model):
    hf = hf_copy(model)
    hf.set_attn_implementation("eager")  # the only one that returns attention patterns
    return hf


def test_the_hooked_pass_equals_the_model_with_and_without_a_cache(config, variant):
    model = as_variant(tiny_model(config), variant)
    ids = random_ids(config, (2, 21))
    hooks = Hooks(config.num_hidden_layers, [])
    with torch.inference_mode():
        whole = model.hidden_states(ids)
        assert torch.allclose(hooks.hidden_states(model, ids), whole, atol=1e-5)
        cache = model.new_cache(2, 32)  # two chunks, then one token at a time, as the engine feeds a row
        parts = [hooks.hidden_states(model, ids[:, :12], torch.arange(12), cache.view(length=12)),
                 hooks.hidden_states(model, ids[:, 12:20], torch.arange(12, 20), cache.view(length=20)),
                 hooks.hidden_states(model, ids[:, 20:], torch.tensor([[20], [20]]), cache.view(length=21))]
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-5)


def test_run_with_cache_and_the_logit_lens_equal_transformers(config):
    model = tiny_model(config)
    ids = random_ids(config, (2, 13))
    logits, cache = lens.run_with_cache(model, ids)
    with torch.no_grad():
        hf = hf_eager(model)(ids, output_hidden_states=True, output_attentions=True)
    layers = config.num_hidden_layers
    assert list(cache) == point_names(layers)  # every point, in the order the pass reaches them
    residual = lens.residual_stream(cache)
    assert residual.shape == (layers + 1, 2, 13, config.hidden_size)
    for layer in range(layers):
        assert torch.allclose(residual[layer], hf.hidden_states[layer], atol=1e-5)
        assert torch.allclose(cache[f"blocks.{layer}.attn.hook_pattern"], hf.attentions[layer], atol=1e-5)
    # transformers' last hidden state is after the final norm: ours, before it, through it
    assert torch.allclose(model.model.norm(residual[-1]), hf.hidden_states[-1], atol=1e-5)
    assert torch.allclose(logits, hf.logits, atol=1e-5)
    probs, top = lens.logit_lens(model, residual, top_k=3)
    assert probs.shape == top.shape == (layers + 1, 2, 13, 3)
    assert torch.equal(top[-1, ..., 0], hf.logits.argmax(-1))
    assert torch.allclose(probs[-1, ..., 0], hf.logits.softmax(-1).amax(-1), atol=1e-6)


def test_run_with_cache_runs_the_models_own_forward(monkeypatch):
    """A change to model.py's forward (here every norm's output moved by a constant) shows in run_with_cache's
    logits and activations, which equal the changed model's: they are its forward's, not a copy's."""
    config = TINY["gqa"]
    model, ids = tiny_model(config), random_ids(config, (2, 9))
    plain_logits, plain = lens.run_with_cache(model, ids)
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x, hooks=None: forward(self, x, hooks) + 0.5)
    logits, cache = lens.run_with_cache(model, ids)
    with torch.inference_mode():
        changed = model(ids)
        q = model.model.layers[0].self_attn.q_proj(model.model.layers[0].input_layernorm(plain["hook_embed"]))
    assert not torch.allclose(changed, plain_logits, atol=1e-2)
    assert torch.allclose(logits, changed, atol=1e-5)
    assert torch.equal(cache["blocks.0.hook_resid_pre"], plain["blocks.0.hook_resid_pre"])  # before any norm
    assert torch.allclose(cache["blocks.0.attn.hook_q"].flatten(2), q, atol=1e-5)
    assert not torch.allclose(cache["blocks.1.hook_resid_pre"], plain["blocks.1.hook_resid_pre"], atol=1e-2)


def test_the_shapes_at_the_points_are_transformer_lenses(config):
    ids = random_ids(config, (1, 7))
    _, cache = lens.run_with_cache(tiny_model(config), ids, ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k",
                                                             "blocks.1.attn.hook_z", "blocks.1.attn.hook_attn_scores",
                                                             "blocks.1.ln2.hook_scale", "blocks.1.mlp.hook_post"])
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert cache["blocks.1.attn.hook_q"].shape == cache["blocks.1.attn.hook_z"].shape == (1, 7, heads, hd)
    assert cache["blocks.1.attn.hook_k"].shape == (1, 7, kv, hd)
    assert cache["blocks.1.attn.hook_attn_scores"].shape == (1, heads, 7, 7)
    assert torch.isinf(cache["blocks.1.attn.hook_attn_scores"][0, :, 0, 1:]).all()  # the future, masked
    assert cache["blocks.1.ln2.hook_scale"].shape == (1, 7, 1)
    assert cache["blocks.1.mlp.hook_post"].shape == (1, 7, config.intermediate_size)


@pytest.mark.slow
def test_the_embedded_model_equals_transformers(reference_model, hf_model, model):
    """The acceptance: run_with_cache's residual stream within 1e-5 of transformers' hidden states (relative to
    the stream's largest value, ~2e4 in the middle layers, where float32 keeps ~7 digits), the attention patterns
    within 1e-5 of its eager attention, the logit lens's top-1 at every layer and position equal to its hidden
    states' through its final norm and lm_head; the accelerated model's the same as the reference's."""
    from smollm2 import Tokenizer

    ids = Tokenizer.from_pretrained().encode("The capital of France is Paris, and the capital of Italy is")
    hf_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            hf = hf_model(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    finally:
        hf_model.set_attn_implementation("sdpa")
    for variant in (reference_model, model):
        _, cache = lens.run_with_cache(variant, [ids])
        residual = lens.residual_stream(cache)
        layers = len(residual) - 1
        for layer in range(layers):
            state = hf.hidden_states[layer]
            assert (residual[layer] - state).abs().max() <= 1e-5 * state.abs().max()
            assert (cache[f"blocks.{layer}.attn.hook_pattern"] - hf.attentions[layer]).abs().max() <= 1e-5
        with torch.no_grad():
            hf_lens = torch.stack([hf_model.lm_head(hf_model.model.norm(state)) for state in hf.hidden_states[:-1]]
                                  + [hf_model.lm_head(hf.hidden_states[-1])]).argmax(-1)
        assert torch.equal(lens.logit_lens(variant, residual, 1)[1][..., 0], hf_lens)


def test_hooks_read_and_change_activations_while_generating(variant):
    config = TINY["gqa"]
    model = as_variant(tiny_model(config), variant)
    prompt = random_ids(config, (9,)).tolist()
    plain = generate(model, [prompt], 6, eos_token_id=None)
    seen = []
    read = generate(model, [prompt], 6, eos_token_id=None,
                           hooks={"blocks.1.hook_mlp_out": lambda x, name: seen.append((name, x.shape))})
    assert torch.equal(read, plain)  # a hook that returns None changes nothing
    assert seen == [("blocks.1.hook_mlp_out", (1, 9, config.hidden_size))] + \
        [("blocks.1.hook_mlp_out", (1, 1, config.hidden_size))] * 5  # the prompt, then each token it feeds
    flipped = generate(model, [prompt], 6, eos_token_id=None,  # the last residual stream turned around
                              hooks=[(f"blocks.{config.num_hidden_layers - 1}.hook_resid_post", lambda x, name: -x)])
    assert not torch.equal(flipped[0, 9:], plain[0, 9:])


def test_bad_hooks_and_steering_are_smol_errors():
    config = TINY["gqa"]
    with pytest.raises(SmolError, match="no hook point 'blocks.9.hook_resid_pre'"):
        Hooks(config.num_hidden_layers, [("blocks.9.hook_resid_pre", print)])
    with pytest.raises(SmolError, match="not a function"):
        Hooks(config.num_hidden_layers, {"hook_embed": 3})
    with pytest.raises(SmolError, match="pairs or a dict of them, got 'hook_embed'"):
        Hooks(config.num_hidden_layers, ["hook_embed"])
    with pytest.raises(SmolError, match="steering layer"):
        steering(config, config.num_hidden_layers, torch.zeros(config.hidden_size))
    with pytest.raises(SmolError, match=f"{config.hidden_size} finite numbers"):
        steering(config, 0, torch.zeros(config.hidden_size + 1))
    with pytest.raises(SmolError, match="finite"):
        steering(config, 0, torch.full((config.hidden_size,), float("nan")))
    with pytest.raises(SmolError, match="away: a steering text needs 2 tokens at least, got 1"):
        lens.steering_vector(tiny_model(config), [1, 2], [3], 0)
    with pytest.raises(SmolError, match="equally long"):
        lens.run_with_cache(tiny_model(config), [[1, 2], [3]])
    assert len(point_names(2)) == 1 + 2 * len(BLOCK_POINTS) + 2


def steered_batch(model, prompts, steered: set[int], vector, **options) -> list[list]:
    """Each prompt's tokens and log-probabilities from one engine, the rows in `steered` steered at block 1."""
    config = model.config
    hooks = Hooks(config.num_hidden_layers, steering(config, 1, vector))
    engine = Engine(model, len(prompts), 64, prefill_budget=None)
    sequences = [Sequence(prompt, 8, Sampling(), eos=(), logprobs=2) for prompt in prompts]
    rows = [engine.admit(sequence, hooks=hooks if b in steered else None, **options)
            for b, sequence in enumerate(sequences)]
    answers = {row: [] for row in rows}
    while not all(s.finish_reason for s in sequences):
        for row, step in engine.step():
            answers[row].append((step.token, step.logprob))
    return list(answers.values())


@pytest.mark.parametrize("options", [{}, {"speculative": "ngram"}], ids=["plain", "speculative"])
def test_a_steered_row_leaves_the_other_rows_bits(variant, options):
    config = TINY["gqa"]
    model = as_variant(tiny_model(config), variant)
    if variant == "reference" and (reason := torch_row_variance(model)):
        pytest.skip(f"model.py on torch alone: {reason} (the kernels keep the other rows' bits on every CPU)")
    prompts = [random_ids(config, (n,), seed=n).tolist() * 2 for n in (5, 11, 7)]  # repeats: lookup guesses
    vector = 1000 * model.output_weight[7].detach()  # toward token 7
    unsteered = steered_batch(model, prompts, set(), vector, **options)
    steered = steered_batch(model, prompts, {1}, vector, **options)
    assert steered[0] == unsteered[0] and steered[2] == unsteered[2]  # tokens and log-probabilities, exactly
    assert steered[1] == steered_batch(model, [prompts[1]], {0}, vector, **options)[0]
    assert [t for t, _ in steered[1]] == [7] * 8 != [t for t, _ in unsteered[1]]
    for b in (0, 2):  # and the tokens each gets alone
        assert [t for t, _ in steered[b]] == [t for t, _ in steered_batch(model, [prompts[b]], set(), vector,
                                                                          **options)[0]]


def test_steering_vector_is_the_difference_of_two_prompts_states():
    config = TINY["gqa"]
    model = tiny_model(config)
    toward, away = random_ids(config, (4,), 1).tolist(), random_ids(config, (6,), 2).tolist()
    _, a = lens.run_with_cache(model, [toward], ["blocks.1.hook_resid_pre"])
    _, b = lens.run_with_cache(model, [away], ["blocks.1.hook_resid_pre"])
    expected = a["blocks.1.hook_resid_pre"][0, -1] - b["blocks.1.hook_resid_pre"][0, -1]
    assert torch.equal(lens.steering_vector(model, toward, away, 1), expected)


def test_the_readmes_tour_of_the_logit_lens(model):
    """What the README says the logit lens shows on "The capital of France is"."""
    from smollm2 import Tokenizer

    tokenizer = Tokenizer.from_pretrained()
    ids = tokenizer.encode("The capital of France is")
    _, cache = lens.run_with_cache(model, [ids])
    probs, top = lens.logit_lens(model, lens.residual_stream(cache), top_k=model.config.vocab_size)
    probs, top, output = probs[:, 0], top[:, 0], model.config.num_hidden_layers
    paris, of, capital, the = (tokenizer.encode(word)[0] for word in (" Paris", " of", " capital", " the"))
    ranks = [top[layer, 4].tolist().index(paris) + 1 for layer in range(output + 1)]  # of " Paris", under " is"

    assert [tokenizer.token_text(t) for t in top[0, :, 0].tolist()] == ["The", " capital", " of", "<filename>", " is"]
    assert all(tokenizer.token_text(t) in {",", ".", "-", " ", " the", " a", " ("} for t in top[1:10, :, 0].flatten())
    assert [top[layer, 1, 0] == of for layer in range(18, output + 1)] == [False] + [True] * (output - 18)
    assert round(100 * probs[19, 1, 0].item()) == 77 and (probs[20:29, 1, 0] > 0.9).all()
    assert round(100 * probs[output, 1, 0].item()) == 71
    assert all(2000 <= rank <= 5100 for rank in ranks[1:24])  # (layer 0 is sure of " is": the rest all round to 0)
    assert [ranks[layer] for layer in (24, 25, 28, 29, output)] == [396, 92, 7, 3, 1]
    assert top[29, 4, :2].tolist() == [capital, the]
    assert [round(100 * p) for p in probs[29, 4, :3].tolist()] == [20, 20, 7]
    assert [tokenizer.token_text(t) for t in top[output, 4, :3].tolist()] == [" Paris", " the", " London"]
    assert [round(100 * p) for p in probs[output, 4, :3].tolist()] == [77, 6, 1]


def test_the_readmes_steering_example(model):
    from smollm2 import Tokenizer

    tokenizer = Tokenizer.from_pretrained()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about your weekend."}])
    toward, away = tokenizer.encode("I went to a wedding"), tokenizer.encode("I went to a funeral")
    vector = lens.steering_vector(model, toward, away, layer=6)
    steered = generate(model, [chat], 24, hooks=steering(model.config, 6, 0.5 * vector))[0, len(chat):]
    plain = generate(model, [chat], 24)[0, len(chat):]
    assert tokenizer.decode(steered).startswith("I'm a happy couple with a wonderful adventure to the beach.")
    assert tokenizer.decode(plain).startswith("My weekend is a mix of adventure and relaxation.")
    # Why a steering text needs two tokens: the first position's stream, the attention sink's, is unlike the others'.
    _, cache = lens.run_with_cache(model, [tokenizer.encode("I went to a wedding")])
    norms = lens.residual_stream(cache)[:, 0].norm(dim=-1)
    assert (norms[:, 0] > 5 * norms[:, 1:].median(dim=-1).values).sum() >= 20  # of the 31 streams
