"""Every SmolLM2 shape: models of the 360M's and the 1.7B's widths and head arrangements (15 query heads over 5
key-value heads; 32 over 32, no grouping; width 2048, MLP 8192) at a tiny depth, against transformers'
LlamaForCausalLM: in float32, on the kernels (SMOLLM2_KERNELS=on, conftest.py), their decoding steps included;
read from GGUF files llama.cpp's own converter wrote; and loaded by their hub ids from a local hub cache.

The 135M's shape is the embedded model's, tested throughout the suite. benchmarks/family.py measures the full
depths' speed and memory beside llama.cpp.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import llama_cpp_converter
import pytest
import torch
from conftest import hf_copy, tiny_model
from llama_cpp_converter import CONVERTER, SCRIPT, VERSION

import smollm2
from smollm2 import PRESETS, SmolLM2, Tokenizer, accelerate, generate, save, stream

LAYERS = 2
SHAPES = {size: dataclasses.replace(PRESETS[size], num_hidden_layers=LAYERS) for size in ("360M", "1.7B")}
HUB_IDS = {"360M": "HuggingFaceTB/SmolLM2-360M-Instruct", "1.7B": "HuggingFaceTB/SmolLM2-1.7B-Instruct"}
TOLERANCE = 1e-4  # of the logits' scale (their largest magnitude): the issue's bar
# The types llama.cpp's converter writes that the published GGUF files use. f16 is read as float32 whatever the
# shape, so it is converted at the 360M's only: at the 1.7B's its 200 MB file took a third of the suite's slowest
# test; Q8_0's blocks, streamed by the kernels, at both widths.
CONVERTED = {"360M": ("f16", "q8_0"), "1.7B": ("q8_0",)}


def ids(config, B: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))


def assert_near(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: max |logit diff| {diff:.3g} of logits reaching {scale:.3g}")
    assert diff <= TOLERANCE * scale, (what, diff, scale)


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request) -> tuple[str, SmolLM2]:
    """(size, a tiny-depth model of its shape), each weight random: norms around 1, so that every weight matters."""
    return request.param, tiny_model(SHAPES[request.param])


def test_shapes_are_the_published_ones(shape):
    size, model = shape
    c = model.config
    heads = {"360M": (960, 2560, 15, 5, 64), "1.7B": (2048, 8192, 32, 32, 64)}[size]
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == heads
    assert c.vocab_size == 49152 and c.tie_word_embeddings


@torch.no_grad()
def test_logits_equal_transformers_on_the_reference_and_the_kernels(shape):
    size, model = shape
    accelerated = accelerate(same_weights(model), mode="on")
    assert accelerated.accelerator.mode == "on"
    theirs = hf_copy(model)(ids(model.config)).logits
    assert_near(model(ids(model.config)), theirs, f"{size} reference")
    assert_near(accelerated(ids(model.config)), theirs, f"{size} kernels")


def same_weights(model: SmolLM2) -> SmolLM2:
    """A second model of the same weights (accelerate changes the model it is given)."""
    other = SmolLM2(model.config).eval()
    other.load_state_dict(model.state_dict())
    return other


@torch.no_grad()
def test_decoding_steps_equal_transformers(shape):
    """Greedy decoding on the kernels (prefill, then a decoding step a token, over the KV cache): each token's
    log-probability is transformers' at that position over the whole sequence, and each token is the one
    transformers ranks first, within the tolerance (random weights leave near ties)."""
    size, model = shape
    accelerated = accelerate(same_weights(model), mode="on")
    prompt, new = ids(model.config, B=2, T=12), 8
    steps = list(stream(accelerated, prompt, new, eos_token_id=None, temperature=0, logprobs=0))
    tokens = torch.tensor([[step[row].token for step in steps] for row in range(2)])
    ours = torch.tensor([[step[row].logprob.logprob for step in steps] for row in range(2)])
    logits = hf_copy(model)(torch.cat([prompt, tokens], 1)).logits[:, prompt.shape[1] - 1:-1]
    theirs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    assert_near(ours, theirs, f"{size} decoding, log-probabilities")
    chosen = logits.gather(-1, tokens[..., None])[..., 0]
    assert (logits.amax(-1) - chosen <= TOLERANCE * logits.abs().max()).all()


def rounded_as(model: SmolLM2, type: str) -> SmolLM2:
    """The model with each matrix rounded as the GGUF type stores it, by gguf-py's own quantize and dequantize
    (llama.cpp's converter quantizes with them; its q/k row permutation moves whole rows, so whole blocks)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    qtype = {"f16": Q.F16, "q8_0": Q.Q8_0}[type]
    rounded = same_weights(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), qtype), qtype)))
    return rounded


@pytest.mark.slow
@pytest.mark.subprocess
def test_gguf_from_llama_cpps_converter_equals_transformers(shape, tmp_path):
    """The model saved as a HF directory and converted by llama.cpp's convert_hf_to_gguf.py to f16 and q8_0
    (CONVERTED), every matrix in the type: read by smollm2 (on the kernels, the Q8_0 blocks streamed), the logits
    are transformers' on the weights rounded as the type (by gguf-py)."""
    if not SCRIPT.exists():
        pytest.skip(f"no llama.cpp converter in {CONVERTER}: `make install-test` (or python tests/"
                    f"llama_cpp_converter.py) fetches llama-cpp-python {VERSION}'s")
    from gguf import GGUFReader

    size, model = shape
    save(model, tmp_path / "hf")
    Tokenizer.from_pretrained().save_pretrained(tmp_path / "hf")
    files = {type: tmp_path / f"{type}.gguf" for type in CONVERTED[size]}
    converted = subprocess.run([sys.executable, llama_cpp_converter.__file__, "convert",
                                *(str(arg) for type, path in files.items() for arg in (tmp_path / "hf", type, path))],
                               capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr[-3000:]
    for type, path in files.items():
        assert {t.tensor_type.name.lower() for t in GGUFReader(path).tensors if len(t.shape) == 2} == {type}
        ours = smollm2.load(path)
        assert ours.accelerator.mode == "on"
        with torch.no_grad():
            theirs = hf_copy(rounded_as(model, type))(ids(model.config)).logits
            assert_near(ours(ids(model.config)), theirs, f"{size} {type} GGUF")


@pytest.mark.parametrize("size", list(HUB_IDS))
def test_hub_id_of_each_size_from_a_local_cache(size, tmp_path, monkeypatch):
    """A tiny-depth model of the size's shape in a hub cache under the real repo id loads by that id, offline."""
    import huggingface_hub.constants as hub_constants

    repo, commit = HUB_IDS[size], "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    model = tiny_model(SHAPES[size])
    save(model, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    back = smollm2.load(repo)
    assert back.config == model.config
    with torch.no_grad():
        assert torch.equal(back(ids(model.config)), accelerate(model)(ids(model.config)))
    assert generate(back, ids(model.config, B=1, T=4), 3, eos_token_id=None, temperature=0).shape == (1, 7)
