"""Shared fixtures: the embedded SmolLM2-135M-Instruct (ours and transformers'), and tiny random configs."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from smollm2 import PRESETS, SmolConfig, SmolLM2, load, save
from smollm2.kernels import accelerate
from smollm2.checkpoints import default_model_path

DATA = Path(__file__).parent / "data"

# The kernels wherever they can run, not the faster of kernel and torch on this machine: tests compare them with
# torch, the same way on every run, and write no measured choices into the user's cache (bench's processes too).
# Every accelerator made from here on reads it.
os.environ["SMOLLM2_KERNELS"] = "on"

# Tiny LLaMA variants that exercise every branch of the architecture.
TINY = {
    "gqa": PRESETS["tiny"],
    "mqa": dataclasses.replace(PRESETS["tiny"], num_key_value_heads=1),
    "mha": dataclasses.replace(PRESETS["tiny"], num_key_value_heads=4),
    "bias": dataclasses.replace(PRESETS["tiny"], attention_bias=True, mlp_bias=True),
    "untied": dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=False),
    "head_dim": dataclasses.replace(PRESETS["tiny"], head_dim=24),
}


def tiny_model(config: SmolConfig, seed: int = 0) -> SmolLM2:
    """A randomly initialised model; biases and norm weights randomised too, so every weight matters."""
    torch.manual_seed(seed)
    model = SmolLM2(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def clear_leads(logits: torch.Tensor, layers: int) -> torch.Tensor:
    """Where fp32's top token leads its runner-up by more than bf16 rounding can move two logits apart, (...,)
    from logits (..., V) of a model of `layers` blocks. Nearer ties fall either way in bf16, on torch too, and
    differently on each CPU: the share of top tokens kept is no measure of a bf16 computation.

    bf16 keeps 8 significant bits: a rounding moves a value by up to u = 2**-8 of itself. Each block rounds the
    residual stream twice, 2L roundings that add up like a random walk to ~sqrt(2L) u of the stream, which the
    logits inherit relative to their size (s, the largest |logit| at the position); two logits can move apart by
    twice that: 2 sqrt(2L) u s, ~15 u s for 30 blocks. (Measured on the embedded model: the top two moved apart
    by at most 5.3 u s, on torch's bf16 with and without bf16 arithmetic and on the kernels of every x86 tier.)"""
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] > 2 * math.sqrt(2 * layers) * 2.0**-8 * logits.abs().amax(-1)


REAL_MODEL_FIXTURES = {"model", "reference_model", "hf_model"}


def pytest_sessionstart(session):
    """The kernels' tests skip where no C compiler is; where one is and the kernels did not build, that is a
    failure to see, not a reason to skip them."""
    from smollm2.kernels import build

    if shutil.which(os.environ.get("CC", "cc")) and build.compiled() is None:
        raise pytest.UsageError("a C compiler is here but kernels.c did not build: see the warning above")


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


VARIANTS = ("reference", "accelerated")  # model.py as it is, and with smollm2.accelerate applied


def as_variant(model: SmolLM2, variant: str) -> SmolLM2:
    return accelerate(model) if variant == "accelerated" else model


@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    return request.param


def torch_row_variance(model: SmolLM2, rows: int = 16) -> str | None:
    """Why model.py on torch alone may give a row other bits among other rows, or None: torch promises no row
    its bits whatever the rows beside it, and its BLAS keeps none on some CPUs (MKL's sgemm sums a row otherwise at
    2 rows than at 4 on a Zen 4), so promises of bit-identical rows that the kernels keep on every CPU hold on the
    reference path only where each of the model's products, probed here at every row count, keeps them."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                x = torch.randn(rows, module.in_features, generator=generator, dtype=module.weight.dtype)
                full = torch.nn.functional.linear(x, module.weight)
                for m in range(1, rows):
                    if not torch.equal(torch.nn.functional.linear(x[:m], module.weight), full[:m]):
                        return f"torch's product for {name} gives a row other bits at {m} rows than at {rows} here"
    return None


def hf_copy(model: SmolLM2):
    """transformers' LlamaForCausalLM with the same weights (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded next: its random start took seconds for the embedded model
        hf = LlamaForCausalLM(LlamaConfig(**model.config.to_hf())).eval()
    hf.tie_weights()  # which the skipped initialisation would have done
    hf.load_state_dict(model.state_dict(), strict=False)  # tied lm_head is shared, not stored
    return hf.float()


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def model() -> SmolLM2:
    """The embedded SmolLM2-135M-Instruct, fp32, accelerated (as smollm2.load loads it on the CPU)."""
    return load()


@pytest.fixture(scope="session")
def reference_model() -> SmolLM2:
    """The same, model.py's reference modules alone."""
    return load(kernels=False)


@pytest.fixture
def either_model(variant, model, reference_model) -> SmolLM2:
    return model if variant == "accelerated" else reference_model


@pytest.fixture(scope="session")
def hf_model(embedded_path):
    """transformers' own load of the same GGUF file, fp32: the numeric reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(embedded_path.parent), gguf_file=embedded_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random model with the real tokenizer, as a HF directory (context window: 512 tokens)."""
    from smollm2 import Tokenizer

    path = tmp_path_factory.mktemp("tiny")
    save(tiny_model(TINY["gqa"]), path)
    Tokenizer.from_pretrained().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def english() -> str:
    return (DATA / "english.txt").read_text()
