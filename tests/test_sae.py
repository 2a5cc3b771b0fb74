"""SAEs and transcoders that SAELens itself builds and writes: loaded here from a directory or a hub id (a local
hub cache), they encode, decode and reconstruct the embedded model's activations as SAELens does; bad files are
one SmolError line each."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from smollm2 import lens
from smollm2.errors import SmolError
from conftest import TINY, tiny_model
from smollm2.generation.hooks import Hooks
from smollm2.sae import SAE, load_sae, load_saes, replacement, save_sae

D_SAE = 1024
READS, WRITES = "blocks.3.ln2.hook_normalized", "blocks.3.hook_mlp_out"  # a transcoder's: the MLP's input, output
KINDS = {  # SAELens's architecture -> its class and config names, and the config's settings beyond the sizes
    "standard": ("StandardSAE", {}), "topk": ("TopKSAE", {"k": 32}),
    "topk_rescaled": ("TopKSAE", {"k": 32, "rescale_acts_by_decoder_norm": True}),
    "jumprelu": ("JumpReLUSAE", {}), "transcoder": ("Transcoder", {}), "skip_transcoder": ("SkipTranscoder", {}),
    "jumprelu_transcoder": ("JumpReLUTranscoder", {}), "jumprelu_skip_transcoder": ("JumpReLUSkipTranscoder", {}),
}


def sae_lens_dictionary(kind: str, d_in: int, seed: int = 0):
    """One of SAELens's own SAEs or transcoders with random weights: every tensor random, a JumpReLU's thresholds
    where about half of each feature's pre-activations fall."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sae_lens and what it imports warn of their own deprecations
        import sae_lens
        from sae_lens.saes.sae import SAEMetadata

    name, settings = KINDS[kind]
    transcoder = "Transcoder" in name
    metadata = SAEMetadata(hook_name=READS, hook_name_out=WRITES) if transcoder else \
        SAEMetadata(hook_name="blocks.3.hook_resid_pre")
    sizes = dict(d_in=d_in, d_sae=D_SAE) | (dict(d_out=d_in, apply_b_dec_to_input=False) if transcoder else {})
    config = getattr(sae_lens, name + "Config")(**sizes, **settings, metadata=metadata)
    sae = getattr(sae_lens, name)(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in sae.named_parameters():
            scale = {"threshold": 0.3, "b_enc": 0.1, "b_dec": 0.1}.get(parameter_name, d_in ** -0.5)
            parameter.copy_(scale * torch.randn(parameter.shape, generator=generator).abs() if parameter_name ==
                            "threshold" else scale * torch.randn(parameter.shape, generator=generator))
    return sae.eval()


@pytest.fixture(scope="module")
def activations(model):
    """The embedded model's activations where the dictionaries read and a transcoder writes, (1, T, C) each."""
    ids = [1, 504, 414, 46682, 18669, 314, 281, 260, 2240, 282]
    _, cache = lens.run_with_cache(model, [ids], ["blocks.3.hook_resid_pre", READS, WRITES])
    return cache


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_saes_and_transcoders_written_by_sae_lens_compute_as_sae_lens(kind, activations, tmp_path):
    theirs = sae_lens_dictionary(kind, activations[READS].shape[-1])
    theirs.save_model(tmp_path / kind)  # SAELens's own writer: cfg.json and sae_weights.safetensors
    ours = load_sae(tmp_path / kind)
    transcoder = "transcoder" in kind
    assert (ours.hook_name, ours.hook_name_out) == ((READS, WRITES) if transcoder else ("blocks.3.hook_resid_pre",) * 2)
    x = activations[ours.hook_name]
    with torch.no_grad():
        features, want = ours.encode(x), theirs.encode(x)
        torch.testing.assert_close(features, want, atol=1e-5, rtol=0)
        active = (features != 0).sum(-1)
        assert bool((active > 0).all()) and bool((active < D_SAE).all())  # sparse, and no token without features
        if "topk" in kind:
            assert bool((active <= 32).all())
        torch.testing.assert_close(ours.decode(features), theirs.decode(features), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.reconstruct(x), theirs(x), atol=1e-5, rtol=0)
        target = activations[WRITES] if transcoder else x
        error = ours.error(x, activations[WRITES]) if transcoder else ours.error(x)
        torch.testing.assert_close(error, target - theirs(x), atol=1e-5, rtol=0)
    assert error.shape == target.shape


def test_an_sae_from_a_hub_id_in_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--smollm2-saes"
    theirs = sae_lens_dictionary("jumprelu", 64)
    theirs.save_model(repo / "snapshots" / commit / "layer_3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))

    ours = load_sae("org/smollm2-saes/layer_3")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(x), theirs.encode(x), atol=1e-5, rtol=0)
    with pytest.raises(SmolError, match="org/missing"):
        load_sae("org/missing/layer_3")
    with pytest.raises(SmolError, match="no cfg.json"):
        load_sae("org/smollm2-saes/layer_4")


def write(path, cfg: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "sae_weights.safetensors"))
    return path


GOOD_CFG = {"architecture": "standard", "d_in": 4, "d_sae": 6, "dtype": "float32", "apply_b_dec_to_input": True,
            "metadata": {"hook_name": "blocks.0.hook_resid_pre", "sae_lens_version": "6.54.12"}}


def good_tensors():
    return {"W_enc": torch.ones(4, 6), "b_enc": torch.zeros(6), "W_dec": torch.ones(6, 4), "b_dec": torch.zeros(4)}


@pytest.mark.parametrize("cfg, tensors, message", [
    ({"architecture": "gated"}, {}, "architecture 'gated' is not one of standard"),
    ({"d_sae": 0}, {}, "d_sae must be a whole number, 1 or more, got 0"),
    ({"d_in": "4"}, {}, "d_in must be a whole number"),
    ({"dtype": "int8"}, {}, "dtype 'int8' is not one of"),
    ({"metadata": {"hook_name": "blocks.0.hook_resid_pre", "hook_head_index": 2}}, {}, "hook_head_index 2 is not"),
    ({"normalize_activations": "layer_norm"}, {}, "normalize_activations 'layer_norm' is not supported"),
    ({"metadata": {"hook_name": "blocks.0.attn.hook_result"}}, {}, "hook point 'blocks.0.attn.hook_result' is not"),
    ({"metadata": {}}, {}, "no hook_name"),
    ({"architecture": "topk", "k": 7}, {}, "k=7 is more than the 6 features"),
    ({"architecture": "transcoder", "d_out": 4}, {}, "cannot subtract its output bias"),
    ({}, {"W_enc": torch.ones(6, 4)}, r"tensor W_enc has shape \(6, 4\), but cfg.json says \(4, 6\)"),
    ({}, {"b_enc": torch.zeros(6, dtype=torch.int32)}, "tensor b_enc has dtype I32, not a float"),
    ({}, {"b_dec": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "tensor b_dec holds NaN"),
    ({}, {"scaling_factor": torch.ones(6)}, "unexpected tensor scaling_factor"),
    ({"architecture": "jumprelu"}, {}, "missing tensor threshold"),
])
def test_bad_dictionaries_are_one_smol_error(tmp_path, cfg, tensors, message):
    path = write(tmp_path / "sae", GOOD_CFG | cfg, good_tensors() | tensors)
    with pytest.raises(SmolError, match=message) as raised:
        load_sae(path)
    assert "\n" not in str(raised.value)


def test_what_is_not_an_sae_is_a_smol_error(tmp_path):
    good = load_sae(write(tmp_path / "good", GOOD_CFG, good_tensors()))  # and from SAELens before 6: other names
    old = {"d_in": 4, "d_sae": 6, "dtype": "torch.float32", "hook_point": "blocks.0.hook_mlp_in",
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 2}, "apply_b_dec_to_input": False}
    legacy = load_sae(write(tmp_path / "legacy", old, good_tensors()))
    assert (good.activation, legacy.activation, legacy.k) == ("relu", "topk", 2)
    assert legacy.hook_name == "blocks.0.hook_resid_mid"  # TransformerLens's hook_mlp_in holds what ours does
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "cfg.json").write_text("{")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "cfg.json").write_text(json.dumps(GOOD_CFG))
    write(tmp_path / "truncated", GOOD_CFG, good_tensors())
    weights = tmp_path / "truncated" / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    transcoder = write(tmp_path / "transcoder", GOOD_CFG | {"architecture": "transcoder", "d_out": 4,
                                                            "apply_b_dec_to_input": False}, good_tensors())
    for source, message in [(tmp_path / "empty", "no cfg.json"), (tmp_path / "bad_json", "cannot read JSON"),
                            (tmp_path / "no_weights", "no sae_weights.safetensors"),
                            (tmp_path / "truncated", "truncated or corrupt"),
                            (tmp_path / "missing", "not a directory, nor org/name/folder"),
                            ("org/name/../../elsewhere", "not a directory, nor org/name/folder")]:
        with pytest.raises(SmolError, match=message):
            load_sae(source)
    with pytest.raises(SmolError, match="needs its target, the activation at blocks.0.hook_resid_pre"):
        load_sae(transcoder).error(torch.ones(4))


SPARSIFY_KINDS = {  # the folder sparsify names for the module hooked -> (transcode, skip_connection), and our points
    "layers.3": (False, False, "blocks.3.hook_resid_post", "blocks.3.hook_resid_post"),
    "layers.3.self_attn": (False, False, "blocks.3.hook_attn_out", "blocks.3.hook_attn_out"),
    "model.layers.3.mlp": (True, True, READS, WRITES),
    "layers.3.mlp": (True, False, READS, WRITES),
    "layers.2": (True, False, "blocks.2.hook_resid_pre", "blocks.2.hook_resid_post"),
}


def sparsify_dictionary(transcode: bool, skip: bool, d_in: int, seed: int = 0):
    """sparsify's own SparseCoder, every tensor random (a TopK of 32 of 1024 latents)."""
    from sparsify import SparseCoder, SparseCoderConfig

    coder = SparseCoder(d_in, SparseCoderConfig(num_latents=D_SAE, k=32, transcode=transcode, skip_connection=skip))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in coder.named_parameters():
            scale = {"encoder.bias": 0.1, "b_dec": 0.1}.get(name, d_in ** -0.5)
            parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))
    return coder.eval()


@pytest.mark.parametrize("module", sorted(SPARSIFY_KINDS))
def test_dictionaries_written_by_sparsify_compute_as_sparsify(module, model, tmp_path):
    """sparsify's own writer (save_to_disk: cfg.json and sae.safetensors in a folder named for the module); a
    transcoder of an MLP reads the MLP's input, which sparsify takes after the norm's weight: we read
    ln2.hook_normalized, before it, with the weight folded into the encoder."""
    transcode, skip, reads, writes = SPARSIFY_KINDS[module]
    pytest.importorskip("sparsify", reason="eai-sparsify is in the test extra")
    theirs = sparsify_dictionary(transcode, skip, model.config.hidden_size)
    theirs.save_to_disk(tmp_path / module)
    ours = load_sae(tmp_path / module, model)
    assert (ours.hook_name, ours.hook_name_out, ours.transcoder, ours.k) == (reads, writes, transcode, 32)
    ids = [1, 504, 414, 46682, 18669, 314, 281, 260, 2240, 282]
    _, cache = lens.run_with_cache(model, [ids], [reads, writes, "blocks.3.hook_resid_mid"])
    # what sparsify's module reads: the block's stream, the MLP's input (the norm with its weight), its output
    their_input = model.model.layers[3].post_attention_layernorm(cache["blocks.3.hook_resid_mid"])[0] \
        if reads == READS else cache[reads][0]
    with torch.no_grad():
        acts, indices, _ = theirs.encode(their_input)
        features = ours.encode(cache[reads][0])
        want = torch.zeros_like(features).scatter_(-1, indices, acts)
        torch.testing.assert_close(features, want, atol=1e-5, rtol=0)
        assert bool(((features != 0).sum(-1) == 32).all())
        torch.testing.assert_close(ours.decode(features), theirs.decode(acts, indices), atol=1e-5, rtol=0)
        out = theirs(their_input, cache[writes][0])
        torch.testing.assert_close(ours.reconstruct(cache[reads][0]), out.sae_out, atol=1e-5, rtol=0)
        error = ours.error(cache[reads][0], cache[writes][0] if transcode else None)
        torch.testing.assert_close(error, cache[writes][0] - out.sae_out, atol=1e-5, rtol=0)


def test_a_set_of_sparsify_transcoders_and_what_they_need(model, tmp_path):
    pytest.importorskip("sparsify", reason="eai-sparsify is in the test extra")
    for layer in (10, 2, 0):  # sparsify's layout: a folder per module
        sparsify_dictionary(True, True, model.config.hidden_size, seed=layer).save_to_disk(
            tmp_path / "set" / f"layers.{layer}.mlp")
    found = load_saes(tmp_path / "set", model)
    assert list(found) == ["layers.0.mlp", "layers.2.mlp", "layers.10.mlp"]  # by block
    assert [sae.hook_name_out for sae in found.values()] == [f"blocks.{l}.hook_mlp_out" for l in (0, 2, 10)]
    assert list(load_saes(tmp_path / "set" / "layers.2.mlp", model)) == ["layers.2.mlp"]
    with pytest.raises(SmolError, match="load it with the model"):
        load_sae(tmp_path / "set" / "layers.2.mlp")
    (tmp_path / "set" / "layers.2.mlp").rename(tmp_path / "set" / "blocks.2")
    with pytest.raises(SmolError, match="named for the module it hooks"):
        load_sae(tmp_path / "set" / "blocks.2", model)
    cfg = json.loads((tmp_path / "set" / "layers.0.mlp" / "cfg.json").read_text())
    for change, message in [({"activation": "groupmax"}, "activation 'groupmax' is not supported"),
                            ({"k": 5000}, "k=5000 is more than the 1024 features"),
                            ({"d_in": 64}, r"tensor encoder.weight has shape \(1024, 576\), but cfg.json says")]:
        (tmp_path / "set" / "layers.0.mlp" / "cfg.json").write_text(json.dumps(cfg | change))
        with pytest.raises(SmolError, match=message):
            load_sae(tmp_path / "set" / "layers.0.mlp", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SmolError, match="no cfg.json, nor folders with one"):
        load_saes(tmp_path / "empty")


def test_a_dictionary_attached_as_a_replacement():
    """The model run on an SAE's reconstruction (or a transcoder's prediction) where it writes: the logits are a
    pass computed by hand with the activation replaced; with the error kept, the model's own logits, bit for bit,
    while the gradient flows through the features alone."""
    config = TINY["gqa"]
    model = tiny_model(config)
    generator = torch.Generator().manual_seed(0)
    C, d_sae = config.hidden_size, 48

    def random(*shape):
        return 0.3 * torch.randn(*shape, generator=generator)

    sae = SAE("blocks.1.hook_resid_pre", "blocks.1.hook_resid_pre", "relu", False, random(C, d_sae), random(d_sae),
              random(d_sae, C), random(C), None, None, None, True, False)
    transcoder = SAE("blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out", "topk", True, random(C, d_sae),
                     random(d_sae), random(d_sae, C), random(C), None, random(C, C), 8, False, False)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=generator)
    names = ["blocks.1.hook_resid_pre", "blocks.0.ln2.hook_normalized", "blocks.0.hook_resid_mid"]
    plain, cache = lens.run_with_cache(model, ids, names)

    def run(hooks):
        with lens.reference_math(model):
            return model.logits(Hooks(config.num_hidden_layers, hooks).hidden_states(model, ids))

    def by_hand(x, first_block):  # the blocks from first_block on, then the output, on the stream x
        T = ids.shape[1]
        rope = model.rope_cos[:T][None, :, None], model.rope_sin[:T][None, :, None]
        for block in model.model.layers[first_block:]:
            x = block(x, rope, None, None, torch.arange(T))
        return model.logits(model.model.norm(x))

    with torch.no_grad():
        for dictionary, want in [
                (sae, by_hand(sae.reconstruct(cache["blocks.1.hook_resid_pre"]), 1)),
                (transcoder, by_hand(cache["blocks.0.hook_resid_mid"]
                                     + transcoder.reconstruct(cache["blocks.0.ln2.hook_normalized"]), 1))]:
            replaced = run(replacement(config, dictionary))
            torch.testing.assert_close(replaced, want, atol=1e-5, rtol=1e-5)
            assert (replaced - plain).abs().max() > 1e-2  # the dictionaries miss much: random
            assert torch.equal(run(replacement(config, dictionary, keep_error=True)), plain)
    # with the error a constant, the logits' gradient reaches the stream before the SAE through its features only
    x = cache["blocks.1.hook_resid_pre"].clone().requires_grad_()
    grad, = torch.autograd.grad(replacement(config, sae, keep_error=True)[0][1](x, sae.hook_name).sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad(sae.reconstruct(x).sum(), x)[0])
    with pytest.raises(SmolError, match="must read .* before it writes"):
        replacement(config, dataclasses.replace(transcoder, hook_name="blocks.1.hook_mlp_out"))


@pytest.mark.parametrize("kind", ["topk_rescaled", "jumprelu", "skip_transcoder"])
def test_what_save_sae_writes_sae_lens_reads(kind, activations, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sae_lens import SAE as SAELensSAE
    theirs = sae_lens_dictionary(kind, activations[READS].shape[-1])
    theirs.save_model(tmp_path / "theirs")
    ours = load_sae(save_sae(load_sae(tmp_path / "theirs"), tmp_path / "ours"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = SAELensSAE.load_from_disk(tmp_path / "ours", device="cpu")
    x = activations[ours.hook_name]
    with torch.no_grad():
        torch.testing.assert_close(again.encode(x), theirs.encode(x), atol=0, rtol=0)
        torch.testing.assert_close(ours.reconstruct(x), theirs(x), atol=1e-5, rtol=0)
    assert (again.cfg.metadata.hook_name, ours.hook_name) == (theirs.cfg.metadata.hook_name,) * 2


def test_a_set_of_sparsify_transcoders_from_a_hub_id_in_the_local_cache(model, tmp_path, monkeypatch):
    """As EleutherAI's skip transcoders for SmolLM2-135M lie in their repository: a folder per MLP."""
    import huggingface_hub.constants as hub_constants

    pytest.importorskip("sparsify", reason="eai-sparsify is in the test extra")
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--skip-transcoders"
    for layer in (0, 1):
        sparsify_dictionary(True, True, model.config.hidden_size, seed=layer).save_to_disk(
            repo / "snapshots" / commit / f"model.layers.{layer}.mlp")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(cache))):
        monkeypatch.setenv(name, "1" if value is True else value)
        monkeypatch.setattr(hub_constants, name, value)
    found = load_saes("org/skip-transcoders", model)
    assert list(found) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    one = load_sae("org/skip-transcoders/model.layers.1.mlp", model)
    assert torch.equal(one.W_enc, found["model.layers.1.mlp"].W_enc) and one.hook_name == "blocks.1.ln2.hook_normalized"
