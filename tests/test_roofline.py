"""The roofline profiler: it times every operation of a pass through the hook points, with what each reads and
computes, against a machine measured once and kept."""

from __future__ import annotations

import json

import torch

from conftest import TINY, as_variant, tiny_model
from smollm2 import roofline


def random_ids(config, shape, seed=0):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_the_profile_times_every_operation_and_keeps_the_machine(tmp_path, monkeypatch, variant):
    config = TINY["gqa"]
    model = as_variant(tiny_model(config), variant)
    measured = []
    monkeypatch.setattr(roofline, "measure", lambda device: measured.append(device) or roofline.Machine(1e10, 1e11))
    file = tmp_path / "machine.json"
    profile = roofline.profile(model, random_ids(config, (10,)).tolist(), repeats=2, file=lambda: file)
    again = roofline.profile(model, random_ids(config, (10,)).tolist(), repeats=2, file=lambda: file)
    assert len(measured) == 1 and profile.machine == again.machine == roofline.Machine(1e10, 1e11)  # kept, not measured
    assert json.loads(file.read_text()) == {f"cpu-{torch.get_num_threads()}-threads": dict(bandwidth=1e10, flops=1e11)}
    per_layer = ["residual", "ln1", "q_proj", "k_proj", "v_proj", "rope", "scores", "softmax", "mix", "o_proj", "ln2",
                 "gate_proj", "up_proj", "silu_mul", "down_proj"]
    expected = [(None, "embed")] + [(layer, name) for layer in range(config.num_hidden_layers) for name in per_layer] \
        + [(None, "ln_final"), (None, "lm_head"), (None, "sample")]
    for ops, tokens in ((profile.prefill, 10), (profile.decode, 1)):
        assert [(op.layer, op.name) for op in ops] == expected
        assert all(op.seconds > 0 for op in ops)
        q = next(op for op in ops if op.name == "q_proj")
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert (q.bytes, q.flops) == (weight.numel() * 4 + tokens * config.hidden_size * 4,
                                      2 * tokens * weight.numel())
    assert profile.served_prefill_s > 0 and profile.served_decode_s > 0
    file.write_text("not json")  # unreadable: measured again
    roofline.profile(model, [1, 2, 3], repeats=1, file=lambda: file)
    assert len(measured) == 2


def test_measure_reports_plausible_limits():
    machine = roofline.measure(torch.device("cpu"))
    assert 1e8 < machine.bandwidth < 1e13 and 1e8 < machine.flops < 1e15


def test_a_gguf_models_costs_count_the_blocks_it_reads(model):
    """The embedded model's matrices are held as their file's blocks (Q4_1, the tied embedding Q8_0): a product
    reads those bytes, not the float32 values torch sees (5.3x more for Q4_1)."""
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    C = model.config.hidden_size
    assert roofline.costs(model, 0, "q_proj", 1, 8)[0] == q_proj.packed.data.nbytes + C * 4 < q_proj.numel() * 4 / 5
    assert roofline.costs(model, None, "lm_head", 1, 8)[0] == model.output_weight.packed.data.nbytes + C * 4
