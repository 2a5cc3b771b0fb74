"""bench.compare, which `smollm2 bench` calls: each system timed in a process of its own, what smollm2 reports of
its runs, and the run's shape checked before anything loads."""

from __future__ import annotations

import pytest

from smollm2 import SmolError, bench


@pytest.mark.subprocess
def test_compare_times_smollm2_beside_torch_and_reports_its_runs(tiny_dir):
    found = bench.compare(bench.Setup(model=str(tiny_dir), prompt_tokens=8, new_tokens=4, speculative="ngram"),
                          others=("torch",), repeats=1)
    assert [speed.system for speed in found.speeds] == ["smollm2", "smollm2 (torch)"]
    assert all(speed.prefill_tok_s > 0 and speed.decode_tok_s > 0 for speed in found.speeds)
    assert found.kernels == "on" and found.weights_read == "float32"  # conftest's SMOLLM2_KERNELS; fp32 weights
    assert found.tokens_per_pass >= 1 and (found.acceptance is None or 0 <= found.acceptance <= 1)
    assert found.table().splitlines()[-1].startswith("ratio to smollm2 (torch)")


@pytest.mark.parametrize("setup, message", [
    (dict(batch_size=0), "--batch-size must be at least 1"),
    (dict(prompt_tokens=0), "--prompt-tokens must be at least 1"),
    (dict(new_tokens=1), "--new-tokens must be at least 2"),
])
def test_a_run_too_small_to_time_is_refused_before_anything_loads(setup, message):
    with pytest.raises(SmolError, match=message):
        bench.Setup(**setup)


def test_others_and_repeats_are_checked(tiny_dir):
    with pytest.raises(SmolError, match="--repeats must be at least 1"):
        bench.compare(bench.Setup(model=str(tiny_dir)), repeats=0)
    with pytest.raises(SmolError, match="others must be among torch, transformers, got llama"):
        bench.compare(bench.Setup(model=str(tiny_dir)), others=("llama",))


@pytest.mark.subprocess
def test_compare_reports_which_activations_the_decoding_products_multiplied(tiny_dir):
    for int8, activations in ((False, "exact"), (True, "int8")):
        found = bench.compare(bench.Setup(model=str(tiny_dir), prompt_tokens=8, new_tokens=2, int8_activations=int8),
                              repeats=1)
        assert found.activations == activations
