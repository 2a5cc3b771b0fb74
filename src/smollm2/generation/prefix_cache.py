"""Automatic prefix caching: the keys and values of prompts' prefill chunks, kept for later prompts that start
with the same tokens (a chat's history, sent again each turn; a shared system prompt; the choices of one request).

A block is one whole prefill chunk (PREFILL_CHUNK tokens, at a multiple of it), found by its tokens and the
block before it, so a block means one exact prefix. Since a prefill's chunks end at the same slots wherever it
starts (steps.chunks), a block holds the very bits that computing its chunk again would give, and so does every
chunk computed after it: a request's tokens are the same, bit for bit, with the cache on or off. The price is
the grain: a prompt reuses whole chunks only, and never its last token, whose logits it needs.

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
    k: torch.Tensor  # (L, n_kv, steps.PREFILL_CHUNK, hd), as KVCache.k[:, row, :, begin:end]
    v: torch.Tensor


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._ids = itertools.count(1)
        self.looked_up = self.found = 0  # prompt tokens looked up, and found cached (metrics' hit rate)

    def lookup(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks the prompt starts with, in order; all of them end before its last token."""
        found, parent, size = [], 0, steps.PREFILL_CHUNK
        for begin in range(0, len(prompt) - size, size):  # the blocks that end at its last token or before
            block = self.blocks.get((parent, tuple(prompt[begin:begin + size])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        self._used(found)
        self.looked_up += len(prompt)
        self.found += len(found) * size
        return found

    def store(self, before: list[Block], tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> Block | None:
        """Keep a whole chunk's keys and values (copied), after the blocks `before` it; returns its block, or None
        where that prefix is no longer cached (evicted meanwhile) or one block exceeds the budget."""
        if before and self.blocks.get(before[-1].key) is not before[-1]:
            return None
        key = (before[-1].id if before else 0, tuple(tokens))
        block = self.blocks.get(key)
        if block is None:
            size = (k.numel() + v.numel()) * k.element_size()
            if size > self.max_bytes:
                return None
            block = self.blocks[key] = Block(next(self._ids), key, k.clone(), v.clone())
            self.bytes += size
        self._used([*before, block])
        while self.bytes > self.max_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= (evicted.k.numel() + evicted.v.numel()) * evicted.k.element_size()
        return block if self.blocks.get(key) is block else None

    def _used(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # the first block last: most recently used, so evicted after the rest
            self.blocks.move_to_end(block.key)
