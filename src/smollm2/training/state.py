"""Training checkpoints that survive a crash.

A checkpoint is a directory, out/checkpoints/step-0000100/, holding
    config.json + model.safetensors   the weights, a HF directory the loader, the CLI and transformers read;
                                      in a LoRA run, adapter_config.json + adapter_model.safetensors instead:
                                      the adapter alone, in PEFT's format (the base never changes)
    trainer.pt                        optimizer state and RNG states (tensors and numbers only: weights_only)
    state.json                        the step it was taken after, and the run's settings
A sharded run (FSDP) holds instead the weights and optimizer state as torch.distributed.checkpoint (DCP) wrote
them: .metadata and one __RANK_0.distcp file of shards per rank, each written by its own rank, so no rank ever
holds the whole model; trainer.pt then holds the RNG states alone. DCP reads them back into any number of ranks.
It is written under a temporary name, every file fsynced, then renamed into place: a directory with a final
name is always complete, and a crash leaves at worst a temporary one, removed at the next start.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..checkpoints.checkpoint import stored_type_error
from ..errors import SmolError

PREFIX, TEMPORARY = "step-", ".tmp-"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(target: Path, write: Callable[[Path], None], every_rank: bool = False) -> None:
    """write(tmp) fills a fresh directory; it then replaces `target` in one rename (both fsynced first).

    every_rank: every rank calls this and write(tmp) runs on each, writing its own files; rank 0 alone creates the
    directory and renames it, once every rank has written.
    """
    tmp = target.with_name(f"{TEMPORARY}{target.name}")
    rank0 = not every_rank or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if every_rank:
        dist.barrier()  # the directory exists before any rank writes into it
    write(tmp)
    if every_rank:
        dist.barrier()  # and it is complete before it gets its final name
    if not rank0:
        return
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
         keep: int, sharded: bool = False) -> Path:
    """Write the checkpoint taken after `step` steps (its weights: write_weights(directory)), then delete all but
    the newest `keep`. sharded: every rank calls this, and write_weights writes that rank's shards."""
    rank0 = not sharded or dist.get_rank() == 0

    def write(tmp: Path) -> None:
        write_weights(tmp)
        if rank0:
            torch.save(trainer, tmp / "trainer.pt")
            (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2) + "\n")

    target = out / "checkpoints" / f"{PREFIX}{step:07d}"
    write_atomically(target, write, every_rank=sharded)
    if rank0:
        for old in checkpoints(out)[:-keep]:
            shutil.rmtree(old)
    return target


def _shard_options(adapter: bool) -> StateDictOptions:
    """Each rank's own shards, nothing gathered; a LoRA run's frozen base is never saved (nor expected back)."""
    return StateDictOptions(ignore_frozen_params=adapter, strict=not adapter)


def save_shards(directory: Path, model, optimizer, adapter: bool) -> None:
    """This rank's shards of the model and optimizer state, into `directory` (every rank calls it: dcp.save)."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_shard_options(adapter))
    dcp.save(dict(model=model_state, optimizer=optimizer_state), checkpoint_id=directory)


class _ShardReader(FileSystemReader):
    """DCP's reader, but its .metadata unpickled by _MetadataUnpickler: a checkpoint is data, never code."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """What DCP's metadata holds: its own classes, torch's dtypes, Size and layouts, and paths; nothing else."""

    def find_class(self, module, name):
        if (module == "torch.distributed.checkpoint.metadata"
                or (module, name) in {("torch", "Size"), ("torch.serialization", "_get_layout"),
                                      ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                      ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor value (the optimizer's param_groups) read as data alone (weights_only),
    where DCP itself would unpickle anything."""

    def load_bytes(self, read_item, value) -> None:
        data = torch.load(value, weights_only=True)
        checked = io.BytesIO()
        torch.save(data, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def check_shard_types(path: Path) -> None:
    """The model's tensors in a sharded checkpoint are of floating types, as its metadata says, before any is
    read: a weight stored as integers would load as garbage."""
    try:
        metadata = _ShardReader(path).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as e:
        raise SmolError(f"{path}: unreadable sharded checkpoint, a file is missing or damaged "
                        f"({type(e).__name__}: {e})") from None
    for name, item in metadata.state_dict_metadata.items():
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        if name.startswith("model.") and dtype is not None and not dtype.is_floating_point:
            raise stored_type_error(path, name.removeprefix("model."), str(dtype).removeprefix("torch."),
                                    ("float32", "float16", "bfloat16"))


def load_shards(path: Path, model, optimizer, adapter: bool) -> None:
    """Load a sharded checkpoint into `model` and `optimizer` as they are sharded now, on however many ranks the
    checkpoint was written by: dcp.load reads into each rank's shards the parts of the saved ones they cover."""
    check_shard_types(path)
    options = _shard_options(adapter)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = dict(model=model_state, optimizer=optimizer_state)
    try:
        dcp.load(state, storage_reader=_ShardReader(path), planner=_DataOnlyPlanner())
    except CheckpointException as e:  # its message is every rank's traceback: the first failure's first line will do
        reason = next(iter(e.failures.values()))[0]
        first_line = str(reason).split("\n")[0]
        raise SmolError(f"{path}: unreadable sharded checkpoint, a file is missing or damaged "
                        f"({type(reason).__name__}: {first_line})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


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
