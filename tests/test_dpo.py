"""DPO: preference data tokenized as TRL tokenizes it, the loss and its gradients against TRL's own, learning a
preference that holds on held-out pairs, LoRA and resuming, bad input."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, hf_copy, tiny_model

from smollm2 import SmolError, Tokenizer, cli, load
from smollm2.training import TrainConfig, train
from smollm2.training.data import PreferenceData
from smollm2.training.dpo import DPOLoss, DPOSettings, dpo_loss, reference_logps, sequence_logps
from smollm2.training.loss import IGNORE

def pair(a: int, b: int) -> dict:
    """A question and two answers, both right: the chosen one in a friendly style, the rejected one curt."""
    return {"prompt": f"What is {a} plus {b}?", "chosen": f"Sure! {a} plus {b} is {a + b}.",
            "rejected": f"Whatever. {a} plus {b} is {a + b}."}


def write_pairs(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(pair(rng.randint(0, 999), rng.randint(0, 999))) + "\n" for _ in range(n)))
    return path


def as_chats(record: dict) -> dict:
    question = {"role": "user", "content": record["prompt"]}
    return {side: [question, {"role": "assistant", "content": record[side]}] for side in ("chosen", "rejected")}


def full_ids(inputs: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """One side's token ids back from its (inputs, labels) row: inputs, then the last label, padding dropped."""
    length = int((labels != IGNORE).nonzero().max()) + 1
    return inputs[:length].tolist() + [int(labels[length - 1])]


# The same pairs, the same loss, the same gradients as TRL.

def trl_trainer(policy, ref_model, tiny_dir: Path, records: list[dict], tmp_path: Path, loss_type: str,
                label_smoothing: float):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    conversations = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                        "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                        "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                       for r in records])
    # bf16=False: TRL's default autocasts on this CPU too, and the comparison is of float32 against float32.
    settings = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=[loss_type],
                         label_smoothing=label_smoothing, bf16=False, use_cpu=True, report_to=[], max_length=None)
    return DPOTrainer(policy, ref_model=ref_model, args=settings, train_dataset=conversations,
                      processing_class=AutoTokenizer.from_pretrained(tiny_dir))


def test_preference_data_tokenizes_as_trl(tiny_dir, tmp_path):
    records = [pair(3, 4), pair(120, 7)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ours = PreferenceData(path, Tokenizer.from_pretrained(tiny_dir), seq_len=128)
    model = hf_copy(tiny_model(TINY["gqa"]))
    theirs = trl_trainer(model, copy.deepcopy(model), tiny_dir, records, tmp_path, "sigmoid", 0.0).train_dataset
    newline = Tokenizer.from_pretrained(tiny_dir).encode("\n")
    for k in range(len(records)):
        inputs, labels = ours.sides([k])
        for side, name in enumerate(("chosen", "rejected")):
            ids, answer = full_ids(inputs[0, side], labels[0, side]), theirs[k][f"{name}_ids"]
            prompt = theirs[k]["prompt_ids"]
            # TRL also scores the newline the template writes after the end-of-turn token; we stop at that token,
            # as chat fine-tuning does, since generation stops there.
            assert answer[-len(newline):] == newline
            assert ids == prompt + answer[:-len(newline)]
            scored = (labels[0, side] != IGNORE).nonzero()[:, 0] + 1  # positions in ids of the scored tokens
            assert scored.tolist() == list(range(len(prompt), len(ids)))
    again = tmp_path / "chats.jsonl"
    again.write_text("".join(json.dumps(as_chats(r)) + "\n" for r in records))
    chats = PreferenceData(again, Tokenizer.from_pretrained(tiny_dir), seq_len=128)
    assert all(torch.equal(a, b) for a, b in zip(chats.sides([0, 1]), ours.sides([0, 1])))


def as_rows(examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's examples (prompt_ids, chosen_ids, rejected_ids) as DPOLoss reads pairs: (pairs, 2, T) inputs and
    labels, [:, 0] chosen and [:, 1] rejected, right-padded, only each answer's tokens scored."""
    sides = [(e["prompt_ids"], e[f"{side}_ids"]) for e in examples for side in ("chosen", "rejected")]
    width = max(len(prompt) + len(answer) for prompt, answer in sides) - 1
    inputs = torch.zeros(len(sides), width, dtype=torch.long)
    labels = torch.full((len(sides), width), IGNORE)
    for row, (prompt, answer) in enumerate(sides):
        ids = torch.tensor(prompt + answer)
        inputs[row, :len(ids) - 1] = ids[:-1]
        labels[row, len(prompt) - 1:len(ids) - 1] = ids[len(prompt):]
    return inputs.view(len(examples), 2, width), labels.view(len(examples), 2, width)


# float32 against float32, gradients up to ~0.25 (the embeddings', summed over every position): a beta 0.1% off
# moves the loss by ~1e-5 and the gradients by ~1e-4. The log-probabilities are sums of ~180, whose float32 ulp
# (1.5e-5) moves the loss by up to beta/2 of it where transformers sums in another order: measured up to 5.4e-7
# (loss) and 2.5e-7 (gradients) across torch's AVX-512, AVX2 and baseline dispatch on a Zen 4, 4.8e-7 on a Zen 2.
LOSS_TOLERANCE, GRADIENT_TOLERANCE = 1e-6, 5e-7


@pytest.mark.parametrize("loss_type, label_smoothing, pairs", [
    ("sigmoid", 0.0, 4),
    # TRL 1.16's "sigmoid" leaves label_smoothing out; its "aot" applies it exactly as cDPO does, after sorting the
    # batch's margins, which one pair leaves as it is.
    ("aot", 0.2, 1),
])
def test_loss_and_gradients_equal_trls(tiny_dir, tmp_path, loss_type, label_smoothing, pairs):
    """TRL's own batch of its own tokenized examples, as they are (the newline after the end-of-turn token
    included): its loss, metrics and every parameter's gradient against ours from the same token ids."""
    rng = random.Random(1)
    records = [pair(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(pairs)]
    model = tiny_model(TINY["gqa"])
    reference = copy.deepcopy(model)
    # The policy moves away from the reference, the starting model, so that the margins are not all zero.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    policy = hf_copy(model)
    trainer = trl_trainer(policy, hf_copy(reference), tiny_dir, records, tmp_path, loss_type, label_smoothing)
    examples = list(trainer.train_dataset)
    batch = trainer.data_collator(examples)  # every chosen side, then every rejected
    policy.train()  # as TRL trains; the tiny config has no dropout
    theirs = trainer.compute_loss(policy, batch)
    theirs.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    inputs, labels = as_rows(examples)
    with torch.no_grad():
        reference_logps = sequence_logps(reference, inputs.flatten(0, 1), labels.flatten(0, 1)).view(-1, 2)
    loss_sums = DPOLoss(model, DPOSettings(beta=0.1, label_smoothing=label_smoothing))(inputs, labels, reference_logps)
    ours = loss_sums["loss"] / pairs
    ours.backward()
    theirs_grads = dict(policy.named_parameters())
    worst = max((p.grad - theirs_grads[name].grad).abs().max().item() for name, p in model.named_parameters())
    print(f"\n{loss_type}, label smoothing {label_smoothing}: loss ours {ours.item():.9f}, TRL's {theirs.item():.9f}; "
          f"every gradient entry within {worst:.1e} (largest "
          f"{max(p.grad.abs().max().item() for p in model.parameters()):.2f})")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOSS_TOLERANCE)
    assert theirs_grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, rtol=0, atol=GRADIENT_TOLERANCE, msg=name)
    with torch.no_grad():
        logps = sequence_logps(model, inputs.flatten(0, 1), labels.flatten(0, 1)).view(-1, 2)
    assert logps[:, 0].mean().item() == pytest.approx(metrics["logps/chosen"], abs=1e-4)  # ~-180 each in float32
    assert logps[:, 1].mean().item() == pytest.approx(metrics["logps/rejected"], abs=1e-4)
    # beta times the difference of two float32 sums of ~-180, each rounded by ~1e-5
    assert loss_sums["chosen_reward"].item() / pairs == pytest.approx(metrics["rewards/chosen"], abs=1e-5)
    assert loss_sums["rejected_reward"].item() / pairs == pytest.approx(metrics["rewards/rejected"], abs=1e-5)
    assert loss_sums["reward_accuracy"].item() / pairs == pytest.approx(metrics["rewards/accuracies"], abs=1e-6)


def test_dpo_loss_by_hand():
    chosen, rejected = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -4.0])
    ref_chosen, ref_rejected = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -5.0])
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.5, 0.1)
    margins = torch.tensor([2.0, -1.0])  # (policy chosen - rejected) - (reference chosen - rejected)
    expected = -0.9 * F.logsigmoid(0.5 * margins) - 0.1 * F.logsigmoid(-0.5 * margins)
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(chosen_rewards, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(rejected_rewards, torch.tensor([-0.5, 0.5]))


# Learning: a preference that holds on pairs it never saw.

def preference_accuracy(model, data: PreferenceData) -> float:
    """The share of pairs whose chosen answer the model finds likelier than the rejected one."""
    with torch.no_grad():
        inputs, labels = data.sides(range(len(data)))
        logps = sequence_logps(model.eval(), inputs.flatten(0, 1), labels.flatten(0, 1)).view(-1, 2)
    return (logps[:, 0] > logps[:, 1]).float().mean().item()


def test_held_out_reward_accuracy_rises(tiny_dir, tmp_path):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    train_pairs = PreferenceData(write_pairs(tmp_path / "train.jsonl", 60, seed=0), tokenizer, seq_len=128)
    held_out = PreferenceData(write_pairs(tmp_path / "held_out.jsonl", 20, seed=1), tokenizer, seq_len=128)
    model = load(tiny_dir, kernels=False)
    for pairs in (train_pairs, held_out):
        reference_logps(model, pairs)
    before = preference_accuracy(model, held_out)
    c = TrainConfig(steps=16, batch_size=6, seq_len=128, lr=1e-3, warmup=2, eval_every=20, eval_batches=3)
    train(model, tokenizer, train_pairs, held_out, c, tmp_path / "run", objective=DPOLoss(model, DPOSettings(beta=0.1)))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin"} <= records[0].keys()
    assert records[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as the reference: log 2
    after = records[-1]["val_reward_accuracy"]
    print(f"\nheld-out pairs (20): the chosen answer likelier {before:.0%} before, "
          f"{preference_accuracy(model, held_out):.0%} after; reward accuracy {after:.0%} after ({c.steps} steps), "
          f"val loss {records[-1]['val_loss']:.4f}")
    assert after >= 0.9 and records[-1]["val_loss"] < 0.5
    assert records[-1]["val_reward_margin"] > 0 and records[-1]["val_rejected_reward"] < 0


def dpo(tiny_dir: Path, data: Path, out: Path, *flags: str) -> list[dict]:
    assert cli.main(["dpo", "--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--seq-len", "128",
                     "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--schedule", "constant", "--lora-r", "8",
                     "--lora-targets", "q_proj,v_proj,down_proj", *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_dpo_writes_an_adapter_and_resumes(tiny_dir, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 24, seed=0)
    held_out = write_pairs(tmp_path / "held_out.jsonl", 8, seed=1)
    whole = dpo(tiny_dir, data, tmp_path / "whole", "--steps", "6", "--val-data", str(held_out), "--eval-every", "6")
    assert whole[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # a fresh adapter leaves the base: the reference
    assert whole[-1]["val_reward_accuracy"] > 0.5
    final = tmp_path / "whole" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists()
    run = json.loads((tmp_path / "whole" / "run.json").read_text())
    assert run["kind"] == "dpo" and run["dpo"] == {"beta": 0.1, "label_smoothing": 0.0}

    # A resumed run recomputes the reference from the starting model, not from the checkpoint it continues.
    dpo(tiny_dir, data, tmp_path / "resumed", "--steps", "4", "--save-every", "2", "--val-data", str(held_out),
        "--eval-every", "6")
    resumed = dpo(tiny_dir, data, tmp_path / "resumed", "--steps", "6", "--resume", "--val-data", str(held_out),
                  "--eval-every", "6")
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], abs=1e-5)


@pytest.mark.slow
@pytest.mark.subprocess
def test_torchrun_two_processes_match_one(tiny_dir, tmp_path):
    data, held_out = write_pairs(tmp_path / "pairs.jsonl", 16, seed=0), write_pairs(tmp_path / "held.jsonl", 4, seed=1)
    flags = ["dpo", "--model", str(tiny_dir), "--data", str(data), "--val-data", str(held_out), "--steps", "3",
             "--lr", "1e-3", "--warmup", "1", "--seq-len", "128", "--eval-every", "3", "--eval-batches", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "smollm2", *flags, "--batch-size", "4", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "smollm2",
                          *flags, "--batch-size", "2", "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    records = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("one", "two")]
    for name in ("loss", "reward_accuracy", "reward_margin"):
        assert [r[name] for r in records[1]] == pytest.approx([r[name] for r in records[0]], abs=1e-5)
    assert records[1][-1]["val_loss"] == pytest.approx(records[0][-1]["val_loss"], abs=1e-5)


# Bad input: one readable line naming the file and line.

GOOD = json.dumps(pair(1, 2))


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"prompt": "hi", "chosen": "hello"}), 'expected "chosen" and "rejected"'),
    (json.dumps({"prompt": "hi", "chosen": "hello", "rejected": 3}), '"rejected" must be a string'),
    (json.dumps({"prompt": ["hi"], "chosen": "a", "rejected": "b"}), '"prompt" must be a string'),
    (json.dumps({"chosen": "a", "rejected": "b"}), '"chosen" must be a non-empty list of messages'),
    (json.dumps({"prompt": "hi", "chosen": "  ", "rejected": "no"}), '"chosen": the answer is empty'),
    (json.dumps({"prompt": "hi", "chosen": "same", "rejected": "same"}), "give the same answer"),
    (json.dumps({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                 "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}),
     "must share every message but the last; they differ at message 0"),
    (json.dumps({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}),
     "must end with an assistant message"),
])
def test_malformed_lines_name_the_file_and_line(tiny_dir, tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(SmolError, match=f"line 2: .*{message}") as error:
        PreferenceData(path, Tokenizer.from_pretrained(tiny_dir), seq_len=128)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_pairs_too_long_are_dropped_and_counted(tiny_dir, tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    long = {"prompt": "tell me " * 100, "chosen": "no", "rejected": "yes"}
    path.write_text(GOOD + "\n" + json.dumps(long) + "\n")
    assert len(PreferenceData(path, Tokenizer.from_pretrained(tiny_dir), seq_len=128)) == 1
    assert f"{path}: dropped 1 of 2 pairs longer than seq_len 128" in capsys.readouterr().err
    path.write_text(json.dumps(long) + "\n")
    with pytest.raises(SmolError, match="all 1 pairs are longer than seq_len 128"):
        PreferenceData(path, Tokenizer.from_pretrained(tiny_dir), seq_len=128)


@pytest.mark.parametrize("flags, message", [
    (["--beta", "0"], "--beta must be a number > 0, got 0.0"),
    (["--beta", "-1"], "--beta must be a number > 0"),
    (["--beta", "nan"], "--beta must be a number > 0"),
    (["--label-smoothing", "0.5"], r"--label-smoothing must be in \[0, 0.5\), got 0.5"),
    (["--label-smoothing", "-0.1"], r"--label-smoothing must be in \[0, 0.5\)"),
])
def test_bad_dpo_settings_are_one_line(tiny_dir, tmp_path, capsys, flags, message):
    data = write_pairs(tmp_path / "pairs.jsonl", 2, seed=0)
    assert cli.main(["dpo", "--model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / "run"),
                     *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("smollm2 dpo: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_examples_need_the_reference_first(tiny_dir, tmp_path):
    data = PreferenceData(write_pairs(tmp_path / "pairs.jsonl", 2, seed=0), Tokenizer.from_pretrained(tiny_dir), 128)
    with pytest.raises(SmolError, match="reference log-probabilities are not computed"):
        data.examples([0])
