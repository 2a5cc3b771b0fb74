"""Activation and attribution patching on the embedded model equal the same computations done by nnsight on
transformers' LlamaForCausalLM of the same weights, and activation patching equals its definition."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, hf_copy, tiny_model
from smollm2 import Tokenizer, lens, patching
from smollm2.errors import SmolError
from smollm2.generation.hooks import Hooks, point_names

CLEAN, CORRUPTED = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
HEAD_DIM = 64  # SmolLM2-135M's
PATCHED = ["blocks.3.hook_resid_pre", "blocks.6.attn.hook_v", "blocks.9.hook_mlp_out"]  # in the order of the pass
ATTRIBUTED = ["blocks.3.hook_resid_pre", "blocks.6.attn.hook_v", "blocks.6.attn.hook_z", "blocks.9.hook_mlp_out"]


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_pretrained()
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    assert len(clean) == len(corrupted) == 9  # patching compares position with position
    paris, rome = tok.encode(" Paris"), tok.encode(" Rome")
    assert len(paris) == len(rome) == 1

    def logit_difference(logits):
        return logits[0, -1, paris[0]] - logits[0, -1, rome[0]]

    return [clean], [corrupted], logit_difference


@pytest.fixture(scope="module")
def found(model, prompts):
    """Ours: activation patching at PATCHED, attribution patching at ATTRIBUTED (the patched runs are the slow
    part: a pass of the prompt per position, and per head)."""
    clean, corrupted, metric = prompts
    return (patching.patch(model, clean, corrupted, metric, PATCHED),
            patching.attribution_patch(model, clean, corrupted, metric, ATTRIBUTED))


def hf_activation(net, point: str):
    """nnsight's handle on the activation at our hook point in transformers' model, and its heads' size (None
    where the point has no heads): hook_v is v_proj's output, (B, T, kv heads * head_dim), hook_z o_proj's input,
    (B, T, heads * head_dim)."""
    layer = net.model.layers[int(point.split(".")[1])]
    return {"hook_resid_pre": (lambda: layer.input, None),
            "attn.hook_v": (lambda: layer.self_attn.v_proj.output, HEAD_DIM),
            "attn.hook_z": (lambda: layer.self_attn.o_proj.input, HEAD_DIM),
            "hook_mlp_out": (lambda: layer.mlp.output, None)}[point.split(".", 2)[2]]


def per_site(x: torch.Tensor, head_size: int | None) -> torch.Tensor:
    """(B, T, C) summed over the rows and the hidden dimension, per head where head_size is given: (T,) or
    (T, heads)."""
    return x.sum((0, 2)) if head_size is None else x.unflatten(2, (-1, head_size)).sum((0, 3))


def nnsight_reference(hf, clean, corrupted, metric) -> tuple[dict, dict]:
    """Activation patching at PATCHED (one batched trace per point, a patched row per site) and attribution
    patching at ATTRIBUTED (a clean trace, and a corrupted one with its backward pass), written with nnsight."""
    import nnsight

    net, clean, corrupted = nnsight.NNsight(hf), torch.tensor(clean), torch.tensor(corrupted)
    T = clean.shape[1]
    with torch.no_grad(), net.trace(clean):
        kept = nnsight.save({point: hf_activation(net, point)[0]().clone() for point in ATTRIBUTED})
    patched = {}
    for point in PATCHED:
        head_size = hf_activation(net, point)[1]
        heads = 1 if head_size is None else kept[point].shape[-1] // head_size
        sites = [(p, h) for p in range(T) for h in range(heads)]
        with torch.no_grad(), net.trace(corrupted.repeat(len(sites), 1)):
            act = hf_activation(net, point)[0]()
            for row, (p, h) in enumerate(sites):
                width = slice(None) if head_size is None else slice(h * head_size, (h + 1) * head_size)
                act[row, p, width] = kept[point][0, p, width]
            logits = net.output.logits.save()
        values = torch.stack([metric(logits[row:row + 1]) for row in range(len(sites))])
        patched[point] = values.reshape(T) if head_size is None else values.reshape(T, heads)
    with net.trace(corrupted):
        acts = [hf_activation(net, point)[0]() for point in ATTRIBUTED]
        seen = nnsight.save([act.detach().clone() for act in acts])
        value = metric(net.output.logits)
        grads = nnsight.save([])
        with value.backward():
            for act in reversed(acts):  # gradients arrive in the reverse order of the pass
                grads.insert(0, act.grad)
    attributed = {point: per_site((kept[point] - corr) * grad, hf_activation(net, point)[1])
                  for point, corr, grad in zip(ATTRIBUTED, seen, grads)}
    return patched, attributed


def test_patching_equals_nnsight_on_transformers(model, prompts, found):
    clean, corrupted, metric = prompts
    patched, attributed = found
    want_patched, want_attributed = nnsight_reference(hf_copy(model), clean, corrupted, metric)
    config = model.config
    shapes = {"blocks.3.hook_resid_pre": (9,), "blocks.6.attn.hook_v": (9, config.num_key_value_heads),
              "blocks.6.attn.hook_z": (9, config.num_attention_heads), "blocks.9.hook_mlp_out": (9,)}
    assert list(patched) == PATCHED and list(attributed) == ATTRIBUTED
    for point in PATCHED:
        assert patched[point].shape == shapes[point]
        torch.testing.assert_close(patched[point], want_patched[point].float(), atol=1e-4, rtol=0)
    for point in ATTRIBUTED:
        assert attributed[point].shape == shapes[point]
        torch.testing.assert_close(attributed[point], want_attributed[point].float(), atol=1e-4, rtol=0)


def test_activation_patching_is_its_definition(model, prompts, found):
    clean, corrupted, metric = prompts
    point, position, head = "blocks.6.attn.hook_v", 2, 1  # a key-value head: (B, T, kv heads, head_dim)
    _, cache = lens.run_with_cache(model, clean, [point])

    def replaced(x, name):
        x = x.clone()
        x[:, position, head] = cache[point][:, position, head]
        return x

    with torch.inference_mode():
        logits = model.logits(Hooks(model.config.num_hidden_layers, [(point, replaced)])
                              .hidden_states(model, torch.tensor(corrupted)))
    torch.testing.assert_close(found[0][point][position, head], metric(logits), atol=1e-5, rtol=0)
    # the stream entering block 0 at a position is its token's embedding: where the two prompts' tokens agree,
    # patching it changes nothing
    first = patching.patch(model, clean, corrupted, metric, ["blocks.0.hook_resid_pre"])["blocks.0.hook_resid_pre"]
    same = torch.tensor(clean[0]) == torch.tensor(corrupted[0])
    assert same.tolist() == [True, False, False, False] + [True] * 5
    corrupted_metric = metric(lens.run_with_cache(model, corrupted, [])[0])
    torch.testing.assert_close(first[same], corrupted_metric.expand(6), atol=1e-5, rtol=0)
    assert (first[~same] - corrupted_metric).abs().min() > 0.01


@pytest.mark.parametrize("change, message", [
    (dict(corrupted=[[1, 2, 3]]), "the same shape"),
    (dict(metric="logits"), "must be a function"),
    (dict(metric=lambda logits: logits[0, -1]), "one number"),
    (dict(hook_names="blocks.0.hook_resid_pre"), "a list of hook point names"),
    (dict(hook_names=["blocks.99.hook_resid_pre"]), "no hook point"),
])
def test_bad_patching_is_a_smol_error(change, message):
    model = tiny_model(TINY["gqa"])
    arguments = dict(clean=[[1, 2, 3, 4]], corrupted=[[5, 6, 7, 8]], metric=lambda logits: logits[0, -1, 0],
                     hook_names=["blocks.0.hook_resid_pre"]) | change
    for function in (patching.patch, patching.attribution_patch):
        with pytest.raises(SmolError, match=message):
            function(model, arguments["clean"], arguments["corrupted"], arguments["metric"], arguments["hook_names"])


def test_the_readmes_patching_example(model, prompts):
    clean, corrupted, metric = prompts
    figure = lambda value, want: abs(float(value) - want) < 0.006  # as the README rounds them  # noqa: E731
    assert figure(metric(lens.run_with_cache(model, clean, [])[0]), 2.86)
    assert figure(metric(lens.run_with_cache(model, corrupted, [])[0]), -8.70)
    streams = patching.patch(model, clean, corrupted, metric, ["blocks.23.hook_resid_pre", "blocks.24.hook_resid_pre"])
    iffel, last = 2, 8
    before, after = streams["blocks.23.hook_resid_pre"], streams["blocks.24.hook_resid_pre"]
    assert figure(before[iffel], 0.36) and figure(before[last], -6.07)
    assert figure(after[last], 0.37) and figure(after[iffel], -8.67)
    heads = patching.attribution_patch(model, clean, corrupted, metric, ["blocks.23.attn.hook_z"])
    at_last = heads["blocks.23.attn.hook_z"][last]
    assert figure(at_last[4], 2.86) and figure(at_last[5], 2.56)
    assert at_last[[0, 1, 2, 3, 6, 7, 8]].abs().max() < 0.5


def test_every_point_patches_by_position_and_head_on_a_tiny_model():
    config = TINY["gqa"]
    model, layers, T = tiny_model(config), config.num_hidden_layers, 6
    clean, corrupted = torch.randint(0, config.vocab_size, (2, 2, T), generator=torch.Generator().manual_seed(0))
    names = [name for name in point_names(layers) if not name.startswith("blocks.0.")]  # one block's are enough

    def metric(logits):
        return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()

    patched = patching.patch(model, clean, corrupted, metric, names)
    attributed = patching.attribution_patch(model, clean, corrupted, metric, names)
    _, cache = lens.run_with_cache(model, clean, names)
    heads = {"q": config.num_attention_heads, "rot_q": config.num_attention_heads, "z": config.num_attention_heads,
             "attn_scores": config.num_attention_heads, "pattern": config.num_attention_heads,
             "k": config.num_key_value_heads, "v": config.num_key_value_heads, "rot_k": config.num_key_value_heads}
    for name in names:
        head = heads.get(name.rpartition(".hook_")[2]) if ".attn." in name else None
        assert patched[name].shape == attributed[name].shape == ((T,) if head is None else (T, head)), name
        assert bool(patched[name].isfinite().all()) and bool(attributed[name].isfinite().all()), name

    # a point whose heads come before its positions: (B, heads, query position, key slot)
    point, position, head = "blocks.1.attn.hook_pattern", 4, 2

    def replaced(x, name):
        x = x.clone()
        x[:, head, position] = cache[point][:, head, position]
        return x

    with torch.inference_mode():
        logits = model.logits(Hooks(layers, [(point, replaced)]).hidden_states(model, corrupted))
    torch.testing.assert_close(patched[point][position, head], metric(logits), atol=1e-5, rtol=0)
    with pytest.raises(SmolError, match="no gradient"):
        patching.attribution_patch(model, clean, corrupted, lambda logits: torch.tensor(1.0), names[:1])
