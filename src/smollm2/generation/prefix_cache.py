"""Automatic prefix caching: the keys and values of prompts' prefill chunks, kept for later prompts that start
with the same tokens (a chat's history, sent again each turn; a shared system prompt; the choices of one request).

A block is one whole prefill chunk (PREFILL_CHUNK tokens, at a multiple of it), found by its tokens and the
block before it, so a block means one exact prefix. Since a prefill's chunks end at the same slots wherever it
starts (steps.chunks), a block holds the very bits that computing its chunk again would give, and so does every
chunk computed after it: a request's tokens are the same, bit for bit, with the cache on or off. The price is
the grain: a prompt reuses whole chunks only, and its last chunk only where an equal prompt was prefilled
before (the other choices of an `n` request, a retry), whose last hidden state is kept with it.

Memory is bounded in bytes; the least recently used block goes first. A block is always used (and stored) with
every block before it, and those are marked used after it, so an evicted block is never one that others extend.

On disk (DiskCache, `smollm2 serve --prefix-cache-dir`), each block is also a safetensors file that outlives the
process: a later process, or another on a shared disk, reads a block it does not hold in memory from there
instead of computing it. A file's name is a hash of the model's identity and every token up to the block's end
(each block's name hashes the one before it), under a folder of that identity; the identity hashes what
decides a block's bits: the weights' content, the config, the KV cache's dtypes, the model's dtype and device,
torch's version and CPU tier, the kernels' build and mode, the engine thread's thread count, the chunk size. A file
is trusted for nothing: its size, its metadata (format, identity, the block before it), its tensors' names,
dtypes and shapes are checked before anything is allocated, then its tensors against their checksum and its
tokens against the prompt's; a file that fails is refused (logged, counted) and its chunk computed again, which
writes it anew. What a read file holds is what computing the chunk in this process gives, bit for bit, with one
reservation: with SMOLLM2_KERNELS=auto, a close call between a kernel and torch (choosing.py) that a later
process measures again may fall the other way, and that process then computes other bits (to float rounding).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import build_key
from ..kernels.held import HeldWeight
from . import steps

log = logging.getLogger(__name__)

FORMAT = "smollm2-prefix-cache-1"  # a file's metadata "format": a later layout gets a new one, never misread
HEADER_ROOM = 1 << 16  # bytes a file may hold beyond its tensors' own: safetensors' JSON header
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
                      torch.int64: "I64"}


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (the id of the block before it, 0 for none; its tokens)
    parts: list[torch.Tensor]  # each KVCache.parts[i][:, row, :, begin:end], (L, n_kv, n, ...): in the cache's dtype
    h: torch.Tensor | None = None  # where a prompt ended with this chunk: its last position's hidden state, (1, 1, C)
    name: str = ""  # its prefix's name on disk (DiskCache.name), "" without a disk

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.parts, self.h) if t is not None)

    @property
    def length(self) -> int:
        """The slots (tokens) it holds."""
        return self.parts[0].shape[-2]


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._ids = itertools.count(1)
        self.looked_up = self.found = 0  # prompt tokens looked up, and found cached (metrics' hit rate)
        self.disk: DiskCache | None = None  # where blocks are also kept, and looked for, beyond this process
        self.from_disk = 0  # prompt tokens found on disk (of those found)

    def lookup(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks the prompt starts with, in order. All but the last end before its last token; the
        last may end the prompt, where an equal prompt ended before (its `h` then stands for the whole prefill).
        A block not in memory is read from the disk, where there is one."""
        found, parent, size = [], 0, steps.PREFILL_CHUNK
        for begin in range(0, len(prompt), size):
            tokens, last = prompt[begin:begin + size], begin + size >= len(prompt)
            block = self.blocks.get((parent, tuple(tokens)))
            if (block is None or (last and block.h is None)) and self.disk is not None:
                block = self._read(found, tokens)
            if block is None or (last and block.h is None):
                break
            found.append(block)
            parent = block.id
        self._used(found)
        self.looked_up += len(prompt)
        self.found += sum(block.length for block in found)
        return found

    def store(self, before: list[Block], tokens: Sequence[int], parts: list[torch.Tensor],
              h: torch.Tensor | None = None) -> Block | None:
        """Keep a chunk's keys and values (parts: its slots of each KVCache.parts, copied), after the blocks
        `before` it, and where the chunk ends a prompt, the last position's hidden state h; returns its block, or
        None where that prefix is no longer cached (evicted meanwhile) or the block exceeds the budget. A block
        new, or new to its h, is written to the disk too."""
        block, new = self._keep(before, tokens, parts, h)
        if new and self.disk is not None:
            self.disk.write(block, before[-1].name if before else None, tokens)
        return block

    def _keep(self, before: list[Block], tokens: Sequence[int], parts: list[torch.Tensor],
              h: torch.Tensor | None) -> tuple[Block | None, bool]:
        """store()'s work in memory: the block, and whether it is new or newly holds h (None, False where not
        kept)."""
        if before and self.blocks.get(before[-1].key) is not before[-1]:
            return None, False
        key = (before[-1].id if before else 0, tuple(tokens))
        block, new = self.blocks.get(key), False
        if block is None:
            name = self.disk.name(before[-1].name if before else None, tokens) if self.disk is not None else ""
            block, new = Block(next(self._ids), key, [t.clone() for t in parts], name=name), True
            if block.bytes > self.max_bytes:
                return None, False
            self.blocks[key] = block
            self.bytes += block.bytes
        if h is not None and block.h is None:
            block.h, new = h.clone(), True
            self.bytes += block.h.numel() * block.h.element_size()
        self._used([*before, block])
        while self.bytes > self.max_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= evicted.bytes
        return (block, new) if self.blocks.get(key) is block else (None, False)

    def _read(self, before: list[Block], tokens: Sequence[int]) -> Block | None:
        """The block of `tokens` after `before`, read from the disk into memory; None where no usable file is."""
        parent = before[-1].name if before else None
        read = self.disk.read(self.disk.name(parent, tokens), parent, tokens)
        if read is None:
            return None
        block, _ = self._keep(before, tokens, *read)
        if block is not None:
            self.from_disk += block.length
        return block

    def _used(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # the first block last: most recently used, so evicted after the rest
            self.blocks.move_to_end(block.key)


class Refused(Exception):
    """A file the disk cache will not use, and why."""


class DiskCache:
    """A prefix cache's blocks as files in a folder (see the module's docstring): written as they are computed,
    read where memory lacks them. Never fails a request: a file that cannot be written or read is logged and
    passed over. Unbounded: the folder keeps every block written until someone removes it."""

    def __init__(self, directory: str | Path, model, cache, threads: int):
        """directory: where the folders of every model's identity go; model: what computes the blocks, on
        `threads` CPU threads, into `cache` (a KVCache of the engine's, whose parts' dtypes and shapes a block's
        must have). Hashes the model's weights: a second or two for the 135M model in float32."""
        self.identity = model_identity(model, cache, threads)
        self.directory = Path(directory) / self.identity[:32]
        # What each tensor of a block of n tokens must be: KVCache.parts' (L, B, n_kv, S, ...) -> (L, n_kv, n, ...)
        self.parts = [(t.dtype, (t.shape[0], t.shape[2], t.shape[4])) for t in cache.parts]
        self.hidden = (cache.dtype, (1, 1, model.config.hidden_size))
        self.refused = 0  # files refused, since this process started

    def name(self, parent: str | None, tokens: Sequence[int]) -> str:
        """The name of the block of `tokens` after the block named `parent` (None: the first)."""
        digest = hashlib.sha256(f"{parent or self.identity}\0".encode())
        digest.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        return digest.hexdigest()

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.safetensors"

    def write(self, block: Block, parent: str | None, tokens: Sequence[int]) -> None:
        tensors = {"tokens": torch.tensor(list(tokens), dtype=torch.int64),
                   **{f"part.{i}": t.contiguous() for i, t in enumerate(block.parts)}}
        if block.h is not None:
            tensors["h"] = block.h.contiguous()
        import safetensors.torch  # here: ~0.75 MiB resident a run without a disk cache never reads

        metadata = {"format": FORMAT, "identity": self.identity, "parent": parent or "", "sha256": checksum(tensors)}
        path = self.path(block.name)
        # Written whole under another name, then renamed: a reader (another process) never sees half a file.
        temporary = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(safetensors.torch.save(tensors, metadata))
            os.replace(temporary, path)
        except OSError as e:
            log.warning("prefix cache: cannot write %s: %s", path, e)
            temporary.unlink(missing_ok=True)

    def read(self, name: str, parent: str | None, tokens: Sequence[int]) \
            -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """The parts and h (None if the file has none) of the block named `name`, which holds `tokens` after the
        block named `parent`; None where there is no such file, or it is refused (logged and counted)."""
        path = self.path(name)
        try:
            size = path.stat().st_size
        except OSError:
            return None
        try:
            return self._checked(path, size, parent, tokens)
        except Exception as e:  # Refused, or whatever safetensors raised of a file it could not parse
            self.refused += 1
            log.warning("prefix cache: refusing %s (computing its chunk again): %s", path, e)
            return None

    def _checked(self, path: Path, size: int, parent: str | None, tokens: Sequence[int]):
        from safetensors import safe_open  # (as write's)

        n = len(tokens)
        expected = {"tokens": (torch.int64, (n,)),
                    **{f"part.{i}": (dtype, (L, H, n, D)) for i, (dtype, (L, H, D)) in enumerate(self.parts)}}
        most = HEADER_ROOM + sum(dtype.itemsize * math.prod(shape) for dtype, shape in
                                 [*expected.values(), self.hidden])
        if size > most:
            raise Refused(f"{size} bytes, more than a block of {n} tokens takes ({most})")
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != FORMAT or metadata.get("identity") != self.identity:
                raise Refused("written for another model, KV cache dtype or machine (its identity differs)")
            if metadata.get("parent") != (parent or ""):
                raise Refused("it follows another prefix")
            keys = set(file.keys())
            if "h" in keys:
                expected["h"] = self.hidden
            if keys != expected.keys():
                raise Refused(f"it holds {sorted(keys)}, not {sorted(expected)}")
            for key, (dtype, shape) in expected.items():
                view = file.get_slice(key)
                if view.get_dtype() != SAFETENSORS_DTYPES.get(dtype) or tuple(view.get_shape()) != shape:
                    raise Refused(f"{key} is {view.get_dtype()} {tuple(view.get_shape())}, not "
                                  f"{SAFETENSORS_DTYPES.get(dtype)} {shape}")
            tensors = {key: file.get_tensor(key) for key in expected}
        if checksum(tensors) != metadata.get("sha256"):
            raise Refused("its tensors do not match their checksum")
        if tensors["tokens"].tolist() != list(tokens):
            raise Refused("it holds other tokens")
        return [tensors[f"part.{i}"] for i in range(len(self.parts))], tensors.get("h")


def raw_bytes(t: torch.Tensor):
    """A tensor's bytes, as a buffer hashlib reads."""
    return t.detach().reshape(-1).view(torch.uint8).cpu().numpy()


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode() + b"\0")
        digest.update(raw_bytes(tensors[key]))
    return digest.hexdigest()


def model_identity(model, cache, threads: int) -> str:
    """A hash of what decides the bits of the keys and values a prefill writes into `cache` (see the module's
    docstring): the model's weights and config, the cache's dtypes, and how this process computes them."""
    accelerator = model.__dict__.get("accelerator")
    kernels = None if accelerator is None or accelerator.mode == "off" else [accelerator.mode, build_key(),
                                                                              accelerator.int8_activations]
    how = dict(config=model.config.to_hf(), cache=[str(t.dtype) for t in cache.parts], dtype=str(cache.dtype),
               device=str(cache.k.device), torch=torch.__version__, cpu=torch.backends.cpu.get_cpu_capability(),
               kernels=kernels, threads=threads, chunk=steps.PREFILL_CHUNK)
    digest = hashlib.sha256(json.dumps(how, sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}\0".encode())
        if isinstance(t, HeldWeight):  # its blocks, which decide its values: not a float32 copy of every matrix
            digest.update(f"held {t.packed.type}\0".encode())
            t = t.packed.data
        digest.update(raw_bytes(t))
    return digest.hexdigest()
