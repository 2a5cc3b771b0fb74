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
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import steps


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (the id of the block before it, 0 for none; its tokens)
    parts: list[torch.Tensor]  # each KVCache.parts[i][:, row, :, begin:end], (L, n_kv, n, ...): in the cache's dtype
    h: torch.Tensor | None = None  # where a prompt ended with this chunk: its last position's hidden state, (1, 1, C)

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

    def lookup(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks the prompt starts with, in order. All but the last end before its last token; the
        last may end the prompt, where an equal prompt ended before (its `h` then stands for the whole prefill)."""
        found, parent, size = [], 0, steps.PREFILL_CHUNK
        for begin in range(0, len(prompt), size):
            block = self.blocks.get((parent, tuple(prompt[begin:begin + size])))
            if block is None or (begin + size >= len(prompt) and block.h is None):
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
        None where that prefix is no longer cached (evicted meanwhile) or the block exceeds the budget."""
        if before and self.blocks.get(before[-1].key) is not before[-1]:
            return None
        key = (before[-1].id if before else 0, tuple(tokens))
        block = self.blocks.get(key)
        if block is None:
            block = Block(next(self._ids), key, [t.clone() for t in parts])
            if block.bytes > self.max_bytes:
                return None
            self.blocks[key] = block
            self.bytes += block.bytes
        if h is not None and block.h is None:
            block.h = h.clone()
            self.bytes += block.h.numel() * block.h.element_size()
        self._used([*before, block])
        while self.bytes > self.max_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= evicted.bytes
        return block if self.blocks.get(key) is block else None

    def _used(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # the first block last: most recently used, so evicted after the rest
            self.blocks.move_to_end(block.key)
