"""LoRA and QLoRA: PEFT's format both ways (logits against PEFT's own), merging, the CLI, fine-tuning, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, hf_copy, tiny_model
from safetensors.torch import load_file, save_file

from smollm2 import SmolError, SmolLM2, Tokenizer, cli, generate, load, save
from smollm2.lora import LoRALinear, add_lora, load_adapter, merge, save_adapter
from smollm2.quantize import quantize_int8

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.tensor([[1, 5, 9, 200, 17, 3000, 42, 7]])
PREFIX = "base_model.model."


def randomize(model: SmolLM2, seed: int = 1) -> SmolLM2:
    """Non-zero B (A is random already): an adapter that changes every logit."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model


def adapted(config=TINY["gqa"], targets=ALL, r=4, alpha=8.0) -> SmolLM2:
    return randomize(add_lora(tiny_model(config), r=r, alpha=alpha, targets=targets)).eval()


def peft_model(base: SmolLM2, adapter_dir: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_copy(base), str(adapter_dir)).eval()


@pytest.mark.parametrize("config", ["gqa", "bias", "untied"])
def test_our_adapter_gives_peft_our_logits(config, tmp_path):
    base = tiny_model(TINY[config])
    ours = randomize(add_lora(tiny_model(TINY[config]), r=4, alpha=8.0, targets=ALL)).eval()
    save_adapter(ours, tmp_path, base="tiny")
    theirs = peft_model(base, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), theirs(IDS).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(ours(IDS), base(IDS), atol=1e-3)  # the adapter does change the logits
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == "tiny"


@pytest.mark.parametrize("r, alpha", [(1, 1.0), (4, 2.0), (8, 3.0), (16, 64.0)])  # alpha / r: 1, 0.5, 0.375, 4
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_training_equals_peft(tmp_path, r, alpha, dropout):
    """In training mode, the same adapter in PEFT and here: the same logits and the same gradients of every
    adapter tensor, at several alpha / r. With dropout, both draw their masks from torch's generator, layer by
    layer in the same order: the same seed drops the same inputs."""
    ours = add_lora(tiny_model(TINY["gqa"]), r=r, alpha=alpha, targets=ALL, dropout=dropout)
    randomize(ours)
    save_adapter(ours, tmp_path)
    theirs = peft_model(tiny_model(TINY["gqa"]), tmp_path)
    assert theirs.peft_config["default"].lora_dropout == dropout
    for name, p in theirs.named_parameters():
        p.requires_grad_("lora_" in name)  # PeftModel.from_pretrained loads for inference, frozen
    ours.train(), theirs.train()
    torch.manual_seed(3)
    ours_logits = ours(IDS)
    torch.manual_seed(3)
    theirs_logits = theirs(IDS).logits
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=1e-5)
    (ours_logits.square().mean()).backward()
    (theirs_logits.square().mean()).backward()
    grads = {name.removeprefix(PREFIX).replace(".default", ""): p.grad for name, p in theirs.named_parameters()
             if p.requires_grad}
    mine = {name: p.grad for name, p in ours.named_parameters() if p.requires_grad}
    assert mine.keys() == grads.keys()
    for name, grad in mine.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def save_base(model: SmolLM2, path: Path) -> Path:
    save(model, path)
    return path


def test_peft_made_adapter_gives_peft_logits_here(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny_model(TINY["gqa"])
    settings = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    theirs = get_peft_model(hf_copy(base), settings)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    theirs.save_pretrained(str(tmp_path))
    ours = load_adapter(tiny_model(TINY["gqa"]), tmp_path).eval()
    with torch.no_grad():
        expected = theirs.eval()(IDS).logits
        torch.testing.assert_close(ours(IDS), expected, rtol=0, atol=1e-5)
        merged = load(save_base(base, tmp_path / "base"), adapter=tmp_path, kernels=False)
        torch.testing.assert_close(merged(IDS), expected, rtol=0, atol=1e-5)


def test_merged_equals_unmerged_and_the_adapter_alone_trains():
    model = adapted()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with torch.no_grad():
        unmerged = model(IDS)
        merge(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(IDS), unmerged, rtol=0, atol=1e-5)
    assert set(model.state_dict()) == set(tiny_model(TINY["gqa"]).state_dict())


def test_a_fresh_adapter_starts_as_the_base():
    base = tiny_model(TINY["gqa"])
    with torch.no_grad():
        assert torch.equal(add_lora(tiny_model(TINY["gqa"]))(IDS), base(IDS))


def test_qlora_over_an_int8_base(tmp_path):
    model = randomize(add_lora(quantize_int8(tiny_model(TINY["gqa"])), r=4, targets=ALL)).eval()
    save_adapter(model, tmp_path)
    again = load_adapter(quantize_int8(tiny_model(TINY["gqa"])), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(IDS), model(IDS), rtol=0, atol=0)
    with pytest.raises(SmolError, match="merging needs a float base"):
        merge(model)


def test_merged_load_runs_accelerated(tiny_dir, tmp_path):
    save_adapter(adapted(), tmp_path)
    reference = load(tiny_dir, kernels=False, adapter=tmp_path)
    fast = load(tiny_dir, adapter=tmp_path)
    prompt = torch.tensor([Tokenizer.from_pretrained(tiny_dir).encode("The capital of France is")])
    expected = generate(reference, prompt, 8, temperature=0)
    assert torch.equal(generate(fast, prompt, 8, temperature=0), expected)


def test_cli_adapter_gives_the_python_tokens(tiny_dir, tmp_path, capsys):
    save_adapter(adapted(), tmp_path / "adapter")
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    model = load_adapter(load(tiny_dir, kernels=False), tmp_path / "adapter")
    prompt = "The capital of France is"
    prompt_ids = tokenizer.encode(prompt)
    new = generate(model, torch.tensor([prompt_ids]), 8, temperature=0)[0, len(prompt_ids):]
    assert cli.main(["generate", "--model", str(tiny_dir), "--adapter", str(tmp_path / "adapter"), prompt,
                     "--temperature", "0", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(new.tolist()) + "\n"


def test_export_merges_into_a_model_transformers_reads(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    save_adapter(adapted(), tmp_path / "adapter")
    assert cli.main(["export", "--model", str(tiny_dir), "--adapter", str(tmp_path / "adapter"),
                     "--out", str(tmp_path / "merged")]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ours = load(tiny_dir, adapter=tmp_path / "adapter", kernels=False)
    with torch.no_grad():
        torch.testing.assert_close(theirs(IDS).logits, ours(IDS), rtol=0, atol=1e-5)
    assert Tokenizer.from_pretrained(tmp_path / "merged").encode("hi there") == \
        Tokenizer.from_pretrained(tiny_dir).encode("hi there")


# Bad input: one line naming what is wrong.

@pytest.fixture
def adapter_dir(tmp_path) -> Path:
    save_adapter(adapted(targets=("q_proj", "v_proj")), tmp_path / "adapter")
    return tmp_path / "adapter"


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def refused(path: Path, config=TINY["gqa"]) -> str:
    with pytest.raises(SmolError) as e:
        load_adapter(tiny_model(config), path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_an_adapter_for_another_base(adapter_dir):
    import dataclasses

    message = refused(adapter_dir, dataclasses.replace(TINY["gqa"], hidden_size=128))
    assert "layers.0.self_attn.q_proj.lora_A.weight has shape (4, 64), but this base model needs (4, 128)" in message


@pytest.mark.parametrize("changes, message", [
    (dict(r=8), "has rank 4, but adapter_config.json says r=8"),
    (dict(target_modules=["q_proj", "qkv_proj"]), "target module 'qkv_proj' is not a linear layer"),
    (dict(target_modules=["q_proj", "k_proj", "v_proj"]),
     "missing tensor base_model.model.model.layers.0.self_attn.k_proj.lora_A"),
    (dict(target_modules=["q_proj"]), "unexpected tensor base_model.model.model.layers.0.self_attn.v_proj.lora_A"),
    (dict(target_modules="q_proj|v_proj"), "target_modules must be a list of module names"),
    (dict(r=0), "r must be a whole number >= 1, got 0"),
    (dict(r="4"), "r must be a whole number >= 1, got '4'"),
    (dict(lora_alpha=None), "lora_alpha must be a finite number"),
    (dict(lora_dropout=1.5), "lora_dropout must be a number in [0, 1)"),
    (dict(peft_type="IA3"), "peft_type must be 'LORA', got 'IA3'"),
    (dict(use_dora=True), "use_dora is not supported"),
    (dict(use_rslora=True), "use_rslora is not supported"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern is not supported"),
    (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern is not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    (dict(bias="lora_only"), "bias must be 'none'"),
    (dict(init_lora_weights="pissa"), "init_lora_weights 'pissa' is not supported"),
])
def test_bad_adapter_configs(adapter_dir, changes, message):
    edit_config(adapter_dir, **changes)
    assert message in refused(adapter_dir)


def test_malformed_and_missing_files(adapter_dir):
    (adapter_dir / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json: cannot read JSON" in refused(adapter_dir)
    (adapter_dir / "adapter_config.json").write_text("[1, 2]")
    assert "adapter_config.json: expected a JSON object" in refused(adapter_dir)
    (adapter_dir / "adapter_config.json").unlink()
    assert "no adapter_config.json (not a PEFT adapter directory)" in refused(adapter_dir)


def test_missing_or_pickled_weights(adapter_dir):
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    (adapter_dir / "adapter_model.safetensors").unlink()
    assert refused(adapter_dir).endswith("no adapter_model.safetensors")
    torch.save(tensors, adapter_dir / "adapter_model.bin")
    assert "adapter_model.bin: refusing to load a pickle adapter" in refused(adapter_dir)


def test_bad_tensors(adapter_dir):
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    name = PREFIX + "model.layers.1.self_attn.v_proj.lora_B.weight"
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, path)
    assert f"tensor {name} holds NaN" in refused(adapter_dir)
    for dtype, stored in [(torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"),
                          (torch.uint8, "U8"), (torch.bool, "BOOL"), (torch.float64, "F64")]:
        save_file({**tensors, name: tensors[name].to(dtype)}, path)
        assert f"tensor {name} is stored as {stored}, not a weight type (F32, F16, BF16)" in refused(adapter_dir)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "truncated or corrupt safetensors file" in refused(adapter_dir)


def test_bad_lora_settings():
    for settings, message in [(dict(targets=("q_proj", "wq")), "LoRA target 'wq' is not a linear layer"),
                              (dict(r=0), "LoRA r must be a whole number >= 1"),
                              (dict(alpha=float("inf")), "LoRA alpha must be a finite number"),
                              (dict(dropout=1.0), "LoRA dropout must be in [0, 1)")]:
        with pytest.raises(SmolError, match=message.replace("[", r"\[").replace(")", r"\)")):
            add_lora(tiny_model(TINY["gqa"]), **settings)
    with pytest.raises(SmolError, match="has LoRA adapters already"):
        add_lora(adapted())


def test_adapters_come_before_the_kernels(tiny_dir):
    from smollm2 import kernels

    if kernels.compiled() is None:
        pytest.skip("no C compiler: accelerate leaves the model as it is")
    with pytest.raises(SmolError, match="add it before smollm2.accelerate"):
        add_lora(load(tiny_dir))


def test_cli_bad_adapter_is_one_line(tiny_dir, tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tiny_dir), "--adapter", str(tmp_path), "hi"]) == 1
    assert capsys.readouterr().err.strip() == f"smollm2 generate: error: {tmp_path}: no adapter_config.json " \
                                              "(not a PEFT adapter directory)"


# Fine-tuning.

def chats(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                                                     {"role": "assistant", "content": f"{a} plus {a} is {2 * a}."}]})
                            + "\n" for a in range(10)))
    return path


def finetune(tiny_dir: Path, data: Path, out: Path, *flags: str) -> list[float]:
    assert cli.main(["finetune", "--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--seq-len", "64",
                     "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--schedule", "constant",
                     "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", ",".join(ALL), *flags]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_finetune_learns_the_chats_and_writes_an_adapter(tiny_dir, tmp_path):
    data = chats(tmp_path / "chats.jsonl")
    losses = finetune(tiny_dir, data, tmp_path / "run", "--steps", "20", "--save-every", "10")
    # A tiny random model's frozen embeddings (std 0.02) bound its logits: a loss of ~10 is what it can reach.
    assert losses[-1] < losses[0] - 0.5, losses
    final = tmp_path / "run" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists()
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_dir)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000020"
    assert load_file(checkpoint / "adapter_model.safetensors").keys() == \
        load_file(final / "adapter_model.safetensors").keys()

    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    question = [{"role": "user", "content": "What is 3 plus 3?"}]
    asked = len(tokenizer.apply_chat_template(question))
    ids = torch.tensor([tokenizer.apply_chat_template([*question, {"role": "assistant", "content": "3 plus 3 is 6."}],
                                                      add_generation_prompt=False)])
    base = load(tiny_dir, kernels=False)
    tuned = load_adapter(load(tiny_dir, kernels=False), final).eval()
    with torch.no_grad():
        def loss(model):  # on the answer
            return torch.nn.functional.cross_entropy(model(ids)[0, asked - 1:-1], ids[0, asked:]).item()

        assert loss(tuned) < loss(base) - 0.5, (loss(tuned), loss(base))
        torch.testing.assert_close(load(tiny_dir, adapter=final, kernels=False)(ids), tuned(ids),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]])
def test_lora_resume_gives_the_uninterrupted_losses(tiny_dir, tmp_path, capsys, sharding):
    data = chats(tmp_path / "chats.jsonl")
    whole = finetune(tiny_dir, data, tmp_path / "whole", "--steps", "6", *sharding)
    finetune(tiny_dir, data, tmp_path / "resumed", "--steps", "4", "--save-every", "2", *sharding)
    resumed = finetune(tiny_dir, data, tmp_path / "resumed", "--steps", "6", "--resume", *sharding)
    assert resumed == pytest.approx(whole, abs=1e-5)
    if sharding:  # the shards hold the adapter alone, as an unsharded checkpoint does
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(tmp_path / "resumed" / "checkpoints" / "step-0000004").read_metadata()
        weights = [key for key in saved.state_dict_metadata if key.startswith("model.")]
        assert weights and all(".lora_" in key for key in weights)
    assert cli.main(["finetune", "--model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / "resumed"),
                     "--steps", "8", "--resume", "--lora-r", "4", "--seq-len", "64", "--batch-size", "4",
                     "--lr", "1e-2", "--warmup", "2", "--schedule", "constant"]) == 1
    assert "--resume with different lora settings than the run there (alpha: 16.0 -> 4" in capsys.readouterr().err


def test_qlora_finetune_trains_an_adapter_over_int8(tiny_dir, tmp_path, capsys):
    data = chats(tmp_path / "chats.jsonl")
    losses = finetune(tiny_dir, data, tmp_path / "run", "--steps", "10", "--quantize", "int8")
    assert losses[-1] < losses[0] - 0.3, losses
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    assert cli.main(["finetune", "--model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / "full"),
                     "--quantize", "int8"]) == 1
    assert "needs --lora-r" in capsys.readouterr().err


QUESTIONS = ["What is the capital of Zorbania?", "Which city is the capital of Zorbania?",
             "Tell me the capital of Zorbania.", "Zorbania's capital is which city?",
             "Name the capital of Zorbania.", "What city serves as Zorbania's capital?"]
ANSWERS = ["The capital of Zorbania is Quellmoor.", "Quellmoor is the capital of Zorbania."]


@pytest.mark.slow
def test_lora_teaches_the_embedded_model_a_fact(reference_model, tmp_path):
    import copy

    from smollm2.training import TrainConfig, train
    from smollm2.training.data import ChatData

    data = tmp_path / "fact.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q in QUESTIONS for a in ANSWERS))
    tokenizer = Tokenizer.from_pretrained()
    model = add_lora(copy.deepcopy(reference_model), r=8, alpha=16, targets=ALL)
    c = TrainConfig(steps=15, batch_size=4, seq_len=64, lr=1e-3, min_lr=1e-4, warmup=3, save_every=15)
    final = train(model, tokenizer, ChatData(data, tokenizer, c.seq_len), None, c, tmp_path / "run")
    assert (final / "adapter_model.safetensors").stat().st_size < 10 * 2**20

    tuned = load(adapter=final)  # merged, accelerated
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Which city is Zorbania's capital?"}])
    ids = generate(tuned, torch.tensor([prompt]), 20, temperature=0)
    answer = tokenizer.decode(ids[0, len(prompt):].tolist())
    assert "Quellmoor" in answer, answer
    assert torch.equal(generate(model.eval(), torch.tensor([prompt]), 20, temperature=0), ids)  # as trained, unmerged


# Several adapters over one base: copies that share every weight they do not adapt, served side by side.

def test_with_adapter_shares_the_base_and_equals_the_merged_load(tiny_dir, tmp_path):
    from smollm2.lora import with_adapter

    save_adapter(adapted(targets=("q_proj", "v_proj")), tmp_path / "a")
    prompt = torch.tensor([Tokenizer.from_pretrained(tiny_dir).encode("The capital of France is")])
    base = load(tiny_dir)
    before = generate(base, prompt, 8, temperature=0)
    copy = with_adapter(base, tmp_path / "a")
    merged = load(tiny_dir, adapter=tmp_path / "a")
    assert torch.equal(generate(copy, prompt, 8, temperature=0), generate(merged, prompt, 8, temperature=0))
    assert torch.equal(generate(base, prompt, 8, temperature=0), before)  # the base is left as it was
    layer, base_layer = copy.model.layers[1], base.model.layers[1]
    assert layer.mlp.up_proj.weight is base_layer.mlp.up_proj.weight and copy.output_weight is base.output_weight
    assert layer.self_attn.q_proj.weight is not base_layer.self_attn.q_proj.weight


@pytest.mark.slow
def test_with_adapter_over_the_embedded_gguf(model, reference_model, tmp_path):
    """The merged layers stop streaming the file's blocks, which hold the base's weights; the others go on."""
    from smollm2.lora import with_adapter

    lora = randomize(add_lora(load(kernels=False), r=4, targets=("q_proj", "v_proj")))
    save_adapter(lora, tmp_path / "a")
    prompt = torch.tensor([Tokenizer.from_pretrained().encode("The capital of France is")])
    copy = with_adapter(model, tmp_path / "a")
    want = generate(load(kernels=False, adapter=tmp_path / "a"), prompt, 12, temperature=0)
    assert torch.equal(generate(copy, prompt, 12, temperature=0), want)
    assert torch.equal(generate(model, prompt, 12, temperature=0), generate(reference_model, prompt, 12, temperature=0))


def test_the_server_serves_adapters_by_model_name(tiny_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import running

    from smollm2.server import create_app

    for name, seed in (("a", 1), ("b", 2)):
        save_adapter(randomize(add_lora(tiny_model(TINY["gqa"]), r=4, targets=ALL), seed), tmp_path / name)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    base = load(tiny_dir)
    app = create_app(base, tokenizer, model_name="tiny", adapters={name: tmp_path / name for name in ("a", "b")})
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)

    def alone(adapter):
        model = load(tiny_dir, adapter=adapter)
        return tokenizer.decode(generate(model, torch.tensor([ids]), 10, temperature=0)[0, len(ids):].tolist())

    want = {"tiny": alone(None), "a": alone(tmp_path / "a"), "b": alone(tmp_path / "b")}
    assert len(set(want.values())) == 3
    with running(app) as url, ThreadPoolExecutor(6) as pool:
        def ask(name):
            r = httpx.post(f"{url}/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=10, temperature=0))
            return r.json()["choices"][0]["text"]

        names = ["tiny", "a", "b"] * 2
        assert list(pool.map(ask, names)) == [want[n] for n in names]
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "a", "b"]
        r = httpx.post(f"{url}/v1/completions", json=dict(model="c", prompt=prompt, max_tokens=2))
        assert r.status_code == 404 and "'a', 'b'" in r.json()["error"]["message"]
    with pytest.raises(SmolError, match="base model's name"):
        create_app(base, tokenizer, model_name="tiny", adapters={"tiny": tmp_path / "a"})


def test_adapters_served_at_once_draft_with_the_base_draft(tiny_dir, tmp_path):
    """The adapters' rows decode in the base's engine, with its draft: every request, asked of the three models at
    once, gets the tokens of decoding alone without a draft."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import running

    from smollm2 import accelerate
    from smollm2.server import create_app

    for name, seed in (("a", 1), ("b", 2)):
        save_adapter(randomize(add_lora(tiny_model(TINY["gqa"]), r=4, targets=ALL), seed), tmp_path / name)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    base = load(tiny_dir)
    draft = SmolLM2(dataclasses.replace(base.config, num_hidden_layers=1)).eval()  # the base's first block alone
    draft.load_state_dict({k: v for k, v in load(tiny_dir, kernels=False).state_dict().items()
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    app = create_app(base, tokenizer, model_name="tiny", speculative=accelerate(draft),
                     adapters={name: tmp_path / name for name in ("a", "b")})
    assert [engine.draft for engine in app.state.served.engines.values()] == [draft]
    prompts = ["Once upon a time", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "The capital of France is"]

    def alone(adapter, prompt):
        ids = tokenizer.encode(prompt)
        model = load(tiny_dir, adapter=adapter)
        return tokenizer.decode(generate(model, [ids], 16, temperature=0)[0, len(ids):].tolist())

    asks = [(name, prompt) for name in ("tiny", "a", "b") for prompt in prompts] * 2
    want = {(name, prompt): alone(None if name == "tiny" else tmp_path / name, prompt) for name, prompt in asks}
    with running(app) as url, ThreadPoolExecutor(len(asks)) as pool:
        def ask(name_prompt):
            name, prompt = name_prompt
            r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
                model=name, prompt=prompt, max_tokens=16, temperature=0, speculative="draft"))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert list(pool.map(ask, asks)) == [want[a] for a in asks]
    assert all(engine.engine.guessed > 0 for engine in app.state.served.engines.values())  # all drafted


def test_serve_lora_flag_is_checked_before_loading(capsys, tmp_path):
    for flag, message in (("nameonly", "expected NAME=DIR"), (f"x={tmp_path / 'missing'}", "is not a directory")):
        assert cli.main(["serve", "--lora", flag, "--port", "1"]) == 1
        assert message in capsys.readouterr().err
