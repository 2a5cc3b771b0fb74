"""GGUF export (save_gguf, `smollm2 export`): what is written reads back as it was, tensors and metadata as
llama.cpp's own converter (convert_hf_to_gguf.py) writes them from the same HF directory, the tokenizer as
llama.cpp's metadata describes it, and bad input is one line.

benchmarks/gguf_export.py checks the same files with llama.cpp itself.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY, tiny_model
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
import llama_cpp_converter
from llama_cpp_converter import CONVERTER, SCRIPT, VERSION
from tokenizers import Tokenizer as Backend
from tokenizers import models, processors

from smollm2 import SmolError, SmolLM2, Tokenizer, load, save
from smollm2.checkpoints import load_checkpoint, save_gguf
from smollm2.checkpoints.gguf import open_gguf
from smollm2.cli import main
from smollm2.quantize import quantize_int8

# max |logit diff| from the f32 model's, 2-5 times what the tiny models give (4e-4, 1.2e-2, 0.11; their logits
# reach ~1.3); the bytes of each tensor are the sharp check
TOLERANCE = {"f16": 2e-3, "q8_0": 3e-2, "q4_1": 0.25}
TRICKY = ["", "  leading and trailing  ", "many    spaces\tand\t\ttabs\n\n\n", "a\r\nb \u00a0c\u3000d",
          "naïve café, straße, ½ ² ³ ٣ ൬, 中文字符，日本語，한국어", "emoji 😀🎉👍🏽 🇫🇷 👨‍👩‍👧",
          "1234567 and 3.14", "<|im_start|>user\nHi<|im_end|>\n", "text<|endoftext|>more<file_sep>",
          "a<|im_startx|>b <|im_end", "\u200b\ufeff\x7f�"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained()


def ids_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def logits(model: SmolLM2) -> torch.Tensor:
    return model(ids_for(model.config.vocab_size))


def read_back(path) -> SmolLM2:
    return load(path, kernels=False)


@pytest.mark.parametrize("name", TINY)
def test_f32_reads_back_exactly(tmp_path, tokenizer, name):
    model = tiny_model(TINY[name])
    save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), tmp_path / "tiny.gguf")
    back = read_back(tmp_path / "tiny.gguf")
    assert torch.equal(logits(back), logits(model))
    assert open_gguf(tmp_path / "tiny.gguf").metadata["general.file_type"] == 0  # llama.cpp's ALL_F32
    # the special ids come from the tokenizer (the tiny configs share its bos and eos)
    assert back.config == dataclasses.replace(model.config, pad_token_id=tokenizer.pad_token_id,
                                              initializer_range=back.config.initializer_range)  # training only


@pytest.mark.parametrize("type", TOLERANCE)
@pytest.mark.parametrize("name", ["gqa", "untied", "bias"])
def test_quantized_types(tmp_path, tokenizer, name, type):
    """Matrices at the type, vectors in F32, but the output matrix at q4_1, kept at Q8_0 as llama.cpp's quantizer
    keeps it; and the model read back gives the f32 logits within the type's rounding. (The bytes: the next test
    against llama.cpp's converter at f16 and q8_0; at q4_1, benchmarks/gguf_export.py against its quantizer.)"""
    model = tiny_model(TINY[name])
    save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), tmp_path / "tiny.gguf", type)
    qtype = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_1": Q.Q4_1}[type]
    output = "token_embd.weight" if model.config.tie_word_embeddings else "output.weight"
    file = open_gguf(tmp_path / "tiny.gguf")  # parsed once: read_back below reuses it
    assert file.metadata["general.file_type"] == {"f16": 1, "q8_0": 7, "q4_1": 3}[type]  # llama.cpp's MOSTLY_*
    expected = {t.name: Q.F32 if len(t.shape) == 1 else Q.Q8_0 if type == "q4_1" and t.name == output else qtype
                for t in file.tensors}
    assert {t.name: t.tensor_type for t in file.tensors} == expected
    diff = (logits(read_back(tmp_path / "tiny.gguf")) - logits(model)).abs().max().item()
    assert diff <= TOLERANCE[type]


# The general.* keys llama.cpp's converter derives from the directory's name and the parameter count, for people
# to read: llama.cpp reads neither.
DESCRIPTIVE = {"general.name", "general.size_label"}


# Every branch of the architecture: biases, untied embeddings and a head_dim of its own with grouped-query
# attention, then multi-query attention (q/k rows are permuted per head: by query heads for q, by key-value heads
# for k); and every type the converter writes. (Each conversion costs seconds: GGUF's 49152-token metadata.)
BRANCHES = {"all": dataclasses.replace(TINY["bias"], tie_word_embeddings=False, head_dim=24), "mqa": TINY["mqa"]}
CONVERSIONS = [("all", "f32"), ("all", "q8_0"), ("mqa", "f16")]


@pytest.mark.slow
@pytest.mark.subprocess
def test_bytes_are_llama_cpps_own_conversion(tmp_path, tokenizer):
    """Tiny models saved as HF directories, converted by llama.cpp's convert_hf_to_gguf.py and exported by
    `smollm2 export`: the same tensors (name, type, shape, bytes) and the same metadata, key for key, but
    DESCRIPTIVE. (The order of the tensors differs: the converter's follows the safetensors file.)"""
    if not SCRIPT.exists():
        pytest.skip(f"no llama.cpp converter in {CONVERTER}: `make install-test` (or python tests/"
                    f"llama_cpp_converter.py) fetches llama-cpp-python {VERSION}'s")
    for name, config in BRANCHES.items():
        save(tiny_model(config), tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    converted = subprocess.run([sys.executable, llama_cpp_converter.__file__, "convert",
                                *(str(arg) for name, type in CONVERSIONS
                                  for arg in (tmp_path / name, type, tmp_path / f"{name}-{type}-llama.gguf"))],
                               capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr[-3000:]
    ignored = DESCRIPTIVE | {"GGUF.kv_count"}
    for name, type in CONVERSIONS:
        ours = tmp_path / f"{name}-{type}.gguf"
        assert main(["export", "--model", str(tmp_path / name), "--to", "gguf", "--type", type,
                     "--out", str(ours)]) == 0
        mine, theirs = open_gguf(ours), open_gguf(tmp_path / f"{name}-{type}-llama.gguf")
        assert {t.name: (t.tensor_type, t.shape) for t in mine.tensors} == \
            {t.name: (t.tensor_type, t.shape) for t in theirs.tensors}, (name, type)
        written = {t.name: t.data.tobytes() for t in mine.tensors}
        for t in theirs.tensors:
            assert written[t.name] == t.data.tobytes(), (name, type, t.name)
        assert {k: v for k, v in mine.metadata.items() if k not in ignored} == \
            {k: v for k, v in theirs.metadata.items() if k not in ignored}, (name, type)


def test_llama_metadata(tmp_path, tokenizer):
    model = tiny_model(TINY["head_dim"])
    save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), tmp_path / "tiny.gguf")
    metadata = open_gguf(tmp_path / "tiny.gguf").metadata
    c = model.config
    expected = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
                "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
                "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
                "rope.dimension_count": c.head_dim, "attention.key_length": c.head_dim,
                "attention.value_length": c.head_dim, "vocab_size": c.vocab_size}
    assert {key: metadata[f"llama.{key}"] for key in expected} == expected
    assert metadata["general.architecture"] == "llama"


@pytest.fixture(scope="module")
def embedded_f32(tmp_path_factory, embedded_path, tokenizer):
    """The embedded model written at f32 from its checkpoint's tensors (decoded from Q4_1)."""
    path = tmp_path_factory.mktemp("embedded") / "smollm2-135m-f32.gguf"
    ckpt = load_checkpoint(embedded_path)
    save_gguf(ckpt.config, ckpt.tensors, tokenizer.gguf_metadata(), path)
    return path


@pytest.mark.slow
def test_embedded_weights_and_config_read_back_identical(embedded_path, embedded_f32):
    original, back = load_checkpoint(embedded_path), load_checkpoint(embedded_f32)
    assert back.config == original.config
    assert back.tensors.keys() == original.tensors.keys()
    assert all(torch.equal(back.tensors[name], w) for name, w in original.tensors.items())


@pytest.mark.slow
def test_embedded_tokenizer_reads_back_identical(embedded_path, embedded_f32, tokenizer, english):
    back = Tokenizer.from_pretrained(embedded_f32)
    for text in [english, *english.splitlines(), *TRICKY]:
        assert back.encode(text) == tokenizer.encode(text), text
    chat = [{"role": "user", "content": "Hi"}]
    assert back.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)
    assert back.chat_template == tokenizer.chat_template
    for which in ("bos", "eos", "pad", "unk"):
        assert getattr(back, f"{which}_token_id") == getattr(tokenizer, f"{which}_token_id"), which
    # llama.cpp's view: the original file's tokenizer metadata, key for key
    ours, theirs = open_gguf(embedded_f32).metadata, open_gguf(embedded_path).metadata
    keys = [key for key in theirs if key.startswith("tokenizer.") and key != "tokenizer.ggml.add_space_prefix"]
    assert {key: ours.get(key) for key in keys} == {key: theirs[key] for key in keys}


def test_tokenizer_json_as_published(tmp_path, tokenizer, english):
    """SmolLM2's tokenizer.json on the hub: merges as "a b" strings, a ByteLevel post-processor that adds no
    token, offsets trimmed differently; the file written from it is the one written from ours."""
    spec = json.loads(tokenizer.backend.to_str())
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                              "use_regex": True}
    spec["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
    published = Tokenizer(Backend.from_str(json.dumps(spec)), "tokenizer.json", bos="<|im_start|>",
                          eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>",
                          chat_template=tokenizer.chat_template)
    model = tiny_model(TINY["gqa"])
    save_gguf(model.config, model.state_dict(), published.gguf_metadata(), tmp_path / "published.gguf")
    save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), tmp_path / "ours.gguf")
    ours, theirs = open_gguf(tmp_path / "ours.gguf").metadata, open_gguf(tmp_path / "published.gguf").metadata
    keys = [key for key in ours if key.startswith("tokenizer.")]
    assert {key: theirs.get(key) for key in keys} == {key: ours[key] for key in keys}
    assert Tokenizer.from_pretrained(tmp_path / "published.gguf").encode(english) == published.encode(english)


def test_bos_added_by_the_tokenizer_is_written(tmp_path, tokenizer):
    bos_first = Tokenizer(Backend.from_str(tokenizer.backend.to_str()), "bos-first", bos="<|im_start|>",
                          eos="<|im_end|>", chat_template=tokenizer.chat_template)
    bos_first.backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_first.bos_token_id)])
    model = tiny_model(TINY["gqa"])
    save_gguf(model.config, model.state_dict(), bos_first.gguf_metadata(), tmp_path / "bos.gguf")
    assert open_gguf(tmp_path / "bos.gguf").metadata["tokenizer.ggml.add_bos_token"] is True
    assert Tokenizer.from_pretrained(tmp_path / "bos.gguf").encode("Hi") == bos_first.encode("Hi")


def test_cli_exports_a_hf_directory_to_gguf_and_back(tiny_dir, tmp_path, capsys):
    """A HF directory (no GGUF metadata to copy) -> GGUF -> a HF directory again: the same model and tokens."""
    gguf, hf = tmp_path / "tiny.gguf", tmp_path / "hf"
    assert main(["export", "--model", str(tiny_dir), "--to", "gguf", "--type", "f32", "--out", str(gguf)]) == 0
    assert main(["export", "--model", str(gguf), "--to", "hf", "--out", str(hf)]) == 0
    assert str(hf) in capsys.readouterr().out
    original = read_back(tiny_dir)
    assert torch.equal(logits(read_back(gguf)), logits(original))
    assert torch.equal(logits(read_back(hf)), logits(original))
    text = "Hello <|im_start|> 123  world\n"
    assert Tokenizer.from_pretrained(gguf).encode(text) == Tokenizer.from_pretrained(hf).encode(text) \
        == Tokenizer.from_pretrained(tiny_dir).encode(text)


def test_export_writes_a_model_and_its_tokenizer_as_a_hf_directory_or_a_gguf_file(tiny_dir, tmp_path):
    """loading.export, which `smollm2 export` calls: either way, the same model and tokens read back."""
    from smollm2.loading import export

    model, tokenizer = load(tiny_dir, kernels=False), Tokenizer.from_pretrained(tiny_dir)
    gguf, hf = tmp_path / "tiny.gguf", tmp_path / "hf"
    export(model, tokenizer, gguf, gguf_type="f32")
    export(model, tokenizer, hf)
    original, text = read_back(tiny_dir), "Hello <|im_start|> 123  world\n"
    for written in (gguf, hf):
        assert torch.equal(logits(read_back(written)), logits(original))
        assert Tokenizer.from_pretrained(written).encode(text) == tokenizer.encode(text)


def test_cli_exports_gguf_by_default_at_f32_and_at_the_type_asked(tiny_dir, tmp_path):
    for args, file_type in (([], 0), (["--type", "q8_0"], 7)):
        assert main(["export", "--model", str(tiny_dir), "--to", "gguf", *args, "--out", str(tmp_path / "t.gguf")]) == 0
        assert open_gguf(tmp_path / "t.gguf").metadata["general.file_type"] == file_type


def test_cli_exports_a_model_with_an_adapter_merged(tiny_dir, tmp_path):
    from smollm2.lora import add_lora, save_adapter

    adapted = add_lora(tiny_model(TINY["gqa"]), r=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:  # B starts at zero: an adapter that changes nothing
                p.normal_(0, 0.05)
    save_adapter(adapted, tmp_path / "adapter")
    assert main(["export", "--model", str(tiny_dir), "--adapter", str(tmp_path / "adapter"), "--to", "gguf",
                 "--out", str(tmp_path / "merged.gguf")]) == 0
    merged = load(tiny_dir, adapter=tmp_path / "adapter", kernels=False)
    assert not torch.equal(logits(merged), logits(read_back(tiny_dir)))
    assert torch.equal(logits(read_back(tmp_path / "merged.gguf")), logits(merged))


def one_line(error: SmolError) -> str:
    assert "\n" not in str(error)
    return str(error)


def test_bad_inputs_are_one_line_errors(tmp_path, tokenizer):
    model = tiny_model(TINY["gqa"])
    config, state = model.config, model.state_dict()
    cases = [
        (dict(type="q4_k"), "'q4_k'"),
        (dict(path=tmp_path), "is a directory"),
        (dict(path=tmp_path / "no" / "such" / "dir" / "x.gguf"), "no/such/dir"),
        (dict(state={k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}), "layers.1.mlp.up_proj"),
        (dict(state=quantize_int8(tiny_model(TINY["gqa"])).state_dict()), "quantized"),
        (dict(model=tiny_model(dataclasses.replace(config, vocab_size=1000))), "49152 tokens"),
        (dict(tokenizer=Tokenizer(Backend(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)},
                                                           unk_token="w0")), "wordlevel")), "wordlevel"),
    ]
    for change, message in cases:
        args = dict(model=model, state=state, tokenizer=tokenizer, path=tmp_path / "out.gguf", type="f32") | change
        if "model" in change:
            args["state"] = args["model"].state_dict()
        with pytest.raises(SmolError) as e:
            metadata = args["tokenizer"].gguf_metadata()
            save_gguf(args["model"].config, args["state"], metadata, args["path"], args["type"])
        assert message in one_line(e.value), change


def test_failed_export_leaves_the_old_file_and_nothing_else(tmp_path, tokenizer, monkeypatch):
    model = tiny_model(TINY["gqa"])
    path = tmp_path / "model.gguf"
    path.write_bytes(b"the previous file")

    def disk_full(writer, *args, **kwargs):  # once the header and metadata are written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(SmolError, match="No space left on device"):
        save_gguf(model.config, model.state_dict(), tokenizer.gguf_metadata(), path)
    assert path.read_bytes() == b"the previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


@pytest.mark.parametrize("args, message", [
    (["--to", "hf", "--type", "q8_0"], "--type q8_0 is for --to gguf"),
    (["--type", "q8_0"], "--type q8_0 is for --to gguf"),  # --to hf is the default
    (["--to", "gguf"], "is a directory"),
])
def test_cli_bad_exports_are_one_line(tiny_dir, tmp_path, capsys, args, message):
    assert main(["export", "--model", str(tiny_dir), *args, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_cli_export_to_hf_over_a_file_is_one_line(tiny_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert main(["export", "--model", str(tiny_dir), "--out", str(tmp_path / "file" / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot create the checkpoint's directory" in err
    assert (tmp_path / "file").read_text() == "mine"
