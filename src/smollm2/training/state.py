"""Training checkpoints that survive a crash.

A checkpoint is a directory, out/checkpoints/step-0000100/, holding
    config.json + model.safetensors   the weights, a HF directory the loader, the CLI and transformers read;
                                      in a LoRA run, adapter_config.json + adapter_model.safetensors instead:
                                      the adapter alone, in PEFT's format (the base never changes)
    trainer.pt                        optimizer state and RNG states (tensors and numbers only: weights_only)
    state.json                        the step it was taken after, and the run's settings
It is written under a temporary name, every file fsynced, then renamed into place: a directory with a final
name is always complete, and a crash leaves at worst a temporary one, removed at the next start.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import SmolError

PREFIX, TEMPORARY = "step-", ".tmp-"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) fills a fresh directory; it then replaces `target` in one rename (both fsynced first)."""
    tmp = target.with_name(f"{TEMPORARY}{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if target.exists():  # only `final/`, when a finished run is extended: the old copy goes first
        shutil.rmtree(target)
    os.rename(tmp, target)
    _fsync(target.parent)


def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in `out`, oldest first."""
    directory = out / "checkpoints"
    found = directory.glob(f"{PREFIX}*") if directory.is_dir() else []
    return sorted(p for p in found if p.is_dir() and p.name[len(PREFIX):].isdigit())


def remove_partial(out: Path) -> None:
    """Leftovers of a crash mid-write: never complete, never read."""
    for p in [*(out / "checkpoints").glob(f"{TEMPORARY}*"), *out.glob(f"{TEMPORARY}*")]:
        shutil.rmtree(p, ignore_errors=True)


def save(out: Path, step: int, write_weights: Callable[[Path], None], trainer: dict, state: dict,
         keep: int) -> Path:
    """Write the checkpoint taken after `step` steps (its weights: write_weights(directory)), then delete all but
    the newest `keep`."""

    def write(tmp: Path) -> None:
        write_weights(tmp)
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2) + "\n")

    target = out / "checkpoints" / f"{PREFIX}{step:07d}"
    write_atomically(target, write)
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    return target


def load(path: Path) -> tuple[dict, dict]:
    """(trainer state, state.json) of a checkpoint directory; its weights are the loop's to read."""
    try:
        state = json.loads((path / "state.json").read_text())
        with warnings.catch_warnings():  # about a pickle protocol torch does not write: what follows says more
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            trainer = torch.load(path / "trainer.pt", weights_only=True)  # never unpickle arbitrary objects
    except pickle.UnpicklingError:  # torch's own message runs to many lines of advice to unpickle it anyway
        raise SmolError(f"{path / 'trainer.pt'}: not a trainer state (it holds objects other than tensors and "
                        f"numbers, which are never loaded)") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise SmolError(f"{path}: unreadable training checkpoint ({e})") from None
    return trainer, state
