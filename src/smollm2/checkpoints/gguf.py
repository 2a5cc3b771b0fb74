"""GGUF files (llama architecture): metadata -> config, tensors dequantized with the gguf library.

llama.cpp's converter permutes the rows of q_proj and k_proj so that each head's rotary pairs sit side by
side (its interleaved RoPE); the model here uses the rotate-half layout of transformers, so it is undone.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from ..config import SmolConfig
from ..errors import SmolError
from ..kernels import packed_layout
from .checkpoint import Checkpoint

TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
IN_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: int  # a GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    data: np.ndarray  # a view of the file, mapped in memory


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict  # key -> value, as the gguf library decodes it
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None  # that mapping

    def release_pages(self) -> None:
        """Drop the file's pages read so far from this process's resident memory (the OS keeps them in its
        page cache): once the weights are decoded into tensors of their own, they would double its size."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)


def open_gguf(path: Path) -> GGUFFile:
    """Parsing the metadata takes seconds (49k tokens); the model and the tokenizer share one reading.

    Only the decoded values are kept: the reader's own per-field arrays would hold ~160 MB for good, and its
    tensor records, which point back into them, ~45 MB.
    """
    stat = Path(path).stat()
    return _open_gguf(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    try:
        reader = GGUFReader(path)
        mapping = reader.data.base if isinstance(reader.data.base, mmap.mmap) else None  # np.memmap's own
        tensors = [GGUFTensor(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), t.data)
                   for t in reader.tensors]
        return GGUFFile({key: field.contents() for key, field in reader.fields.items()}, tensors, mapping)
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise SmolError(f"{path}: truncated or corrupt GGUF file ({e})") from None


def hf_name(name: str, path: Path) -> str:
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in IN_BLOCK:
        return f"model.layers.{parts[1]}.{IN_BLOCK[parts[2]]}.{parts[3]}"
    raise SmolError(f"{path}: unexpected tensor {name}")


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

    if reader.metadata.get("llama.rope.scaling.type", "none") not in ("none", "") or "rope_freqs.weight" in names:
        raise SmolError(f"{path}: unsupported rope scaling; only plain RoPE is supported")
    n_heads, hidden = need("attention.head_count"), need("embedding_length")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    values = dict(
        vocab_size=need("vocab_size", len(tokens) if isinstance(tokens, list) else 0),
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
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=reader.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    try:
        return SmolConfig(**values)
    except SmolError as e:  # name the file, not just the field
        raise SmolError(f"{path}: {str(e).removeprefix('config: ')}") from None


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: per head, rows (pair, half) -> (half, pair)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path, dtype: torch.dtype = torch.float32, packed: bool = False) -> Checkpoint:
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    tensors, files, packed_copies = {}, {}, {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False, disable=None):
        name = hf_name(t.name, path)
        try:
            qtype = GGMLQuantizationType(t.tensor_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if not t.shape or t.shape[0] % block or t.data.nbytes != math.prod(t.shape) // block * block_bytes:
                raise ValueError(f"its shape {t.shape} and {t.data.nbytes} bytes do not fit type {qtype.name}, "
                                 f"whose rows are blocks of {block} values in {block_bytes} bytes")
            values = dequantize(t.data, qtype)
            shape = t.shape[::-1]
            # Quantized types decode into a new array; plain F32 is a view of the read-only file: copy that one.
            w = torch.from_numpy(np.require(values, np.float32, ["W"])).reshape(shape)
            # float32 matrices that the kernels can stream from their packed blocks instead: the same values, in a
            # few bits each
            kept = packed_layout(qtype, t.data) if packed and dtype == torch.float32 and len(shape) == 2 else None
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise SmolError(f"{path}: cannot read tensor {t.name} ({e})") from None
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        if heads and w.shape[0] == heads * config.head_dim:  # any other shape: check() names the mismatch
            w = unpermute(w, heads)
            kept = kept and kept._replace(data=unpermute(kept.data, heads))
        tensors[name], files[name] = w.to(dtype), f"{path} ({t.name})"
        if kept:
            packed_copies[name] = kept
    reader.release_pages()  # every tensor above is a copy
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        packed_copies.pop("lm_head.weight", None)
    return Checkpoint(config, tensors, files, str(path), packed_copies)
