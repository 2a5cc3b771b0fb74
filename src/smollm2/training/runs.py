"""The three runs `smollm2 train`, `finetune` and `dpo` start, each a function: the data read, the model to train
made, what identifies the run for --resume recorded, then the one loop (loop.train). Each returns out/final.

    final = pretrain("tiny", "data/", "runs/tiny", TrainConfig(steps=2000, seq_len=256, lr=3e-3))
    final = finetune("chats.jsonl", "runs/lora", TrainConfig(steps=100, lr=1e-3), lora=LoRASettings(16, 32))
    final = train_dpo("pairs.jsonl", "runs/dpo", TrainConfig(steps=100, lr=1e-6), dpo=DPOSettings(beta=0.1))
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from ..config import PRESETS, SmolConfig
from ..errors import SmolError
from ..model import SmolLM2
from ..tokenizer import Tokenizer
from .data import ChatData, PreferenceData, TokenData, split_tokens
from .dpo import DPOSettings, dpo_objective
from .loop import DTYPES, TrainConfig, train
from .tuning import LoRASettings, model_to_tune


def pretrain(config: str | SmolConfig, data: str | Path, out: str | Path, c: TrainConfig, *,
             tokenizer: str | None = None, device: str = "cpu", resume: bool = False) -> Path:
    """A model of `config` (135M, 360M, 1.7B, tiny, a config.json, or a SmolConfig) from scratch, HF's
    initialization seeded by c.seed, on the token shards of `data` (a directory made by training.data.prepare),
    validated on its val split where it has one; `tokenizer` (a source as Tokenizer.from_pretrained takes it;
    None: the embedded model's) is saved with it."""
    if isinstance(config, str):
        config = PRESETS.get(config) or SmolConfig.from_json(config)
    tokens = Tokenizer.from_pretrained(tokenizer)
    train_data = TokenData(data, "train", c.seq_len, seed=c.seed)
    if train_data.vocab_size > config.vocab_size:
        raise SmolError(f"{data}: tokens from a vocabulary of {train_data.vocab_size}, but the model's has "
                        f"{config.vocab_size}")
    torch.manual_seed(c.seed)
    model = SmolLM2(config)
    run = dict(kind="pretrain", data=str(Path(data).resolve()), model=config.to_hf())
    val = TokenData(data, "val", c.seq_len, seed=c.seed) if split_tokens(data, "val") else None
    if val is None:
        print(f"{data}: no validation split, so no validation loss", file=sys.stderr)
    return train(model, tokens, train_data, val, c, out, device=device, resume=resume, run=run)


def tuned_run(kind: str, data: str | Path, model: str | None, lora: LoRASettings | None, **settings) -> dict:
    """What identifies a fine-tune (SFT or DPO) for --resume: its data, its starting model, its own settings,
    its adapter's."""
    run = dict(kind=kind, data=str(Path(data).resolve()), model=model or "embedded", **settings)
    return run if lora is None else {**run, "lora": lora.as_run()}


def finetune(data: str | Path, out: str | Path, c: TrainConfig, *, model: str | None = None,
             val_data: str | Path | None = None, lora: LoRASettings | None = None, device: str = "cpu",
             resume: bool = False) -> Path:
    """Supervised fine-tuning of `model` (as smollm2.load takes it; None: the embedded one) on the chats of
    `data` (JSONL, one {"messages": [...]} a line), learning the assistant's tokens alone; val_data: chats for
    the validation loss. lora: a fresh adapter alone trained over the frozen weights (lora.quantize="int8": over
    an int8 base, QLoRA), and out/final holds it alone, in PEFT's format (see model_to_tune)."""
    tokenizer = Tokenizer.from_pretrained(model)
    chats = ChatData(data, tokenizer, c.seq_len, seed=c.seed)
    val = ChatData(val_data, tokenizer, c.seq_len, seed=c.seed) if val_data else None
    run = tuned_run("finetune", data, model, lora)
    tuned = model_to_tune(model, lora, c.seed)
    return train(tuned, tokenizer, chats, val, c, out, device=device, resume=resume, run=run, adapter_base=model)


def train_dpo(data: str | Path, out: str | Path, c: TrainConfig, *, model: str | None = None,
              val_data: str | Path | None = None, lora: LoRASettings | None = None,
              dpo: DPOSettings = DPOSettings(), device: str = "cpu", resume: bool = False) -> Path:
    """Direct Preference Optimization of `model` (as finetune) on the pairs of `data` (JSONL, one {"prompt",
    "chosen", "rejected"} a line, or {"chosen": [messages], "rejected": [messages]}); val_data: pairs for the
    validation loss and reward accuracy. The starting model is the reference: its log-probabilities of every
    pair are computed once, before training (dpo.dpo_objective); `dpo` says how far the policy may move from
    it (beta) and what share of pairs to assume mislabelled (label_smoothing), checked when it is made, before
    the data and the model load."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SmolError("--device cuda: no CUDA device is available")
    tokenizer = Tokenizer.from_pretrained(model)
    pairs = PreferenceData(data, tokenizer, c.seq_len, seed=c.seed)
    val = PreferenceData(val_data, tokenizer, c.seq_len, seed=c.seed) if val_data else None
    run = tuned_run("dpo", data, model, lora, dpo=dataclasses.asdict(dpo))
    tuned = model_to_tune(model, lora, c.seed)
    objective = dpo_objective(tuned, pairs, val, c.batch_size, device, DTYPES[c.dtype], dpo)
    return train(tuned, tokenizer, pairs, val, c, out, device=device, resume=resume, run=run, adapter_base=model,
                 objective=objective)
