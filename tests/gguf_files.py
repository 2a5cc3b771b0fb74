"""Writing GGUF files as llama.cpp does: tiny models as test files for the loaders and the kernels."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from smollm2 import SmolConfig, SmolLM2


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None):
    """llama.cpp convert_hf_to_gguf.py, LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, i, *module, kind = name.split(".")
    return f"blk.{i}.{BLOCK_NAMES['.'.join(module)]}.{kind}"


def gguf_metadata(c: SmolConfig) -> dict:
    """The keys convert_hf_to_gguf.py writes for LlamaModel (tokenizer ids included, vocabulary left out)."""
    u32, f32 = "u32", "f32"
    return {
        "general.name": ("str", "tiny"), "llama.vocab_size": (u32, c.vocab_size),
        "llama.context_length": (u32, c.max_position_embeddings), "llama.embedding_length": (u32, c.hidden_size),
        "llama.block_count": (u32, c.num_hidden_layers), "llama.feed_forward_length": (u32, c.intermediate_size),
        "llama.rope.dimension_count": (u32, c.head_dim), "llama.attention.head_count": (u32, c.num_attention_heads),
        "llama.attention.head_count_kv": (u32, c.num_key_value_heads), "llama.rope.freq_base": (f32, c.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": (f32, c.rms_norm_eps),
        "llama.attention.key_length": (u32, c.head_dim), "llama.attention.value_length": (u32, c.head_dim),
        "general.file_type": (u32, 0), "tokenizer.ggml.bos_token_id": (u32, 1),
        "tokenizer.ggml.eos_token_id": (u32, 2),
    }


def gguf_tensors(model: SmolLM2, qtype: Q) -> dict:
    """GGUF name -> (array, raw dtype): q/k permuted, 2-D tensors quantized, 1-D tensors kept in F32."""
    c, out = model.config, {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if ".q_proj." in name:
            a = permute(a, c.num_attention_heads, c.num_attention_heads)
        elif ".k_proj." in name:
            a = permute(a, c.num_attention_heads, c.num_key_value_heads)
        if a.ndim == 1 or qtype == Q.F32:
            out[gguf_name(name)] = (a.astype(np.float32), None)
        elif qtype == Q.F16:
            out[gguf_name(name)] = (a.astype(np.float16), None)
        else:
            out[gguf_name(name)] = (quantize(a, qtype), qtype)
    return out


def write_gguf(path, config: SmolConfig, tensors: dict, arch: str = "llama", **meta) -> None:
    """meta: metadata overrides, '.' in keys written '__'; None drops a key, (kind, value) adds one."""
    fields = gguf_metadata(config)
    for key, value in meta.items():
        key = key.replace("__", ".")
        if value is None:
            fields.pop(key)
        else:
            fields[key] = value if isinstance(value, tuple) else (fields[key][0], value)
    write_fields(path, {key.replace("llama.", f"{arch}.", 1): field for key, field in fields.items()}, tensors, arch)


def write_fields(path, fields: dict, tensors: dict, arch: str = "llama") -> None:
    """A GGUF file of exactly these metadata fields, {key: (kind, value)} with every scalar kind GGUF has (so
    values can be as wrong as a file can hold), and tensors {name: (array, raw_dtype)}."""
    writer = GGUFWriter(str(path), arch)
    add = {"u32": writer.add_uint32, "u64": writer.add_uint64, "i32": writer.add_int32, "i64": writer.add_int64,
           "f32": writer.add_float32, "f64": writer.add_float64, "bool": writer.add_bool, "str": writer.add_string,
           "arr": writer.add_array}
    for key, (kind, value) in fields.items():
        add[kind](key, value)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
