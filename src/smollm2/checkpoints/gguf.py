"""GGUF files (llama architecture): metadata <-> config, tensors dequantized as they are read and quantized as
they are written, by the gguf library; the file's structure is parsed here (MetadataReader), in a twentieth of
the time the library's reader takes.

llama.cpp's converter permutes the rows of q_proj and k_proj so that each head's rotary pairs sit side by
side (its interleaved RoPE); the model here uses the rotate-half layout of transformers, so it is undone on
reading and done again on writing.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                  GGUFWriter, LlamaFileType)
from gguf.quants import QuantError, dequantize, quant_shape_to_byte_shape, quantize
from tqdm import tqdm

from ..config import SmolConfig
from ..errors import SmolError
from .checkpoint import Checkpoint, GGUFBlocks, all_finite, parameter_shapes, stored_type_error

TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
IN_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
GGUF_TOP_LEVEL = {hf: gguf for gguf, hf in TOP_LEVEL.items()}
GGUF_IN_BLOCK = {hf: gguf for gguf, hf in IN_BLOCK.items()}
# save_gguf's types: each tensor's type, and the file type llama.cpp reports for the whole
SAVE_TYPES = {"f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
              "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
              "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
              "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1)}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: int  # a GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    data: np.ndarray  # a view of the file, mapped in memory
    offset: int  # where data starts in the file


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict  # key -> value, as the gguf library decodes it
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None  # that mapping

    def release_pages(self) -> None:
        """Drop the file's pages read so far from this process's resident memory (the OS keeps them in its page
        cache, and maps them again if they are read again): once a tensor is decoded or copied into one of its
        own, they would count its bytes twice. Safe at any time, from any thread: the mapping is read-only."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)


def open_gguf(path: Path, strings: bool = True) -> GGUFFile:
    """The file's metadata and tensors, read once for whoever holds them at the time, and let go when none does.
    strings=False (a model loading, which needs no vocabulary): each array of strings (the tokenizer's 49k tokens
    and 49k merges) is skipped, read as its length alone (Skipped). Decoded, those strings took ~10 MB while a
    model loaded, and freed, left ~4 MB of Python's heap in pieces behind it for good (the 360M Q4_0 model's peak,
    tests/test_weights.py); the tokenizer reads the file again, with them (~0.1 s)."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size, strings)
    if (file := OPENED.get(key)) is None:
        file = OPENED[key] = _open_gguf(key[0], strings)
    return file


OPENED: weakref.WeakValueDictionary[tuple[str, int, int, bool], GGUFFile] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Skipped:
    """An array of strings open_gguf(strings=False) skipped: its length alone."""
    length: int

    def __len__(self) -> int:
        return self.length


def _open_gguf(path: str, strings: bool) -> GGUFFile:
    try:
        data = np.memmap(path, mode="r")
        reader = MetadataReader(memoryview(data.base), strings)
        metadata, tensors = reader.metadata(), reader.tensor_infos()
        start = reader.tensors_at(metadata)
        tensors = [GGUFTensor(name, int(kind), shape, tensor_data(data, start + offset, name, kind, shape),
                              start + offset) for name, kind, shape, offset in tensors]
        file = GGUFFile(metadata, tensors, data.base)
        file.release_pages()  # the metadata, now Python values (~5 MB of the embedded file)
        return file
    except (ValueError, OSError, KeyError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise SmolError(f"{path}: truncated or corrupt GGUF file ({e})") from None


# GGUF's value types (gguf.GGUFValueType), the fixed-size ones as struct formats
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4  # ggml's


class MetadataReader:
    """GGUF's header, metadata and tensor records, decoded as the gguf library's GGUFReader decodes them
    (field.contents(); GGUF.version, GGUF.tensor_count and GGUF.kv_count as keys too), in a twentieth of the
    time: GGUFReader makes numpy views of each of the 49k tokens and 49k merges (2.0 s for the embedded file at
    every start, 0.08 s here). Every
    count is checked against the bytes left before anything is read or allocated (tests/test_checkpoints.py
    compares the two readers)."""

    def __init__(self, buffer: memoryview, strings: bool = True):
        self.buffer, self.at, self.strings = buffer, 0, strings  # strings=False: arrays of them Skipped

    def take(self, fmt: str, count: int = 1):
        size = struct.calcsize(fmt) * count
        if count < 0 or self.at + size > len(self.buffer):
            raise ValueError(f"{count} values of {size // max(count, 1)} bytes at byte {self.at} run past the end")
        values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.at)
        self.at += size
        return values if count != 1 else values[0]

    def string(self) -> str:
        start = self.skip_string()
        return str(self.buffer[start:self.at], "utf-8")

    def skip_string(self) -> int:
        """Past a string; returns where its bytes start."""
        n = self.take("Q")
        if self.at + n > len(self.buffer):
            raise ValueError(f"a string of {n} bytes at byte {self.at} runs past the end")
        self.at += n
        return self.at - n

    def value(self, kind: int, in_array: bool = False):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY and not in_array:  # ggml reads no arrays of arrays
            item, n = self.take("I"), self.take("Q")
            if item in SCALARS:
                values = self.take(SCALARS[item], n)
                return list(values) if n != 1 else [values]
            if n * 8 > len(self.buffer) - self.at:  # a string takes 8 bytes at least
                raise ValueError(f"an array of {n} strings at byte {self.at} runs past the end")
            if item == STRING and not self.strings:
                for _ in range(n):
                    self.skip_string()
                return Skipped(n)
            return [self.value(item, in_array=True) for _ in range(n)]
        raise ValueError(f"unknown value type {kind} at byte {self.at}")

    def metadata(self) -> dict:
        if self.take("I") != GGUF_MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = self.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian files are not read); versions 2 and 3 are")
        self.tensor_count, kv_count = self.take("Q"), self.take("Q")
        metadata = {"GGUF.version": version, "GGUF.tensor_count": self.tensor_count, "GGUF.kv_count": kv_count}
        if kv_count * 13 > len(self.buffer) - self.at:  # key length, value type, one byte of value at least
            raise ValueError(f"{kv_count} metadata keys cannot fit in the file")
        for _ in range(kv_count):
            key = self.string()
            if key in metadata:
                raise ValueError(f"metadata key {key} appears twice")
            metadata[key] = self.value(self.take("I"))
        return metadata

    def tensor_infos(self) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]]:
        """(name, type, shape innermost first, offset in the data section) of each tensor."""
        if self.tensor_count * 24 > len(self.buffer) - self.at:  # name length, dimensions, type, offset
            raise ValueError(f"{self.tensor_count} tensor records cannot fit in the file")
        infos, names = [], set()
        for _ in range(self.tensor_count):
            name = self.string()
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            dims = self.take("I")
            if dims > MAX_DIMS:
                raise ValueError(f"tensor {name} has {dims} dimensions; ggml's tensors have at most {MAX_DIMS}")
            shape = self.take("Q", dims) if dims != 1 else (self.take("Q"),)
            infos.append((name, GGMLQuantizationType(self.take("I")), tuple(shape), self.take("Q")))
        return infos

    def tensors_at(self, metadata: dict) -> int:
        """Where the data section starts: after the tensor records, at a multiple of general.alignment."""
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                or alignment & (alignment - 1)):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        return -(-self.at // alignment) * alignment


NUMPY_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
               GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
               GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
               GGMLQuantizationType.I64: np.int64}


def tensor_data(data: np.memmap, at: int, name: str, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's values as GGUFReader gives them, a view of the mapped file: (outermost first) in its numpy
    type, or for other types its bytes, one row of blocks per innermost row."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    elements = math.prod(shape)
    nbytes = elements * block_bytes // block
    if at + nbytes > len(data):
        raise ValueError(f"tensor {name}'s {nbytes} bytes run past the end of the file")
    dims = shape[::-1]
    if kind in NUMPY_TYPES:
        return data[at:at + nbytes].view(NUMPY_TYPES[kind]).reshape(dims)
    return data[at:at + nbytes].reshape(quant_shape_to_byte_shape(dims, kind))


def hf_name(name: str, path: Path) -> str:
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in IN_BLOCK:
        return f"model.layers.{parts[1]}.{IN_BLOCK[parts[2]]}.{parts[3]}"
    raise SmolError(f"{path}: unexpected tensor {name}")


def gguf_name(name: str) -> str:
    """hf_name's inverse, for names parameter_shapes lists."""
    if name in GGUF_TOP_LEVEL:
        return GGUF_TOP_LEVEL[name]
    _, _, layer, *module, kind = name.split(".")  # model.layers.{i}.{module}.{weight|bias}
    return f"blk.{layer}.{GGUF_IN_BLOCK['.'.join(module)]}.{kind}"


def _float32(value) -> float:
    # GGUF stores float32; 7 significant digits give back the decimal the config had (1e-5, not 9.99e-6).
    return float(f"{float(value):.7g}")


def gguf_config(reader: GGUFFile, path: Path) -> SmolConfig:
    arch = reader.metadata.get("general.architecture")
    if arch != "llama":
        raise SmolError(f"{path}: unsupported architecture {arch!r}; only 'llama' GGUF files are supported")
    names = {t.name for t in reader.tensors}

    def need(key, default=None, number=int):
        """The value at llama.{key}, an integer (or with number=float, any number)."""
        value = reader.metadata.get(f"llama.{key}", default)
        if value is None:
            raise SmolError(f"{path}: missing metadata llama.{key}")
        if isinstance(value, bool) or not isinstance(value, int if number is int else (int, float)):
            raise SmolError(f"{path}: metadata llama.{key} must be {'an integer' if number is int else 'a number'}, "
                            f"got {str(value)[:40]!r}")
        return value

    def special(key):
        """A special token's id: one integer (the config's checks bound it), as llama.cpp reads it."""
        value = reader.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SmolError(f"{path}: metadata tokenizer.ggml.{key} must be a token id, got {str(value)[:40]!r}")
        return value

    if reader.metadata.get("llama.rope.scaling.type", "none") not in ("none", "") or "rope_freqs.weight" in names:
        raise SmolError(f"{path}: unsupported rope scaling; only plain RoPE is supported")
    n_heads, hidden = need("attention.head_count"), need("embedding_length")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    values = dict(
        vocab_size=need("vocab_size", len(tokens) if isinstance(tokens, (list, Skipped)) else 0),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_hidden_layers=need("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=need("attention.head_count_kv", n_heads),
        head_dim=need("attention.key_length", hidden // max(n_heads, 1)),
        max_position_embeddings=need("context_length"),
        rope_theta=_float32(need("rope.freq_base", 10000.0, float)),
        rms_norm_eps=_float32(need("attention.layer_norm_rms_epsilon", number=float)),
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        **{f"{which}_token_id": special(key) for which, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                                                  ("pad", "padding_token_id"))},
    )
    try:
        config = SmolConfig(**values)
    except SmolError as e:  # name the file, not just the field
        raise SmolError(f"{path}: {str(e).removeprefix('config: ')}") from None
    # llama.cpp rotates the first rope.dimension_count dimensions of each head alone; the model here, all of them
    if (rotated := need("rope.dimension_count", config.head_dim)) != config.head_dim:
        raise SmolError(f"{path}: metadata llama.rope.dimension_count ({rotated}) differs from the heads' size "
                        f"({config.head_dim}: llama.attention.key_length, or embedding_length / head_count); only "
                        "rotary embeddings over whole heads are supported")
    return config


def rotary_heads(name: str, config: SmolConfig) -> int | None:
    """The heads whose rows llama.cpp permutes, for q_proj's and k_proj's weights and biases; None otherwise."""
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: per head, rows (pair, half) -> (half, pair)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation: per head, rows (half, pair) -> (pair, half)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# What a weight may be stored as in a GGUF file: these float types, or any type of quantized blocks (a block of
# more than one value). Its plain integer types (I8..I64) and F64 are never weights in a llama model.
GGUF_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def check_weight_types(reader: GGUFFile, path: Path) -> None:
    """Every tensor's type, from the file's tensor records, before any tensor is read."""
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in GGUF_FLOATS and GGML_QUANT_SIZES[qtype][0] == 1:
            raise stored_type_error(path, t.name, qtype.name, [*(f.name for f in GGUF_FLOATS), "quantized blocks"])


def read_gguf(path: Path, dtype: torch.dtype = torch.float32, quantized: bool = False) -> Checkpoint:
    """quantized: every matrix the file stores in a quantized type stays its blocks (Checkpoint.quantized, read
    from the mapped file when asked), not a float32 tensor."""
    reader = open_gguf(path, strings=False)
    config = gguf_config(reader, path)
    check_weight_types(reader, path)
    tensors, files, blocks = {}, {}, {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False, disable=None):
        name = hf_name(t.name, path)
        qtype = GGMLQuantizationType(t.tensor_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if not t.shape or t.shape[0] % block or t.data.nbytes != math.prod(t.shape) // block * block_bytes:
            raise SmolError(f"{path}: cannot read tensor {t.name} (its shape {t.shape} and {t.data.nbytes} bytes "
                            f"do not fit type {qtype.name}, whose rows are blocks of {block} values in "
                            f"{block_bytes} bytes)")
        shape = torch.Size(t.shape[::-1])
        heads = rotary_heads(name, config)
        # any other shape: check() names the mismatch
        rows = GGUFRows(reader, t, path, heads if heads and shape[0] == heads * config.head_dim else None)
        if quantized and block > 1 and len(shape) == 2:
            blocks[name] = GGUFBlocks(qtype, shape, rows.blocks, rows.values, rows.finite)
        else:
            tensors[name] = rows.values().to(dtype)
        files[name] = f"{path} ({t.name})"
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        blocks.pop("lm_head.weight", None)
    return Checkpoint(config, tensors, files, str(path), blocks)


# Where a block's float16 scales sit (byte offsets), for the types whose values are all finite exactly when these
# are: each value is a scale times small integers (a K-quant's sub-block scale, then its quant), plus a minimum
# (Q4_1, Q5_1) or minus a second scale times an integer (Q4_K, Q5_K), in float32, which finite ones cannot
# overflow (65504 * 128 * 32 < 2**28), and an infinite or NaN scale makes every value it scales infinite or NaN
# (infinity times 0 is NaN). Other types' values are decoded to be checked.
SCALES = {GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q8_0: (0,),
          GGMLQuantizationType.Q4_1: (0, 2), GGMLQuantizationType.Q5_1: (0, 2), GGMLQuantizationType.Q4_K: (0, 2),
          GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}
CHECKED_ROWS = 2048  # a part of a matrix of another type, decoded to be checked (4.5 MB of the 135M's embeddings)


def scales_finite(data: np.ndarray, kind: GGMLQuantizationType) -> bool:
    """Whether the float16 scales of these blocks of type `kind` (a type in SCALES; data: uint8, whole blocks) are
    all finite: whether the values they decode to are."""
    blocks = data.reshape(-1, GGML_QUANT_SIZES[kind][1])
    return all(bool(np.isfinite(blocks[:, at:at + 2].copy().view(np.float16)).all()) for at in SCALES[kind])


# A matrix of quantized blocks this large or larger is read as a copy in huge pages (numpy's, from 4 MiB), not
# mapped: the decoding step streams every held matrix once a token, and the file's pages are 4 KiB ones (the page
# cache's): with its 30 MiB of embeddings mapped, the embedded model decoded with ~5% more CPU time (measured once,
# 2 threads, a 2-core AMD EPYC). The smaller ones are read mapped, and the kernels' side copies them into huge pages
# of its own, side by side (kernels/packed.py's HugePages).
HUGE_PAGED = 4 << 20


@dataclass(frozen=True)
class GGUFRows:
    """A tensor of the mapped file, read when asked: its rows in the model's order (llama.cpp's q/k permutation
    undone, where `heads` is given). A read that copies or decodes drops the file's pages it read from this
    process's resident memory; one that maps the file's pages (blocks, values) reads none."""
    reader: GGUFFile
    tensor: GGUFTensor
    path: Path
    heads: int | None

    def blocks(self) -> torch.Tensor:
        """Its bytes, uint8 (rows, bytes a row, as tensor_data shapes blocks). Below HUGE_PAGED, where the model
        takes its rows in the file's order, the file's own pages, mapped copy-on-write as values() maps float32
        ones: nothing read until used, shared with every process that maps the file. Else a copy: q's and k's
        rows, which llama.cpp permuted, in the model's order; a larger matrix in huge pages."""
        t = self.tensor
        if self.heads is None and t.data.nbytes < HUGE_PAGED:
            return torch.from_numpy(np.memmap(self.path, np.uint8, "c", t.offset, t.data.shape))
        data = torch.from_numpy(np.array(t.data))  # numpy asks Linux for huge pages from HUGE_PAGED on
        self.reader.release_pages()
        return data if self.heads is None else unpermute(data, self.heads)

    def finite(self) -> bool:
        """Whether every value is finite: from the blocks' scales alone where they decide it (SCALES; reading
        the 360M Q4_0 model's ~0.1 s, where decoding its 360M values took ~14 s on 2 cores), else from its
        values, CHECKED_ROWS rows at a time."""
        t = self.tensor
        kind = GGMLQuantizationType(t.tensor_type)
        if kind not in SCALES:
            return all(all_finite(self.values(slice(i, i + CHECKED_ROWS)))
                       for i in range(0, len(t.data), CHECKED_ROWS))
        try:
            return scales_finite(t.data, kind)
        finally:
            self.reader.release_pages()

    def values(self, rows: slice | None = None) -> torch.Tensor:
        """Its values, float32, in its shape (outermost first); or those of the file's `rows` (outermost),
        in the file's order, to be checked a part at a time. A float32 matrix whose rows the model takes in the
        file's order is the file's own pages, mapped copy-on-write: shared with every process that maps the
        file, dropped by the OS under pressure (it reads them again), nothing copied; a change in place copies
        the page it writes, never the file."""
        t = self.tensor
        if rows is None and self.heads is None and t.tensor_type == GGMLQuantizationType.F32 and len(t.shape) == 2:
            return torch.from_numpy(np.memmap(self.path, np.float32, "c", t.offset, t.shape[::-1]))
        data = t.data if rows is None else t.data[rows]
        try:
            w = dequantized(data, GGMLQuantizationType(t.tensor_type)).reshape(-1, *t.shape[-2::-1])
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise SmolError(f"{self.path}: cannot read tensor {t.name} ({e})") from None
        finally:
            self.reader.release_pages()
        if rows is not None:
            return w
        w = w.reshape(t.shape[::-1])
        return w if self.heads is None else unpermute(w, self.heads)


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A tensor's float32 values, flat, from its GGUF data: gguf.quants.dequantize's, bit for bit. The embedded
    model's types, Q8_0 and Q4_1, are decoded here in torch by the same float32 operations (d * q, then + m), in
    a third of the time the library's numpy takes (0.3 s for the embedded file, not 0.9 s, at every start); the
    others by the library."""
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(np.array(data)).reshape(-1, block_bytes)  # (n, bytes): copied off the file
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (n, 1)
        if qtype == GGMLQuantizationType.Q8_0:
            return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d).reshape(-1)
        m, nibbles = blocks[:, 2:4].contiguous().view(torch.float16).float(), blocks[:, 4:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float()  # a block's low nibbles, then its high ones
        return q.mul_(d).add_(m).reshape(-1)  # two roundings, as numpy's (d * q) + m
    # Other quantized types decode into a new array; plain F32 is a view of the read-only file: copy that one.
    return torch.from_numpy(np.require(dequantize(data, qtype), np.float32, ["W"])).reshape(-1)


def save_gguf(config: SmolConfig, state_dict: dict[str, torch.Tensor], tokenizer_metadata: dict,
              path: str | Path, type: str = "f32") -> None:
    """A llama-architecture GGUF file that llama.cpp (and so Ollama) loads: the config as llama.* metadata, the
    tokenizer's tokenizer.* metadata (Tokenizer.gguf_metadata(): data, so that checkpoints know no tokenizer), and
    the weights under llama.cpp's names with q/k rows permuted. 2-D tensors at `type` (one of SAVE_TYPES), 1-D
    ones in F32 as llama.cpp's converter keeps them. The file is written beside `path` under a temporary name and
    renamed into place, so no reader ever sees half of it."""
    if type not in SAVE_TYPES:
        raise SmolError(f"unknown GGUF type {type!r}; choose from {', '.join(SAVE_TYPES)}")
    path = Path(path)
    if path.is_dir():
        raise SmolError(f"{path}: is a directory; give the path of the .gguf file to write")
    if not all(t.is_floating_point() for t in state_dict.values()):
        raise SmolError("a quantized model cannot be saved as GGUF; save it before quantizing")
    Checkpoint(config, state_dict, source="the model").check(parameter_shapes(config))
    if (tokens := len(tokenizer_metadata["tokenizer.ggml.tokens"])) != config.vocab_size:
        raise SmolError(f"the tokenizer has {tokens} tokens but the model "
                        f"{config.vocab_size} embedding rows; llama.cpp needs one token per row")
    qtype, file_type = SAVE_TYPES[type]
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        writer = GGUFWriter(partial, "llama")
        writer.add_type("model")  # not an adapter
        add_llama_metadata(writer, config)
        add_tokenizer_metadata(writer, tokenizer_metadata)
        writer.add_file_type(file_type)
        writer.add_quantization_version(GGML_QUANT_VERSION)  # at every type, as llama.cpp's converter writes it
        output = "lm_head.weight" if "lm_head.weight" in state_dict else "model.embed_tokens.weight"
        for name, w in state_dict.items():
            w = w.detach().to("cpu", torch.float32)
            if (heads := rotary_heads(name, config)) is not None:
                w = permute(w, heads)
            if w.ndim == 1:
                kind = GGMLQuantizationType.F32
            elif name == output and qtype == GGMLQuantizationType.Q4_1:
                # as llama.cpp's own quantizer does: the output matrix's rounding shows in every logit
                kind = GGMLQuantizationType.Q8_0
            else:
                kind = qtype
            data, kind = encoded(w.numpy(), kind)
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    except OSError as e:
        raise SmolError(f"{path}: cannot write the GGUF file ({e.strerror or e})") from None
    finally:
        partial.unlink(missing_ok=True)


def encoded(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w at qtype; rows that are not whole blocks of it fall back to F16, as in llama.cpp's converter."""
    try:
        return quantize(w, qtype), qtype
    except QuantError:
        return quantize(w, GGMLQuantizationType.F16), GGMLQuantizationType.F16


def add_tokenizer_metadata(writer: GGUFWriter, metadata: dict[str, str | bool | int | list]) -> None:
    """Each key at the type llama.cpp's converter writes it: token ids as uint32, lists as arrays."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def add_llama_metadata(writer: GGUFWriter, config: SmolConfig) -> None:
    """The llama.* keys gguf_config reads back, as llama.cpp's converter writes them."""
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # llama.cpp's converter writes these wherever config.json names head_dim, as every config transformers
    # (and smollm2) saves does
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
