"""Running the model for generation: a prompt's chunk into a KV cache, one decoding step, and how long a cache
to make."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
from collections import abc
from dataclasses import dataclass

import torch

PREFILL_CHUNK = 512  # the bigger, the faster (a 135M fp32 model reads its weights once a chunk); the smaller,
# the sooner the server's running streams get their next token, and the finer the prefix cache
CACHE_BLOCK = 128  # caches are sized in these steps: a compiled step, over the whole cache, sees few distinct
# lengths, so rarely recompiles


def decode_step(model, ids, input_pos, cache, attention_mask) -> torch.Tensor:
    """One token per row at slot input_pos -> next-token logits, (B, V)."""
    return model.logits(model.hidden_states(ids, input_pos, cache, attention_mask))[:, -1]


def verify_step(model, ids, input_pos, cache) -> torch.Tensor:
    """A few tokens per row at slots input_pos -> every position's next-token logits, (B, T, V): a speculating
    row's pass (speculative.py)."""
    return model.logits(model.hidden_states(ids, input_pos, cache))


@functools.cache
def compiled_decode_step(device_type: str):
    # CUDA: CUDA graphs replay the whole step without Python; CPU: inductor fuses the small ops.
    return torch.compile(decode_step, mode="reduce-overhead" if device_type == "cuda" else None)


def chunks(start: int, end: int) -> abc.Iterator[tuple[int, int]]:
    """The chunks, [begin, end), that prefill slots start..end-1: each ends at a multiple of PREFILL_CHUNK (or at
    `end`). Where a prefill starts (0, or past a prefix already cached) does not move them, so each chunk is the
    same computation, bit for bit, whatever came from a cache before it."""
    while start < end:
        stop = min((start // PREFILL_CHUNK + 1) * PREFILL_CHUNK, end)
        yield start, stop
        start = stop


def prefill_chunk(model, ids, cache, begin: int, last_only: bool = True, hooks=None) -> torch.Tensor:
    """One chunk: ids (B, n) at slots begin..begin+n-1 into the cache -> the final hidden states, (B, n, C), or with
    last_only the last position's alone, (B, 1, C); the keys and values it writes are the same either way.
    Attention reads only the slots filled so far: a prompt's first chunk is plain causal, which the CPU kernel
    computes half of. hooks: a Hooks (hooks.py) for the pass to call, which then computes every position (the
    hooks see them all)."""
    end = begin + ids.shape[1]
    slots, cache = torch.arange(begin, end, device=ids.device), cache.view(length=end)
    if hooks is not None:
        h = hooks.hidden_states(model, ids, slots, cache)
        return h[:, -1:] if last_only else h
    return model.hidden_states(ids, slots, cache, last_only=last_only)


PACKED_ROWS = 16  # the most rows a batched prefill packs: their last positions are then a decoding step's rows,
# which the kernel gives each row's bits whatever rows share its call, as to one row alone


@dataclass(frozen=True)
class Chunk:
    """A row's chunk in a batched prefill: its tokens, at slots begin.. of cache row `row`."""
    row: int
    begin: int
    ids: list[int]


def packs(model, n: int) -> bool:
    """Whether a chunk of n tokens may share a pass with other rows' (prefill_rows) and keep the bits it gets alone
    (prefill_chunk): on an accelerated model, whose kernels keep each row's bits and whose choices run torch's side
    once per row (Choices.packed); past a decoding step's rows, which a chunk alone runs as one kernel call."""
    accelerator = model.__dict__.get("accelerator")
    return accelerator is not None and accelerator.mode != "off" and n > PACKED_ROWS


def prefill_rows(model, chunks: list[Chunk], cache) -> torch.Tensor:
    """Several rows' chunks (packs(), of one rows_bucket, at most PACKED_ROWS) in one pass, packed one after
    another: the products, norms and RoPE over all their tokens at once, attention and cache writes row by row,
    as prefill_chunk runs them for each alone, with the same bits. Returns each chunk's last position's final
    hidden state, (1, len(chunks), C): model.py's blocks (Block.forward, Attention.forward) on packed rows."""
    lengths = [len(chunk.ids) for chunk in chunks]
    device = model.model.embed_tokens.weight.device
    slots = [torch.arange(c.begin, c.begin + n, device=device) for c, n in zip(chunks, lengths)]
    ends = torch.tensor(lengths, device=device).cumsum(0) - 1  # each chunk's last position in the pass
    model.extend_rope(max(c.begin + n for c, n in zip(chunks, lengths)))
    positions = torch.cat(slots)[None]  # (1, N)
    x = model.model.embed_tokens(torch.tensor([[t for c in chunks for t in c.ids]], device=device))  # (1, N, C)
    rope = model.rope_cos[positions][:, :, None].to(x.dtype), model.rope_sin[positions][:, :, None].to(x.dtype)
    layers = model.model.layers
    with model.accelerator.choices.packed(lengths):
        for i, block in enumerate(layers):
            last, attn = i == len(layers) - 1, block.self_attn
            h = block.input_layernorm(x)
            q, k, v = (t.view(1, h.shape[1], -1, attn.head_dim) for t in attn.project(h))
            q, k = attn.rotate(q, *rope), attn.rotate(k, *rope)
            ys, begin = [], 0
            for group in attended_together(chunks, last):
                chunk, at, n = chunks[group[0]], slots[group[0]], len(group)
                end = begin + n * len(at)
                rows = (n, len(at), -1, attn.head_dim)  # (1, n * T, ...) as n rows of the group's length T
                ks, vs = cache.view(slice(chunk.row, chunk.row + n), chunk.begin + len(at)).update(
                    attn.layer, at, k[:, begin:end].reshape(rows), v[:, begin:end].reshape(rows))
                # As hidden_states: plain causal for a first chunk (its slots are all the view holds), else a mask;
                # the last block's query is the last position's alone.
                keys = torch.arange(ks.shape[2], device=device)
                mask = None if chunk.begin == 0 else (keys <= at[:, None])[None, None]
                qs = q[:, begin:end].reshape(rows)
                if last:
                    qs, mask = qs[:, -1:], None if mask is None else mask[:, :, -1:]
                ys.append(attn.attend(qs, ks, vs, mask, mask is None and not last).reshape(1, -1, *qs.shape[2:]))
                begin = end
            # One group (rows of one length, the usual batch) is the whole pass: cat would only copy it
            attended = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
            y = attn.o_proj(attended.reshape(1, -1, attn.n_heads * attn.head_dim))
            x = (x[:, ends] if last else x) + y
            x = x + block.mlp(block.post_attention_layernorm(x))
        return model.model.norm(x)


def attended_together(chunks: list[Chunk], last: bool) -> list[list[int]]:
    """The chunks' indices, in order, in groups whose attention and cache writes are one call each: first chunks
    (causal over all their view's slots) of one length in consecutive cache rows, every (row, head) attended on its
    own (ops.prompt_attention: decided and run for each row as alone), so with each row's bits; a chunk past a
    prompt's first (its own mask) and the last block's (its last query alone) one by one. One call, not one a row:
    a 16-row prefill's attention was 16 parallel regions a layer, each a barrier for the threads."""
    groups: list[list[int]] = []
    for i, chunk in enumerate(chunks):
        before = chunks[i - 1] if groups else None
        if (not last and before is not None and chunk.begin == before.begin == 0 and chunk.row == before.row + 1
                and len(chunk.ids) == len(before.ids)):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def untouched_cache(model, rows: int, length: int, kv_dtype: str | None = None):
    """model.new_cache(rows, length, kv_dtype), but on the CPU in memory that the OS commits page by page as slots
    are first written, and that a row hands back once it no longer holds its slots (release_slots): a server's
    cache is sized for its longest request, and most of its slots are never written (at 8 rows of 8192 slots, the
    135M model's would commit 3 GiB at start in float32), or were written by a request long gone."""
    cache = model.new_cache(rows, 0, kv_dtype)  # the layout, dtypes and device, with no slots yet
    if cache.k.device.type != "cpu":
        return model.new_cache(rows, length, kv_dtype)
    model.extend_rope(length)
    # Private and anonymous: zeros, committed as written, and handed back by MADV_DONTNEED (a shared mapping, mmap's
    # default, would keep what was written).
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    cache.pages, parts = [], []
    for part in cache.parts:
        shape = (*part.shape[:3], length, part.shape[4])
        size = math.prod(shape) * part.element_size()
        pages = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
        # Not in huge pages: with them, the first slot a row writes in a layer would commit its whole window.
        with contextlib.suppress(AttributeError, OSError):  # no madvise (not Linux): committed as written anyway
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        cache.pages.append(pages)
        parts.append(torch.frombuffer(pages, dtype=torch.uint8).view(part.dtype).view(shape))
    cache.parts = parts
    return cache


def release_slots(cache, row: int, first: int) -> None:
    """Hand the memory of row `row`'s slots first.. (every layer and head, keys, values and int8 scales) back to
    the OS, where the cache is an untouched_cache on an OS that takes it back; they read as zeros after. Whole
    pages only: a partly held page stays."""
    pages = getattr(cache, "pages", None)
    if pages is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    for memory, part in zip(pages, cache.parts):
        L, B, H, S, D = part.shape
        size = part.element_size()
        spans = []  # byte ranges; a whole row's heads of a layer are one (less than a page each, int8's scales)
        for layer in range(L):
            for head in range(H):
                base = ((layer * B + row) * H + head) * S * D * size  # where this layer and head's slots start
                begin, end = base + first * D * size, base + S * D * size
                if spans and spans[-1][1] == begin:
                    spans[-1][1] = end
                else:
                    spans.append([begin, end])
        for begin, end in spans:
            begin, end = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
            if end > begin:
                memory.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def cache_length(n: int, limit: int) -> int:
    """n slots rounded up to a whole number of blocks (at most limit): fewer distinct cache shapes."""
    return min(-(-n // CACHE_BLOCK) * CACHE_BLOCK, limit)
