"""Checkpoints: HF directories, GGUF files (every common tensor type), hub ids, and bad input.

Tiny GGUF files are written (by gguf_files.py) the way llama.cpp's convert_hf_to_gguf.py writes a llama
model: its metadata keys, its tensor names, q/k rows permuted by its LlamaModel.permute, 1-D tensors in F32.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import struct
import time

import numpy as np
import pytest
import torch
from conftest import TINY, as_variant, hf_copy, tiny_model
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import gguf_name, gguf_tensors, permute, write_gguf
from safetensors.torch import load_file, save_file

import smollm2
from smollm2 import SmolConfig, SmolError, SmolLM2, Tokenizer, save
from smollm2.checkpoints import load_checkpoint, parameter_shapes
from smollm2.checkpoints.checkpoint import all_finite
from smollm2.checkpoints.gguf import SCALES, Skipped, dequantized, gguf_config, open_gguf, scales_finite

GQA = TINY["gqa"]
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf.quants.quantize can
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # it cannot: raw blocks are crafted instead


def load(src, **kwargs) -> SmolLM2:
    """model.py's reference modules, as the models these tests build and compare with (test_model.py and
    test_kernels.py compare the accelerated ones)."""
    return smollm2.load(src, kernels=False, **kwargs)


def ids_for(config: SmolConfig, B: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def hf_load(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()


def expected_from_gguf(tensors: dict, config: SmolConfig) -> dict:
    """What a loader must produce: each GGUF tensor dequantized by gguf-py, q/k rows un-permuted."""
    out = {}
    hf_names = {gguf_name(n): n for n in SmolLM2(config).state_dict()}
    for name, (array, raw_dtype) in tensors.items():
        qtype = raw_dtype or (Q.F32 if array.dtype == np.float32 else Q.F16)
        out[hf_names[name]] = torch.from_numpy(np.array(dequantize(array, qtype), dtype=np.float32))
    return out


def assert_loaded_equals(ckpt_tensors: dict, expected: dict, config: SmolConfig) -> None:
    """Our (un-permuted) tensors, permuted again llama.cpp's way, are exactly the GGUF's dequantized rows."""
    assert ckpt_tensors.keys() == expected.keys()
    for name, w in ckpt_tensors.items():
        a = w.numpy()
        if ".q_proj." in name:
            a = permute(a, config.num_attention_heads, config.num_attention_heads)
        elif ".k_proj." in name:
            a = permute(a, config.num_attention_heads, config.num_key_value_heads)
        assert np.array_equal(a, expected[name].numpy()), name


# K-quants: ggml's block layouts, with the fp16 scale fields set to sane values and every other byte random.
K_LAYOUT = {  # qtype: byte offsets of the fp16 fields in a 256-value block
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def craft_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_LAYOUT[qtype]:
        scale = rng.uniform(2e-4, 1e-3, (rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml-quants.c get_scale_min_k4."""
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def f16(b: np.ndarray) -> float:
    return float(np.frombuffer(b.tobytes(), dtype=np.float16)[0])


def ggml_dequantize_block(qtype: Q, b: np.ndarray) -> np.ndarray:
    """A transcription of ggml-quants.c's dequantize_row_* for one block: an independent reference."""
    y = np.zeros(256 if qtype in K_QUANTS else 32, dtype=np.float64)
    if qtype == Q.Q8_0:
        return f16(b[:2]) * b[2:].view(np.int8).astype(np.float64)
    if qtype == Q.Q4_1:
        d, m, qs = f16(b[:2]), f16(b[2:4]), b[4:]
        return np.concatenate([(qs & 0xF) * d + m, (qs >> 4) * d + m])
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin, scales = f16(b[:2]), f16(b[2:4]), b[4:16]
        qh, ql = (b[16:48], b[48:]) if qtype == Q.Q5_K else (np.zeros(32, np.uint8), b[16:])
        for n, j in enumerate(range(0, 256, 64)):
            (s1, m1), (s2, m2) = scale_min_k4(2 * n, scales), scale_min_k4(2 * n + 1, scales)
            q = ql[32 * n:32 * n + 32]
            hi1, hi2 = (qh >> (2 * n)) & 1, (qh >> (2 * n + 1)) & 1
            y[j:j + 32] = d * s1 * ((q & 0xF) + 16 * hi1) - dmin * m1
            y[j + 32:j + 64] = d * s2 * ((q >> 4) + 16 * hi2) - dmin * m2
        return y
    if qtype == Q.Q6_K:
        ql, qh, sc, d = b[:128], b[128:192], b[192:208].view(np.int8), f16(b[208:210])
        for n in range(2):
            L, H, S, out = ql[64 * n:], qh[32 * n:], sc[8 * n:], y[128 * n:]
            for i in range(32):
                s = i // 16
                q1 = int((L[i] & 0xF) | (((H[i] >> 0) & 3) << 4)) - 32
                q2 = int((L[i + 32] & 0xF) | (((H[i] >> 2) & 3) << 4)) - 32
                q3 = int((L[i] >> 4) | (((H[i] >> 4) & 3) << 4)) - 32
                q4 = int((L[i + 32] >> 4) | (((H[i] >> 6) & 3) << 4)) - 32
                out[i], out[i + 32] = d * S[s] * q1, d * S[s + 2] * q2
                out[i + 64], out[i + 96] = d * S[s + 4] * q3, d * S[s + 6] * q4
        return y
    raise NotImplementedError(qtype)


# ---------------------------------------------------------------------------------------------------------
# The embedded SmolLM2-135M-Instruct GGUF (first: its parsed metadata is still cached from the model fixture)


def test_embedded_gguf_config_and_types(embedded_path):
    reader = open_gguf(embedded_path)
    c = gguf_config(reader, embedded_path)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.attention_bias and not c.mlp_bias
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    types = {t.name: Q(t.tensor_type) for t in reader.tensors}
    assert types["token_embd.weight"] == Q.Q8_0 and types["output_norm.weight"] == Q.F32
    assert {types[n] for n in types if n.endswith("weight") and "norm" not in n and n != "token_embd.weight"} == {
        Q.Q4_1}


def test_embedded_gguf_dequantized_as_ggml_does(model, embedded_path):
    """The real file's Q8_0 embedding and Q4_1 q_proj, decoded by a transcription of ggml's C code."""
    reader = open_gguf(embedded_path)
    t = {t.name: t for t in reader.tensors}
    emb = t["token_embd.weight"].data  # (49152, 576/32 * 34) bytes
    for row in (0, 1, 2, 1000, 49151):
        ref = np.concatenate([ggml_dequantize_block(Q.Q8_0, b) for b in emb[row].reshape(-1, 34)])
        np.testing.assert_allclose(model.model.embed_tokens.weight[row].detach().numpy(), ref, rtol=1e-6, atol=0)
    q = t["blk.0.attn_q.weight"].data  # rows permuted by llama.cpp
    ours = permute(model.model.layers[0].self_attn.q_proj.weight.detach().numpy(), 9, 9)
    for row in (0, 1, 63, 64, 575):
        ref = np.concatenate([ggml_dequantize_block(Q.Q4_1, b) for b in q[row].reshape(-1, 20)])
        np.testing.assert_allclose(ours[row], ref, rtol=1e-6, atol=1e-7)


def test_embedded_weights_decode_as_the_gguf_library_decodes_them(embedded_path):
    """Q8_0 and Q4_1 are decoded in torch (checkpoints.gguf.dequantized): bit for bit gguf.quants.dequantize's."""
    for t in open_gguf(embedded_path).tensors:
        assert np.array_equal(dequantized(t.data, Q(t.tensor_type)).numpy(), dequantize(t.data, Q(t.tensor_type))
                              .reshape(-1)), t.name


def test_metadata_and_tensors_read_as_the_gguf_librarys_reader_reads_them(embedded_path, tmp_path):
    """open_gguf's own reader against gguf's GGUFReader (100x slower): every key, value and Python type, every
    tensor's name, type, shape, numpy type and bytes, on the embedded file and on tiny ones of every type."""
    from gguf import GGUFReader

    paths = [embedded_path]
    for kind in QUANTIZABLE:
        model = tiny_model(GQA)
        paths.append(tmp_path / f"{kind.name}.gguf")
        write_gguf(paths[-1], model.config, gguf_tensors(model, kind), general__alignment=("u32", 64))
    for path in paths:
        ours, theirs = open_gguf(path), GGUFReader(path)
        expected = {key: field.contents() for key, field in theirs.fields.items()}
        assert ours.metadata == expected
        assert [type(v) for v in ours.metadata.values()] == [type(v) for v in expected.values()]
        assert len(ours.tensors) == len(theirs.tensors) > 0
        for mine, reference in zip(ours.tensors, theirs.tensors):
            assert (mine.name, mine.tensor_type, mine.shape) == (reference.name, reference.tensor_type,
                                                                  tuple(reference.shape.tolist()))
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
            assert mine.data.tobytes() == reference.data.tobytes()


def test_a_model_loading_reads_no_vocabulary(embedded_path):
    """open_gguf(strings=False), what read_gguf opens: each array of strings (the tokenizer's tokens and merges) is
    skipped, its length alone kept (the config's vocab_size when no llama.vocab_size says it), every other value
    as the full reader's; the two are read and cached apart."""
    full, bare = open_gguf(embedded_path), open_gguf(embedded_path, strings=False)
    assert bare is not full and bare is open_gguf(embedded_path, strings=False)
    skipped = {key for key, value in bare.metadata.items() if isinstance(value, Skipped)}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= skipped
    assert skipped == {key for key, value in full.metadata.items() if isinstance(value, list) and value
                       and isinstance(value[0], str)}
    assert all(len(bare.metadata[key]) == len(full.metadata[key]) for key in skipped)
    assert {k: v for k, v in bare.metadata.items() if k not in skipped} == {
        k: v for k, v in full.metadata.items() if k not in skipped}
    assert gguf_config(bare, embedded_path) == gguf_config(full, embedded_path)
    no_count = {k: v for k, v in bare.metadata.items() if k != "llama.vocab_size"}
    assert gguf_config(dataclasses.replace(bare, metadata=no_count), embedded_path).vocab_size == 49152


def gguf_header(kv_count: int, *fields: bytes, tensor_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + b"".join(fields)


def gguf_key(key: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode()


HOSTILE_STRUCTURES = [
    (gguf_header(2**60), "metadata keys cannot fit"),
    (gguf_header(1, struct.pack("<Q", 2**62), bytes(30)), "a string of 4611686018427387904 bytes"),
    (gguf_header(1, gguf_key("a"), struct.pack("<IIQ", 9, 8, 2**40)), "an array of 1099511627776 strings"),
    (gguf_header(1, gguf_key("a"), struct.pack("<IIQ", 9, 5, 2**40)), "run past the end"),
    (gguf_header(1, gguf_key("a"), struct.pack("<IIQ", 9, 9, 1), struct.pack("<IQ", 5, 0)), "unknown value type 9"),
    (gguf_header(1, gguf_key("a"), struct.pack("<I", 13)), "unknown value type 13"),
    (gguf_header(2, *[gguf_key("a") + struct.pack("<Ii", 5, 1)] * 2, bytes(30)), "metadata key a appears twice"),
    (gguf_header(0, gguf_key("t") + struct.pack("<I5Q", 5, *[1] * 5) + bytes(30), tensor_count=1), "5 dimensions"),
    (gguf_header(0, bytes(30), tensor_count=2**59), "tensor records cannot fit"),
    (gguf_header(1, gguf_key("general.alignment"), struct.pack("<II", 4, 24), bytes(30)), "power of two, got 24"),
    (b"GGUF" + struct.pack("<IQQ", 3 << 24, 0, 0), "big-endian"),
]


@pytest.mark.parametrize("contents, message", HOSTILE_STRUCTURES, ids=[m for _, m in HOSTILE_STRUCTURES])
def test_a_hostile_gguf_structure_is_refused_before_anything_is_allocated(tmp_path, contents, message):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(contents)
    start = time.perf_counter()
    raises(path, path.name, "truncated or corrupt GGUF", message)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------------------------------------------------
# HF directories


@pytest.mark.parametrize("name", ["gqa", "mqa", "bias", "untied", "head_dim"])
def test_save_loads_in_transformers_and_round_trips(tmp_path, name, record_property):
    model = tiny_model(TINY[name])
    save(model, tmp_path)
    ids = ids_for(model.config)
    ours = logits(model, ids)
    theirs = logits(hf_load(tmp_path), ids)
    record_property("max_abs_diff", (ours - theirs).abs().max().item())
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    back = load(tmp_path)
    assert back.config == model.config
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(back, ids), ours)


@torch.no_grad()
def test_real_weights_as_hf_directory_equal_the_gguf(either_model, variant, english, tmp_path, record_property):
    """The embedded 135M saved as a HF directory: our load and transformers' give the GGUF's logits."""
    save(either_model, tmp_path)
    ids = torch.tensor([Tokenizer.from_pretrained().encode(english)[:256]])
    expected = either_model(ids)
    assert torch.equal(smollm2.load(tmp_path, kernels=variant == "accelerated")(ids), expected)
    diff = (hf_load(tmp_path)(ids).logits - expected).abs().max().item()
    record_property("max_abs_diff", diff)
    assert diff <= 1e-4


def test_transformers_save_pretrained_loads(tmp_path):
    """What transformers itself writes (5.x config, its tensor names) loads here; tied lm_head dropped."""
    for name in ("gqa", "untied"):
        model = tiny_model(TINY[name])
        hf_copy(model).save_pretrained(tmp_path / name)
        back = load(tmp_path / name)
        assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
        ids = ids_for(model.config)
        assert torch.equal(logits(back, ids), logits(model, ids))


def save_sharded(model: SmolLM2, directory) -> dict[str, str]:
    """The model as a HF directory of two shards and their index, as large hub models are; the weight map."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    directory.mkdir(parents=True, exist_ok=True)
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(directory / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": sum(v.numel() * 4 for v in sd.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(model.config.to_hf()))
    return weight_map


def test_sharded_directory(tmp_path):
    model = tiny_model(GQA)
    save_sharded(model, tmp_path)
    ids = ids_for(model.config)
    back = load(tmp_path)
    assert torch.equal(logits(back, ids), logits(model, ids))
    torch.testing.assert_close(logits(hf_load(tmp_path), ids), logits(model, ids), atol=1e-5, rtol=0)
    # A shard listed in the index but absent is named.
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SmolError, match="model-00002-of-00002.safetensors"):
        load(tmp_path)


@pytest.mark.parametrize("style", ["4.x", "5.x"])
def test_config_styles(tmp_path, style):
    model = tiny_model(dataclasses.replace(GQA, rope_theta=5000.0))  # not the default: it must be read
    save(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_theta"] == 5000.0  # save writes 4.x keys
    if style == "5.x":
        hf.pop("rope_theta")
        hf["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
        (tmp_path / "config.json").write_text(json.dumps(hf))
    back = load(tmp_path)
    assert back.config.rope_theta == 5000.0 and back.config == model.config
    ids = ids_for(model.config)
    assert torch.equal(logits(back, ids), logits(model, ids))
    torch.testing.assert_close(logits(hf_load(tmp_path), ids), logits(back, ids), atol=1e-5, rtol=0)


def test_config_defaults_as_transformers():
    """Keys a config.json may omit take transformers' LlamaConfig defaults."""
    c = SmolConfig.from_hf({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100})
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.tie_word_embeddings is False
    with pytest.raises(SmolError, match="rope"):
        SmolConfig.from_hf({**GQA.to_hf(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


# ---------------------------------------------------------------------------------------------------------
# GGUF


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_gguf_types_match_dequantized_weights_and_transformers(tmp_path, qtype, variant, record_property):
    model = tiny_model(GQA)
    tensors = gguf_tensors(model, qtype)
    if qtype != Q.F32:  # as the real file: embedding in Q8_0, the rest in qtype
        a = model.state_dict()["model.embed_tokens.weight"].numpy()
        tensors["token_embd.weight"] = (quantize(a, Q.Q8_0), Q.Q8_0)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, model.config, tensors)

    ckpt = load_checkpoint(path)  # GGUF has no initializer_range; every other field round-trips
    assert dataclasses.replace(ckpt.config, initializer_range=model.config.initializer_range) == model.config
    assert_loaded_equals(ckpt.tensors, expected_from_gguf(tensors, model.config), model.config)

    ours = smollm2.load(path, kernels=variant == "accelerated")
    ids = ids_for(model.config)
    theirs = hf_load(tmp_path, gguf_file=path.name)
    diff = (logits(ours, ids) - logits(theirs, ids)).abs().max().item()
    record_property("max_abs_diff_vs_transformers", diff)
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)
    if qtype == Q.F32:  # the same weights as a HF directory: the very same logits
        save(model, tmp_path / "hf")
        hf_dir = smollm2.load(tmp_path / "hf", kernels=variant == "accelerated")
        assert torch.equal(logits(ours, ids), logits(hf_dir, ids))
        assert torch.equal(logits(ours, ids), logits(as_variant(model, variant), ids))


@pytest.mark.parametrize("name", ["mqa", "mha", "bias", "untied", "head_dim"])
def test_gguf_every_architecture_branch(tmp_path, name):
    """F32 GGUF of each tiny variant gives exactly the original model (permutation undone, biases too)."""
    model = tiny_model(TINY[name])
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model.config, gguf_tensors(model, Q.F32))
    ours = load(path)
    assert ours.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert (ours.config.attention_bias, ours.config.mlp_bias) == (model.config.attention_bias,
                                                                    model.config.mlp_bias)
    assert ours.config.head_dim == model.config.head_dim
    ids = ids_for(model.config)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(ours, ids), logits(model, ids))
    if name != "bias":  # transformers' GGUF loader knows no llama biases
        torch.testing.assert_close(logits(hf_load(tmp_path, gguf_file=path.name), ids), logits(ours, ids),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_gguf_k_quants_from_crafted_blocks(tmp_path, qtype):
    """gguf-py cannot quantize K-quants, so raw blocks are crafted; the loader must dequantize them as
    gguf-py does (and, for Q4_K/Q5_K/Q6_K, as a transcription of ggml's C code does), and as transformers.
    The logits are compared on torch's path, whose roundings are transformers': the crafted weights are
    large (logits up to ~70), so the kernels' other summation orders move them by ~1e-3."""
    config = dataclasses.replace(GQA, hidden_size=256, intermediate_size=256, num_hidden_layers=1, head_dim=None,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = tiny_model(config)
    rng = np.random.default_rng(0)
    tensors = gguf_tensors(model, Q.F32)
    for name, (a, _) in tensors.items():
        if a.ndim == 2:
            tensors[name] = (craft_blocks(*a.shape, qtype, rng), qtype)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, config, tensors)

    ckpt = load_checkpoint(path)
    expected = expected_from_gguf(tensors, config)
    assert all(torch.isfinite(w).all() for w in expected.values())
    assert_loaded_equals(ckpt.tensors, expected, config)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw, _ = tensors["blk.0.ffn_down.weight"]
        for row in (0, 7, 255):
            ref = ggml_dequantize_block(qtype, raw[row])
            np.testing.assert_allclose(ckpt.tensors["model.layers.0.mlp.down_proj.weight"][row].numpy(), ref,
                                       rtol=1e-6, atol=1e-6)
    ours = load(path)
    ids = ids_for(config)
    torch.testing.assert_close(logits(ours, ids), logits(hf_load(tmp_path, gguf_file=path.name), ids),
                               atol=1e-5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Hub ids, from a local cache only


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--org--tiny-llama" / "snapshots" / commit
    model = tiny_model(GQA)
    save(model, snapshot)
    (cache / "models--org--tiny-llama" / "refs").mkdir()
    (cache / "models--org--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))

    back = load("org/tiny-llama")
    ids = ids_for(model.config)
    assert torch.equal(logits(back, ids), logits(model, ids))
    with pytest.raises(SmolError, match="org/missing-model"):
        load("org/missing-model")


# ---------------------------------------------------------------------------------------------------------
# Bad input: one SmolError each, naming the file and the tensor or field


@pytest.fixture
def hf_dir(tmp_path):
    model = tiny_model(GQA)
    save(model, tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture
def gguf_parts():
    model = tiny_model(GQA)
    return model.config, gguf_tensors(model, Q.F32)


def edit_config(directory, **changes):
    hf = json.loads((directory / "config.json").read_text())
    hf.update(changes)
    (directory / "config.json").write_text(json.dumps(hf))


def raises(src, *fragments):
    with pytest.raises(SmolError) as info:
        load(src)
    message = str(info.value)
    for fragment in fragments:
        assert str(fragment) in message, (fragment, message)
    return message


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.3, 0.999])
def test_truncated_gguf(tmp_path, gguf_parts, keep):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, *gguf_parts)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    raises(path, path.name, "truncated or corrupt GGUF")


def test_corrupt_gguf(tmp_path, gguf_parts):
    rng = np.random.default_rng(0)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    raises(garbage, "garbage.gguf", "corrupt GGUF")
    # A valid header followed by garbage.
    path = tmp_path / "tiny.gguf"
    write_gguf(path, *gguf_parts)
    data = bytearray(path.read_bytes())
    data[24:4096] = rng.integers(0, 256, 4096 - 24, dtype=np.uint8).tobytes()
    bad = tmp_path / "bad-kv.gguf"
    bad.write_bytes(bytes(data))
    raises(bad, "bad-kv.gguf")


def test_truncated_and_corrupt_safetensors(hf_dir):
    st = hf_dir / "model.safetensors"
    data = st.read_bytes()
    for keep in (0.999, 0.5, 0.0001):
        st.write_bytes(data[:int(len(data) * keep)])
        raises(hf_dir, "model.safetensors", "truncated or corrupt safetensors")
    st.write_bytes(struct.pack("<Q", 40) + b"{not json" + bytes(100))
    raises(hf_dir, "model.safetensors", "corrupt")


def test_config_shapes_disagree_with_weights(hf_dir):
    edit_config(hf_dir, intermediate_size=128)
    raises(hf_dir, "model.safetensors", "model.layers.0.mlp.gate_proj.weight", "(256, 64)", "(128, 64)")


def test_gguf_metadata_disagrees_with_weights(tmp_path, gguf_parts):
    path = tmp_path / "ffn.gguf"
    write_gguf(path, *gguf_parts, llama__feed_forward_length=128)
    raises(path, "ffn.gguf", "blk.0.ffn_gate.weight", "(256, 64)", "(128, 64)")
    # A head count the q rows cannot be split into: named, not a reshape crash.
    path = tmp_path / "heads.gguf"
    write_gguf(path, *gguf_parts, llama__attention__head_count=6, llama__attention__head_count_kv=2,
               llama__attention__key_length=None, llama__attention__value_length=None,
               llama__rope__dimension_count=None)
    raises(path, "heads.gguf", "q_proj.weight", "(64, 64)", "(60, 64)")


def test_missing_tensor(hf_dir, tmp_path, gguf_parts):
    sd = load_file(hf_dir / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(hf_dir / "model.safetensors"))
    raises(hf_dir, str(hf_dir), "missing tensor model.layers.1.mlp.up_proj.weight")
    config, tensors = gguf_parts
    del tensors["blk.1.ffn_up.weight"]
    write_gguf(tmp_path / "missing.gguf", config, tensors)
    raises(tmp_path / "missing.gguf", "missing.gguf", "missing tensor model.layers.1.mlp.up_proj.weight")


def test_extra_tensor(hf_dir, tmp_path, gguf_parts):
    sd = load_file(hf_dir / "model.safetensors")
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, str(hf_dir / "model.safetensors"))
    raises(hf_dir, "model.safetensors", "unexpected tensor model.layers.0.self_attn.q_norm.weight")
    config, tensors = gguf_parts
    tensors["blk.0.attn_q_norm.weight"] = (np.ones(16, np.float32), None)
    write_gguf(tmp_path / "extra.gguf", config, tensors)
    raises(tmp_path / "extra.gguf", "extra.gguf", "unexpected tensor blk.0.attn_q_norm.weight")
    config, tensors = gguf_parts
    del tensors["blk.0.attn_q_norm.weight"]
    tensors["blk.2.attn_norm.weight"] = (np.ones(64, np.float32), None)  # a layer beyond block_count
    write_gguf(tmp_path / "extra2.gguf", config, tensors)
    raises(tmp_path / "extra2.gguf", "extra2.gguf", "model.layers.2.input_layernorm.weight")


@pytest.mark.parametrize("changes", [{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
                                     {"architectures": ["GPT2LMHeadModel"]}, {"model_type": "mistral"},
                                     {"hidden_act": "gelu"}])
def test_unknown_architecture(hf_dir, changes):
    edit_config(hf_dir, **changes)
    raises(hf_dir, "config.json", "unsupported")


def test_non_llama_gguf(tmp_path, gguf_parts):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, *gguf_parts, arch="gpt2")
    raises(path, "gpt2.gguf", "unsupported architecture 'gpt2'")
    path = tmp_path / "scaled.gguf"
    write_gguf(path, *gguf_parts, llama__rope__scaling__type=("str", "linear"),
               llama__rope__scaling__factor=("f32", 4.0))
    raises(path, "scaled.gguf", "rope scaling")
    config, tensors = gguf_parts
    tensors["rope_freqs.weight"] = (np.ones(8, np.float32), None)  # llama 3's frequency factors
    write_gguf(tmp_path / "freqs.gguf", config, tensors)
    raises(tmp_path / "freqs.gguf", "freqs.gguf", "rope scaling")


class _CreatesFileWhenUnpickled:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


def test_pickle_checkpoints_refused_never_unpickled(tmp_path, monkeypatch):
    # The payload does what it says when unpickled (checked on another path).
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_CreatesFileWhenUnpickled(probe))).close()
    assert probe.exists()

    marker = tmp_path / "pwned"
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(GQA.to_hf()))
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_CreatesFileWhenUnpickled(marker)))

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    raises(directory, "pytorch_model.bin", "pickle")
    raises(directory / "pytorch_model.bin", "pytorch_model.bin", "pickle")
    shutil.copy(directory / "pytorch_model.bin", tmp_path / "weights.pt")
    raises(tmp_path / "weights.pt", "weights.pt", "pickle")
    assert not marker.exists()


def test_nonexistent_path(tmp_path):
    raises(tmp_path / "nowhere", "nowhere", "no such file")
    raises(tmp_path / "nowhere.gguf", "nowhere.gguf", "no such file")
    empty = tmp_path / "empty"
    empty.mkdir()
    raises(empty, "empty", "config.json")
    not_ckpt = tmp_path / "notes.txt"
    not_ckpt.write_text("hello")
    raises(not_ckpt, "notes.txt", "not a checkpoint")


@pytest.mark.parametrize("field, value", [("hidden_size", -64), ("num_hidden_layers", 0),
                                          ("vocab_size", "512"), ("num_key_value_heads", 3),
                                          ("head_dim", 15), ("rms_norm_eps", 0), ("rope_theta", None),
                                          ("intermediate_size", 1.5)])
def test_invalid_config_values(hf_dir, field, value):
    edit_config(hf_dir, **{field: value})
    raises(hf_dir, "config.json", field)
    with pytest.raises(SmolError, match=field):
        SmolConfig(**{**dataclasses.asdict(GQA), field: value})


def test_invalid_gguf_metadata(tmp_path, gguf_parts):
    for key, value, field in [("llama__attention__head_count", 0, "num_attention_heads"),
                              ("llama__attention__head_count_kv", 3, "num_key_value_heads"),
                              ("llama__attention__layer_norm_rms_epsilon", -1.0, "rms_norm_eps"),
                              ("llama__block_count", None, "llama.block_count")]:
        path = tmp_path / f"{field}.gguf"
        write_gguf(path, *gguf_parts, **{key: value})
        raises(path, path.name, field)


def test_unreadable_config_json(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    raises(hf_dir, "config.json")
    (hf_dir / "config.json").write_text("[1, 2]")
    raises(hf_dir, "config.json")


# Untrusted sizes, types, paths and values: refused before anything is built, in one line naming what is wrong

def quickly_raises(src, *fragments):
    """raises(), in well under the seconds that building modules or tables of a huge size would take."""
    start = time.perf_counter()
    raises(src, *fragments)
    assert time.perf_counter() - start < 2, fragments


@pytest.mark.parametrize("name", TINY)
def test_parameter_shapes_are_the_state_dicts(name):
    """What checkpoints are checked against before a model is built is what it builds."""
    shapes = {k: v.shape for k, v in SmolLM2(TINY[name]).state_dict().items()}
    assert parameter_shapes(TINY[name]) == shapes


def test_huge_sizes_fail_before_anything_is_built(tmp_path, hf_dir, gguf_parts):
    for key, value, fragment in [("llama__block_count", 1000, "missing tensor model.layers.1"),
                                 ("llama__block_count", 10**9, "num_hidden_layers"),
                                 ("llama__embedding_length", 2**31, "token_embd.weight"),
                                 ("llama__feed_forward_length", 2**31, "blk.0.ffn_gate.weight"),
                                 ("llama__vocab_size", 2**31, "token_embd.weight"),
                                 ("llama__attention__key_length", 2**30, "llama.attention.key_length"),
                                 ("llama__context_length", 2**31, "max_position_embeddings")]:
        path = tmp_path / f"{key}.gguf"
        write_gguf(path, *gguf_parts, **{key: value})
        quickly_raises(path, path.name, fragment)
    for field, fragment in [("intermediate_size", "mlp.gate_proj.weight"), ("vocab_size", "embed_tokens.weight"),
                            ("num_hidden_layers", "num_hidden_layers")]:
        edit_config(hf_dir, **{field: 10**12})
        quickly_raises(hf_dir, fragment)
        edit_config(hf_dir, **{field: getattr(GQA, field)})
    # The largest context window allowed loads, and its RoPE tables grow only as far as a cache needs.
    path = tmp_path / "long.gguf"
    write_gguf(path, *gguf_parts, llama__context_length=2**24)
    model = load(path)
    assert model.rope_cos.shape[0] <= 8192
    model.new_cache(1, 10000)
    assert 10000 <= model.rope_cos.shape[0] <= 20000


def test_metadata_of_wrong_type_or_value(tmp_path, hf_dir, gguf_parts):
    for key, value, fragment in [("llama__attention__layer_norm_rms_epsilon", ("str", "1e-5"),
                                  "llama.attention.layer_norm_rms_epsilon must be a number"),
                                 ("llama__embedding_length", ("str", "64"),
                                  "llama.embedding_length must be an integer"),
                                 ("llama__block_count", ("arr", [2, 2]), "llama.block_count must be an integer"),
                                 ("llama__rope__freq_base", ("f32", float("inf")), "rope_theta"),
                                 ("llama__attention__layer_norm_rms_epsilon", ("f32", float("nan")), "rms_norm_eps"),
                                 ("tokenizer__ggml__bos_token_id", ("str", "<s>"), "bos_token_id")]:
        path = tmp_path / "typed.gguf"
        write_gguf(path, *gguf_parts, **{key: value})
        raises(path, path.name, fragment)
    good = (hf_dir / "config.json").read_text()
    for field, value in [("rope_scaling", "linear"), ("rope_theta", float("inf")), ("rms_norm_eps", float("nan")),
                         ("tie_word_embeddings", "false"), ("eos_token_id", [2, "x"])]:
        edit_config(hf_dir, **{field: value})
        raises(hf_dir, "config.json", field)
        (hf_dir / "config.json").write_text(good)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_vector_relabelled_as_quantized(tmp_path, gguf_parts, qtype):
    """A 1-D float tensor whose type says blocks: decoded as the file says, never handed to the kernels'
    matrix layout."""
    config, tensors = gguf_parts
    tensors["output_norm.weight"] = (np.ones(64, np.float32), qtype)
    path = tmp_path / "relabelled.gguf"
    write_gguf(path, config, tensors)
    stored = next(t for t in open_gguf(path).tensors if t.name == "output_norm.weight")
    model = load(path)
    assert torch.equal(model.model.norm.weight, torch.from_numpy(dequantize(stored.data, qtype)))


def test_shards_outside_the_directory_refused(tmp_path, hf_dir):
    outside = tmp_path / "elsewhere"
    shutil.copytree(hf_dir, outside)
    names = load_file(hf_dir / "model.safetensors").keys()
    (hf_dir / "model.safetensors").unlink()
    messages = []
    for shard in ["../elsewhere/model.safetensors", str(outside / "model.safetensors"), "../nowhere.safetensors",
                  "sub/../../elsewhere/model.safetensors"]:
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
        messages.append(raises(hf_dir, "model.safetensors.index.json", shard, "outside").replace(shard, "?"))
    assert len(set(messages)) == 1  # whether the file exists is not told


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_sees_every_nan_and_infinity(dtype):
    t = torch.randn(1000).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 777, 999):
            u = t.clone()
            u[at] = bad
            assert not all_finite(u), (bad, at)


def test_non_finite_weights_named(tmp_path, hf_dir, gguf_parts):
    sd = load_file(hf_dir / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(sd, str(hf_dir / "model.safetensors"))
    raises(hf_dir, "model.safetensors", "model.layers.1.mlp.down_proj.weight", "NaN or infinite")
    config, tensors = gguf_parts
    tensors["blk.0.attn_v.weight"][0][0, 0] = np.inf
    write_gguf(tmp_path / "inf.gguf", config, tensors)
    raises(tmp_path / "inf.gguf", "inf.gguf", "blk.0.attn_v.weight", "NaN or infinite")


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_quantized_blocks_finite_exactly_where_their_scales_are(qtype):
    """A block's values (gguf's dequantization) are all finite exactly when its float16 scales are, which is what
    loading checks of the types in SCALES instead of decoding every value: random bytes, 1 scale in 32 infinite
    or NaN (float16's top exponent), over 4096 blocks each, and blocks made non-finite at each scale."""
    from gguf import GGML_QUANT_SIZES

    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.random.default_rng(int(qtype)).integers(0, 256, (4096, size), dtype=np.uint8)
    for i, at in enumerate(SCALES[qtype]):  # an infinity, then a NaN, at each scale of a block
        blocks[2 * i, at:at + 2] = np.array([np.inf], np.float16).view(np.uint8)
        blocks[2 * i + 1, at:at + 2] = np.array([np.nan], np.float16).view(np.uint8)
    with np.errstate(all="ignore"):
        finite = np.isfinite(dequantize(blocks, qtype).reshape(len(blocks), -1)).all(axis=1)
    found = np.array([scales_finite(block, qtype) for block in blocks])
    assert np.array_equal(found, finite)
    assert 0 < finite.sum() < len(blocks) - 2 * len(SCALES[qtype])  # both kinds, beyond those made non-finite
    assert scales_finite(blocks[finite], qtype) and not scales_finite(blocks, qtype)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q3_K], ids=lambda q: q.name)
def test_non_finite_quantized_weights_named(tmp_path, qtype):
    """A matrix read as its blocks (the kernels' load) with one infinite scale is refused by name, as a float one
    is: checked from the scales (Q8_0, Q4_K) or, of a type the kernels do not stream (Q3_K), its decoded values.
    Its file loads without it."""
    from test_kernels import WIDE, crafted_blocks

    rng, tensors = np.random.default_rng(0), {}
    craft = craft_blocks if qtype in K_LAYOUT else crafted_blocks
    for name, t in tiny_model(WIDE).state_dict().items():
        tensors[gguf_name(name)] = (t.numpy(), None) if t.dim() == 1 else (craft(*t.shape, qtype, rng), qtype)
    write_gguf(tmp_path / "fine.gguf", WIDE, tensors)
    smollm2.load(tmp_path / "fine.gguf")
    at = K_LAYOUT.get(qtype, SCALES.get(qtype))[-1]
    tensors["blk.1.ffn_down.weight"][0][3, at:at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    write_gguf(tmp_path / "inf.gguf", WIDE, tensors)
    with pytest.raises(SmolError, match=r"inf\.gguf \(blk\.1\.ffn_down\.weight\).*NaN or infinite"):
        smollm2.load(tmp_path / "inf.gguf")


# Every integer and boolean type a safetensors header can name (and the floats a weight is never stored as), each
# with its size in bytes: a weight retyped in place keeps its byte count, so the last dimension is rescaled.
SAFETENSORS_NOT_WEIGHTS = {"I64": 8, "U64": 8, "F64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
                           "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def retype_safetensors(path, name: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in a float32 safetensors file's header, its bytes and offsets untouched: what a
    damaged or foreign file looks like to the loader (every offset still fits)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    entry = header[name]
    assert entry["dtype"] == "F32"
    width = entry["shape"][-1] * 4 // SAFETENSORS_NOT_WEIGHTS[dtype]
    entry["dtype"], entry["shape"] = dtype, [*entry["shape"][:-1], width]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


RETYPED = "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("dtype", SAFETENSORS_NOT_WEIGHTS)
def test_a_weight_stored_as_integers_is_refused_by_name(hf_dir, dtype):
    retype_safetensors(hf_dir / "model.safetensors", RETYPED, dtype)
    message = raises(hf_dir, "model.safetensors", RETYPED, f"stored as {dtype}", "F32, F16, BF16")
    assert "\n" not in message


def test_a_retyped_weight_is_refused_in_a_shard_and_from_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / commit
    shards = save_sharded(tiny_model(GQA), snapshot)
    retype_safetensors(snapshot / shards[RETYPED], RETYPED, "I32")
    raises(snapshot, shards[RETYPED], RETYPED, "stored as I32")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    raises("org/tiny-llama", shards[RETYPED], RETYPED, "stored as I32")


@pytest.mark.parametrize("qtype, numpy_type", [(Q.I8, np.int8), (Q.I16, np.int16), (Q.I32, np.int32),
                                               (Q.I64, np.int64), (Q.F64, np.float64)], ids=str)
def test_a_gguf_weight_of_an_integer_type_is_refused_by_name(tmp_path, gguf_parts, qtype, numpy_type):
    config, tensors = gguf_parts
    name = "blk.0.attn_output.weight"
    tensors[name] = (tensors[name][0].astype(numpy_type), qtype)
    write_gguf(tmp_path / "retyped.gguf", config, tensors)
    message = raises(tmp_path / "retyped.gguf", "retyped.gguf", name, f"stored as {qtype.name}", "quantized blocks")
    assert "\n" not in message


def test_a_sharded_training_checkpoint_of_integer_weights_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from smollm2.training.state import check_shard_types

    state = {"model": {"model.norm.weight": torch.ones(8), RETYPED: torch.zeros(8, 8, dtype=torch.int32)},
             "optimizer": {"state": {"step": torch.tensor(3)}}}  # the optimizer's integers are not weights
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(SmolError, match=f"{tmp_path}: tensor {RETYPED} is stored as int32"):
        check_shard_types(tmp_path)
    state["model"][RETYPED] = torch.zeros(8, 8)
    dcp.save(state, checkpoint_id=tmp_path / "fine", no_dist=True)
    check_shard_types(tmp_path / "fine")


@pytest.mark.subprocess
def test_generate_and_serve_refuse_integer_weights_in_one_line(hf_dir):
    import subprocess
    import sys

    retype_safetensors(hf_dir / "model.safetensors", RETYPED, "I32")
    for flags in (["generate", "--max-new-tokens", "2", "--temperature", "0", "hi"], ["serve", "--port", "8731"]):
        # A bound: were the model loaded, serve would listen for ever.
        ran = subprocess.run([sys.executable, "-m", "smollm2", flags[0], "--model", str(hf_dir), *flags[1:]],
                             capture_output=True, text=True, timeout=120)
        err = ran.stderr.strip()
        assert ran.returncode == 1 and err.count("\n") == 0 and "Traceback" not in err, err
        assert f"model.safetensors: tensor {RETYPED} is stored as I32" in err
