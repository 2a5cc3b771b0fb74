"""Training: the fused loss, schedules, resuming after kill -9, torchrun, fine-tuning and export, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, TINY

from smollm2 import SmolLM2, Tokenizer, load
from smollm2.training import TrainConfig, train
from smollm2.training.data import TokenData, prepare
from smollm2.training.loop import learning_rate, param_groups
from smollm2.training.loss import IGNORE, linear_cross_entropy

SMALL = ["--config", "tiny", "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--warmup", "2",
         "--eval-every", "3", "--eval-batches", "2"]


def smollm2(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smollm2", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           "-m", "smollm2", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three ~25 KB texts (sentences of the English test text, shuffled), prepared into shards."""
    tmp = tmp_path_factory.mktemp("corpus")
    sentences = DATA.joinpath("english.txt").read_text().replace("\n", " ").split(". ")
    files = []
    for k in range(3):
        rng = random.Random(k)
        paragraphs = [". ".join(rng.sample(sentences, 8)) + "." for _ in range(30)]
        files.append(tmp / f"part{k}.txt")
        files[-1].write_text("\n\n".join(paragraphs))
    prepare(files, tmp / "data", Tokenizer.from_pretrained(), val_fraction=0.3, progress=False)
    return tmp / "data"


# The fused output projection + cross-entropy.

@pytest.mark.parametrize("rows", [1, 300, 1000])
def test_linear_cross_entropy_equals_the_plain_loss_and_gradients(rows, monkeypatch):
    monkeypatch.setattr("smollm2.training.loss.CHUNK_ELEMENTS", 7 * 5000)  # several chunks, a ragged last one
    torch.manual_seed(0)
    h = torch.randn(rows, 48, requires_grad=True)
    w = (0.1 * torch.randn(5000, 48)).requires_grad_()
    y = torch.randint(0, 5000, (rows,))
    y[::3] = IGNORE
    plain = F.cross_entropy(F.linear(h, w), y, reduction="sum", ignore_index=IGNORE)
    grads = torch.autograd.grad(plain, (h, w))
    fused = linear_cross_entropy(h, w, y)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    for ours, reference in zip(torch.autograd.grad(2 * fused, (h, w)), grads):
        torch.testing.assert_close(ours, 2 * reference, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_computes_only_the_gradients_asked():
    """A frozen output projection (LoRA) gets no gradient, and the hidden states' is the same as with it."""
    torch.manual_seed(0)
    h, y = torch.randn(10, 16, requires_grad=True), torch.randint(0, 100, (10,))
    w = torch.randn(100, 16)
    (grad_h,) = torch.autograd.grad(linear_cross_entropy(h, w, y), h)
    trained = w.clone().requires_grad_()
    torch.testing.assert_close(grad_h, torch.autograd.grad(linear_cross_entropy(h, trained, y), (h, trained))[0],
                               rtol=0, atol=0)
    linear_cross_entropy(h, trained, y).backward(inputs=[trained])  # and a frozen h gets none either
    assert h.grad is None and trained.grad is not None


def test_linear_cross_entropy_under_bf16_autocast():
    torch.manual_seed(0)
    h, w = torch.randn(64, 32), 0.1 * torch.randn(1000, 32)
    y = torch.randint(0, 1000, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(h, w, y)
        plain = F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")
    torch.testing.assert_close(fused, plain, rtol=1e-2, atol=0)


# Schedules and parameter groups.

def test_schedules_warm_up_then_decay_to_min_lr():
    c = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert [learning_rate(c, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    cosine = [learning_rate(c, s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(cosine, cosine[1:])) and cosine[-1] == pytest.approx(0.1)
    wsd = dataclasses.replace(c, schedule="wsd", cooldown=0.2)
    assert all(learning_rate(wsd, s) == 1.0 for s in range(10, 80))
    assert learning_rate(wsd, 90) == pytest.approx(0.55, abs=0.05) and learning_rate(wsd, 99) == pytest.approx(0.1)
    assert learning_rate(dataclasses.replace(c, schedule="constant"), 99) == 1.0


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = SmolLM2(TINY["bias"])
    decay, no_decay = param_groups(model, TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(n.endswith("proj.weight") for n in map(names.get, map(id, decay["params"])))
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= {names[id(p)] for p in no_decay["params"]}
    decay, _ = param_groups(model, TrainConfig(decay_embeddings=True))
    assert any(p is model.model.embed_tokens.weight for p in decay["params"])


# MFU: the FLOPs each step computed, over a peak that a busy machine does not lower.

class Clock:
    """time.perf_counter for code under test: `tick` seconds later at each call."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_mfu_counts_every_micro_batch_at_its_real_length(tmp_path, monkeypatch):
    """Chats of ~45 tokens under --seq-len 128, 2 micro-batches of 2: tokens/s and MFU count the 4 examples as long
    as the longest, against the kept peak, with each step timed at exactly 0.5 s."""
    from smollm2.training import flops as mfu
    from smollm2.training import loop
    from smollm2.training.data import ChatData

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                      {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                             for i in range(8)))
    monkeypatch.setattr(mfu, "cache_dir", lambda: tmp_path)
    peak = mfu.PeakFlops(torch.device("cpu"), torch.float32)  # measured once here; the run reads this back:
    peak.file.write_text(json.dumps({peak.key: {"flops": 1e12, "measurements": mfu.MEASUREMENTS}}))
    monkeypatch.setattr(loop.time, "perf_counter", Clock(0.5))  # a step from one call to the next
    tokenizer = Tokenizer.from_pretrained()
    data = ChatData(chats, tokenizer, 128)
    c = TrainConfig(steps=2, batch_size=2, grad_accum=2, seq_len=128, warmup=1)
    model = SmolLM2(TINY["gqa"])
    train(model, tokenizer, data, None, c, tmp_path / "run")
    config, records = model.config, [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    for step, record in enumerate(records):
        inputs, labels = data.examples(range(4 * step, 4 * step + 4))
        assert inputs.shape[1] < 64  # the batch's length, not --seq-len
        tokens, length = inputs.numel(), inputs.shape[1]
        weights = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 256)  # 2 blocks: q, k, v, o and the MLP
        expected = tokens * (6 * weights + 12 * 2 * 4 * 16 * length) + tokens * 6 * config.vocab_size * 64
        assert record["tokens_per_s"] == pytest.approx(tokens / 0.5)
        assert record["mfu"] == pytest.approx(expected / 0.5 / 1e12)


def test_a_busy_machine_neither_lowers_the_peak_nor_lifts_mfu_past_100_percent(tmp_path, monkeypatch):
    """Products timed as on a busy machine (4x slower), then a quiet one: the kept peak is the best ever
    measured, a busy measurement never lowers it, a step faster than it raises it, and MFU stays at most 1."""
    from smollm2.training import flops as mfu

    monkeypatch.setattr(mfu, "SIZE", {"cpu": 64})
    monkeypatch.setattr(mfu, "cache_dir", lambda: tmp_path)
    quiet, busy = 1e-3, 4e-3
    rate = 2 * 64**3

    def peak(seconds: float):
        monkeypatch.setattr(mfu.PeakFlops, "product_seconds", lambda self, a, b: seconds)
        return mfu.PeakFlops(torch.device("cpu"), torch.float32)

    first = peak(busy)
    assert first.flops == pytest.approx(rate / busy) and first.measurements == 1
    assert first.utilisation(rate / busy * 2, 1.0) == 1.0  # a step twice as fast: the peak was low
    assert peak(busy).flops == pytest.approx(rate / busy * 2)  # kept; a busy measurement does not lower it
    third = peak(quiet)
    assert third.flops == pytest.approx(rate / quiet) and third.measurements == 3
    assert peak(busy).flops == pytest.approx(rate / quiet) and third.measurements == 3  # measured no more
    assert third.utilisation(rate / busy, 1.0) == pytest.approx(quiet / busy)  # a busy step: a low MFU
    assert "GFLOP/s" in third.describe() and str(tmp_path) in third.describe()


# The loop.

def run_in_process(corpus: Path, out: Path, **settings) -> list[float]:
    c = TrainConfig(**{**dict(steps=4, seq_len=32, lr=3e-3, warmup=2, eval_every=2, eval_batches=2), **settings})
    torch.manual_seed(0)
    model = SmolLM2(TINY["gqa"])
    train(model, Tokenizer.from_pretrained(), TokenData(corpus, "train", 32), TokenData(corpus, "val", 32), c, out)
    return losses(out)


def test_gradient_accumulation_equals_one_big_batch(corpus, tmp_path):
    big = run_in_process(corpus, tmp_path / "big", batch_size=4)
    accumulated = run_in_process(corpus, tmp_path / "accumulated", batch_size=2, grad_accum=2)
    assert accumulated == pytest.approx(big, abs=1e-5)


def test_metrics_checkpoints_and_final_model(corpus, tmp_path):
    run_in_process(corpus, tmp_path, batch_size=2, save_every=1, keep=2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= records[0].keys()
    assert "val_loss" in records[1] and "val_loss" not in records[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000003", "step-0000004"]
    final = load(tmp_path / "final")
    last = load(tmp_path / "checkpoints" / "step-0000004")
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), last.state_dict().values()))
    assert Tokenizer.from_pretrained(tmp_path / "final").encode("hello world") == \
        Tokenizer.from_pretrained().encode("hello world")


def test_pretrain_is_what_the_train_command_runs(corpus, tmp_path):
    """training.pretrain in Python and `smollm2 train` with the same settings: the same losses, the same model."""
    from smollm2 import cli
    from smollm2.training import pretrain

    c = TrainConfig(steps=2, seq_len=32, batch_size=4, lr=3e-3, warmup=2, eval_every=3, eval_batches=2)
    final = pretrain("tiny", corpus, tmp_path / "python", c)
    assert final == tmp_path / "python" / "final"
    assert cli.main(["train", *SMALL, "--steps", "2", "--data", str(corpus), "--out", str(tmp_path / "cli")]) == 0
    assert losses(tmp_path / "python") == losses(tmp_path / "cli")
    assert all(torch.equal(a, b) for a, b in zip(load(final).state_dict().values(),
                                                 load(tmp_path / "cli" / "final").state_dict().values()))


@pytest.mark.subprocess
def test_kill_9_then_resume_gives_the_uninterrupted_losses(corpus, tmp_path):
    steps = ["--steps", "12", "--save-every", "2", "--data", str(corpus)]
    whole = smollm2("train", *SMALL, *steps, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr

    out = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "smollm2", "train", *SMALL, *steps, "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (out / "checkpoints" / "step-0000004").exists() and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "final").exists(), "killed too late to test anything"
    for checkpoint in (out / "checkpoints").iterdir():  # whatever the kill interrupted, no half-written checkpoint
        assert not checkpoint.name.startswith("step-") or load(checkpoint) is not None

    resumed = smollm2("train", *SMALL, *steps, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(out) == pytest.approx(losses(tmp_path / "whole"), abs=1e-5)
    assert len(losses(out)) == 12


@pytest.mark.subprocess
def test_torchrun_two_processes_match_one(corpus, tmp_path):
    """DDP; FSDP's two processes are held to one's by the sharded checkpoints' test below."""
    steps = ["--steps", "4", "--data", str(corpus), "--save-every", "4"]
    one = smollm2("train", *SMALL, *steps, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "train", *SMALL, *steps, "--batch-size", "2", "--out", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-4)
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()


@pytest.mark.subprocess
@pytest.mark.slow
def test_sharded_checkpoints_resume_on_another_number_of_processes(corpus, tmp_path):
    """FSDP: 2 steps on two processes, resumed on one for 2 more, then on two again: the losses of 6 steps on
    one process, uninterrupted, and the final model written by two."""
    # constant: the learning rates of the first steps do not depend on --steps, so a run stopped by --steps 2
    # then resumed with --steps 4 is the uninterrupted one
    run = [*SMALL, "--schedule", "constant", "--data", str(corpus), "--save-every", "2", "--fsdp"]
    same_global_batch = {1: ["--batch-size", "4"], 2: ["--batch-size", "2"]}

    def train_on(processes: int, out: Path, steps: int, *flags: str) -> None:
        args = ["train", *run, *same_global_batch[processes], "--steps", str(steps), "--out", str(out), *flags]
        result = torchrun(2, *args) if processes == 2 else smollm2(*args)
        assert result.returncode == 0, result.stderr[-3000:]

    train_on(1, tmp_path / "whole", 6)
    out = tmp_path / "2-then-1-then-2"
    for processes, steps in [(2, 2), (1, 4), (2, 6)]:
        train_on(processes, out, steps, *(["--resume"] if steps > 2 else []))
        if steps < 6:
            checkpoint = out / "checkpoints" / f"step-{steps:07d}"
            assert sorted(p.name for p in checkpoint.iterdir()) == \
                [".metadata", *(f"__{rank}_0.distcp" for rank in range(processes)), "state.json", "trainer.pt"]
    assert losses(out) == pytest.approx(losses(tmp_path / "whole"), abs=1e-5)
    assert len(losses(out)) == 6
    assert (out / "final" / "model.safetensors").is_file() and load(out / "final") is not None


@pytest.mark.subprocess
def test_finetune_exports_a_model_transformers_and_the_cli_read(tiny_dir, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                                                      {"role": "assistant", "content": f"{a} plus {a} is {2 * a}."}]})
                             + "\n" for a in range(10)))
    out = tmp_path / "run"
    result = smollm2("finetune", "--model", str(tiny_dir), "--data", str(chats), "--val-data", str(chats),
                     "--out", str(out), "--steps", "3", "--seq-len", "128", "--batch-size", "2", "--eval-every", "3")
    assert result.returncode == 0, result.stderr
    assert "val_loss" in json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    ours = load(out / "final")
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    ids = torch.tensor([Tokenizer.from_pretrained(out / "final").apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 3?"}])])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
    before = load(tiny_dir)
    assert not torch.equal(before(ids), ours(ids))  # it did learn something
    answer = smollm2("chat", "--model", str(out / "final"), "-p", "What is 3 plus 3?", "--temperature", "0",
                     "--max-new-tokens", "4")
    assert answer.returncode == 0, answer.stderr


# Bad input: one readable line, exit status 1.

def refusal(capsys, *args: str) -> str:
    """The one line `smollm2 ARGS` (run in this process) fails with."""
    from smollm2 import cli

    capsys.readouterr()
    assert cli.main(list(args)) == 1
    return capsys.readouterr().err.strip().splitlines()[-1]


def error_of(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


def test_an_output_directory_holding_another_run_is_refused(corpus, tmp_path, capsys):
    from smollm2 import cli

    train = ["train", *SMALL, "--steps", "1", "--data", str(corpus), "--out"]
    assert cli.main([*train, str(tmp_path / "run")]) == 0
    assert "pass --resume" in refusal(capsys, *train, str(tmp_path / "run"))
    assert "--resume with different train settings" in refusal(capsys, *train, str(tmp_path / "run"), "--resume",
                                                              "--lr", "1e-3")
    assert "--resume with a different global batch" in refusal(capsys, *train, str(tmp_path / "run"), "--resume",
                                                               "--batch-size", "2")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "not empty" in refusal(capsys, *train, str(tmp_path / "other"))
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_missing_or_damaged_shard_is_one_line_naming_the_checkpoint(corpus, tmp_path):
    run = ["train", *SMALL, "--data", str(corpus), "--steps", "2", "--fsdp", "--out", str(tmp_path)]
    assert smollm2(*run).returncode == 0
    shard = tmp_path / "checkpoints" / "step-0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{shard.parent}: unreadable sharded checkpoint" in error_of(smollm2(*run, "--resume"))
    shard.unlink()
    assert f"{shard.parent}: unreadable sharded checkpoint" in error_of(smollm2(*run, "--resume"))


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "1000"], "exceeds the model's context window"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_training_settings(corpus, tmp_path, flags, message, capsys):
    assert message in refusal(capsys, "train", *SMALL, "--data", str(corpus), "--out", str(tmp_path / "run"), *flags)


def test_bad_chat_data_names_the_line(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                  "content": "hello"}]})
                     + "\n" + json.dumps({"text": "no messages"}) + "\n")
    assert f"{chats}, line 2" in refusal(capsys, "finetune", "--data", str(chats), "--out", str(tmp_path / "o"))
    chats.write_bytes(b"\xff\xfe not utf-8\n")
    assert str(chats) in refusal(capsys, "finetune", "--data", str(chats), "--out", str(tmp_path / "o"))
